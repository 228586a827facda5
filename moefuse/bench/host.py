"""Host cost: what an eager call costs the CPU, beside the GPU time it launches.

An eager decode step (transformers ``generate`` without CUDA graphs) is host-bound when launching its kernels
takes longer than running them. For each public op on DeepSeek-V3 decode inputs and for the whole layer (from the
preset, and from a transformers block through ``moefuse.from_hf``) at 1, 4 and 16 tokens:

- ``host µs``: the median time the call takes to return after a synchronise (it launches and returns; the GPU
  runs behind it): the CPU's cost of one call.
- ``eager wall µs``: back-to-back eager calls, wall time per call until the GPU is done: what an eager loop sees.
- ``graph µs``: device time of the same call under CUDA-graph replay (``timing.graph_time_us``), and
  ``wall / graph``: how far the eager loop is from running at device speed.

The floors of this host, measured in the same run: a plain torch op, an empty Triton launch, and a CUDA-graph
replay of ten launches.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from moefuse.bench import timing
from moefuse.config import preset
from moefuse.dispatch import moe_dispatch
from moefuse.experts import moe_experts, pick_block_m
from moefuse.finalize import moe_finalize_fuse_shared
from moefuse.hf import from_hf
from moefuse.layer import MoELayer
from moefuse.route import moe_fused_gate, router_logits

MODEL = "deepseek-v3"
TOKENS = (1, 4, 16)
COLUMNS = [("what", "call"), ("M", "M"), ("host_us", "host µs"), ("wall_us", "eager wall µs"),
           ("graph_us", "graph µs"), ("x_graph", "wall / graph"), ("target_us", "host target µs")]
TITLE = "Host cost of eager calls (DeepSeek-V3 shapes, bf16)"
OP_TARGET_US = 25.0
LAYER_TARGET_US = 150.0


def host_us(fn: Callable[[], object], *, calls: int = 200) -> float:
    """Median time for ``fn()`` to return, each call started on an idle GPU."""
    fn()
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def wall_us(fn: Callable[[], object], *, calls: int = 100, repeats: int = 5) -> float:
    """Wall time per call of ``calls`` back-to-back eager calls, until the GPU is done (median of ``repeats``)."""
    fn()
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(samples)


def floors() -> list[dict]:
    """Host floors of this machine: a torch op, an empty Triton launch, a graph replay of ten launches."""
    import triton

    @triton.jit
    def _empty(x_ptr):
        pass

    x = torch.ones(16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.add(x, x)
    with torch.cuda.graph(graph):
        for _ in range(10):
            torch.add(x, x)
    return [
        {"what": "floor: torch.add", "host_us": host_us(lambda: torch.add(x, x))},
        {"what": "floor: empty Triton launch", "host_us": host_us(lambda: _empty[(1,)](x))},
        {"what": "floor: graph replay, 10 launches", "host_us": host_us(graph.replay)},
    ]


def _hf_block(seed: int = 0) -> torch.nn.Module:
    """transformers' DeepSeek-V3 block at full size, bf16 on the GPU, random weights (router weight fp32)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    c = preset(MODEL)
    config = DeepseekV3Config(hidden_size=c.hidden_size, moe_intermediate_size=c.intermediate_size,
                              n_routed_experts=c.num_experts, num_experts_per_tok=c.top_k, n_group=c.num_expert_group,
                              topk_group=c.topk_group, n_shared_experts=c.num_shared_experts,
                              routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=True)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            block = DeepseekV3MoE(config).eval()
    finally:
        torch.set_default_dtype(default)
    for name in ("weight", "e_score_correction_bias"):  # fp32, as checkpoints store them
        tensor = getattr(block.gate, name)
        tensor.data = tensor.data.float()
    gen = torch.Generator("cuda").manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(block.named_parameters()) + list(block.named_buffers()):
            for part in tensor.view(-1, tensor.shape[-1]).split(4096):
                part.normal_(0.0, 0.01 if name.endswith("e_score_correction_bias") else 0.02, generator=gen)
    return block


def _op_rows(layer: MoELayer) -> list[dict]:
    """Each public op on the inputs of a one-token decode step."""
    c = layer.config
    x = torch.randn(1, c.hidden_size, device="cuda", dtype=torch.bfloat16)
    bias = layer.gate.e_score_correction_bias
    logits = router_logits(x, layer.gate.weight)

    def gate() -> tuple[torch.Tensor, torch.Tensor]:
        return moe_fused_gate(logits, bias, c.top_k, c.scoring_func, renormalize=c.renormalize,
                              routed_scaling_factor=c.routed_scaling_factor,
                              apply_routed_scaling_factor_on_output=True, num_expert_group=c.num_expert_group,
                              topk_group=c.topk_group)

    weights, ids = gate()
    block_m = pick_block_m(1, c.num_experts, c.hidden_size, c.intermediate_size, c.top_k, x.dtype)
    plan = moe_dispatch(ids, c.num_experts, block_m)
    w1, w2 = layer.experts.gate_up_proj, layer.experts.down_proj
    gemm2_out = moe_experts(x, w1, w2, plan)
    shared_expert = layer.shared_experts
    assert shared_expert is not None  # the preset has one
    shared = shared_expert(x)
    calls: dict[str, Callable[[], object]] = {
        "router_logits": lambda: router_logits(x, layer.gate.weight),
        "moe_fused_gate": gate,
        "moe_dispatch": lambda: moe_dispatch(ids, c.num_experts, block_m),
        "moe_experts": lambda: moe_experts(x, w1, w2, plan),
        "moe_finalize_fuse_shared": lambda: moe_finalize_fuse_shared(gemm2_out, plan.expanded_to_permuted, weights,
                                                                      shared, c.top_k),
        "shared expert (3 torch linears)": lambda: shared_expert(x),
    }
    rows = []
    with torch.no_grad():
        for name, fn in calls.items():
            target = OP_TARGET_US if name.startswith("moe") or name == "router_logits" else None
            rows.append({"what": name, "M": 1, "host_us": host_us(fn), "wall_us": wall_us(fn),
                         "graph_us": timing.graph_time_us([fn], replays=20), "target_us": target})
    return rows


def _layer_rows(name: str, layer: MoELayer) -> list[dict]:
    rows = []
    with torch.no_grad():
        for tokens in TOKENS:
            x = torch.randn(tokens, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
            graph_us = timing.graph_time_us([lambda: layer(x)], replays=20)  # captured: the plain path
            for mode, limit in (("", layer.graphs.max_tokens), (", no self-captured graph", 0)):
                kept, layer.graphs.max_tokens = layer.graphs.max_tokens, limit
                try:
                    row: dict[str, Any] = {
                        "what": f"{name}{mode}", "M": tokens, "host_us": host_us(lambda: layer(x), calls=100),
                        "wall_us": wall_us(lambda: layer(x)), "graph_us": graph_us,
                        "target_us": LAYER_TARGET_US if tokens == 1 and not mode else None}
                finally:
                    layer.graphs.max_tokens = kept
                row["x_graph"] = row["wall_us"] / graph_us
                rows.append(row)
            layer.graphs.clear()
    return rows


def run(ceilings: timing.Ceilings, quick: bool = False) -> list[dict]:
    del ceilings, quick  # host floors are measured here; there is nothing to shorten
    rows = floors()
    layer = MoELayer(preset(MODEL), dtype=torch.bfloat16, device="cuda").init_random_(0)
    rows += _op_rows(layer)
    for row in rows:
        if row.get("graph_us"):
            row["x_graph"] = row["wall_us"] / row["graph_us"]
    rows += _layer_rows(f"MoELayer ({MODEL} preset)", layer)
    del layer
    torch.cuda.empty_cache()
    block = _hf_block()
    rows += _layer_rows("moefuse.from_hf (transformers DeepseekV3MoE)", from_hf(block))
    del block
    torch.cuda.empty_cache()
    return rows


def check(device: torch.device | str = "cuda") -> list[dict]:
    """The self-captured graph path equals the plain path bit for bit (full-size DeepSeek-V3, decode sizes)."""
    layer = MoELayer(preset(MODEL), dtype=torch.bfloat16, device=device).init_random_(0)
    rows = []
    with torch.no_grad():
        for tokens in TOKENS:
            x = torch.randn(tokens, layer.config.hidden_size, device=device, dtype=torch.bfloat16)
            graphed = layer(x)
            kept, layer.graphs.max_tokens = layer.graphs.max_tokens, 0
            plain = layer(x)
            layer.graphs.max_tokens = kept
            rows.append({"M": tokens, "graphs": len(layer.graphs), "ok": bool(torch.equal(graphed, plain))})
    return rows


CHECK_COLUMNS = [("M", "M"), ("graphs", "graphs held"), ("ok", "graph == plain, bitwise")]


if __name__ == "__main__":
    from moefuse.bench.run import main

    raise SystemExit(main(["host"]))
