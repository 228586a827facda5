"""Router (``moe_fused_gate``) on the GPU: correctness on real shapes, then device time per call.

``check(device)`` routes real batch sizes (up to 8192 tokens) for every configuration and judges the kernel
against the float64 reference (``moefuse.route.reference.compare_to_reference``: rows whose experts differ
beyond a near tie, max per-row weight error), and checks that a CUDA graph captured around the op replays to
the same result on new inputs, padding count included.

``run(ceilings, quick)`` times, under CUDA-graph replay with rotating input sets, the kernel, the PyTorch
reference (eager and ``torch.compile``; None where that fails) and compares with the memory floor (logits and
bias read, weights and ids written, at the measured copy bandwidth) and the best public Triton router measured
on an H200 (``anchors_h200.json``). Inputs follow the anchor: fp32 logits N(0, 2), bias N(0, 0.5),
renormalize, routed scaling 2.5.

``python -m moefuse.bench.router [--quick]`` runs both standalone.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch

from moefuse.bench import report, timing
from moefuse.route import kernel, moe_fused_gate, moe_fused_gate_torch
from moefuse.route.reference import compare_to_reference

# label, experts, topk, groups, groups kept, scoring, fused shared slots
CONFIGS: list[tuple[str, int, int, int, int, str, int]] = [
    ("DSV3 256 g8k4 top8", 256, 8, 8, 4, "sigmoid", 0),
    ("DSV3 256 g8k4 top8+1 shared", 256, 9, 8, 4, "sigmoid", 1),
    ("256 top8 sigmoid", 256, 8, 1, 1, "sigmoid", 0),
    ("Kimi 384 top8 sigmoid", 384, 8, 1, 1, "sigmoid", 0),
    ("DSV4 256 top6 sqrtsoftplus", 256, 6, 1, 1, "sqrtsoftplus", 0),
    ("384 top6 sqrtsoftplus", 384, 6, 1, 1, "sqrtsoftplus", 0),
    ("Qwen3 128 top8 softmax", 128, 8, 1, 1, "softmax", 0),
    ("128 top8 sigmoid", 128, 8, 1, 1, "sigmoid", 0),
    ("512 top8 sigmoid", 512, 8, 1, 1, "sigmoid", 0),
]
TOKENS = (1, 16, 64, 512, 4096, 8192)
QUICK_TOKENS = (1, 512, 8192)
CHECK_TOKENS = (1, 333, 8192)
SCALE = 2.5
WEIGHT_TOL = 1e-5

COLUMNS = [
    ("config", "config"), ("M", "M"), ("us", "µs"), ("floor_us", "floor µs"), ("x_floor", "× floor"),
    ("anchor_us", "best public µs"), ("speedup", "speedup vs public"), ("eager_us", "torch eager µs"),
    ("torch_compile_us", "torch.compile µs"), ("block_m", "rows/program"), ("warps", "warps"),
]
TITLE = "router: moe_fused_gate (fp32 logits, renormalize, scaling 2.5, CUDA-graph replay)"
CHECK_COLUMNS = [
    ("config", "config"), ("logits", "logits"), ("M", "M"), ("bad_rows", "rows off float64"),
    ("tie_rows", "near-tie rows"), ("invalid_rows", "invalid rows"), ("weight_err", "max weight rel err"),
    ("graph_ok", "graph replay equal"), ("ok", "ok"),
]


def _options(config: tuple) -> dict[str, Any]:
    _, _, topk, groups, kept, scoring, shared = config
    return dict(
        topk=topk, scoring_func=scoring, num_fused_shared_experts=shared, renormalize=True,
        routed_scaling_factor=SCALE, num_expert_group=groups, topk_group=kept,
    )


def _inputs(tokens: int, experts: int, *, mean: float = 0.0, dtype=torch.float32, device="cuda"):
    scores = (torch.randn(tokens, experts, device=device) * 2.0 + mean).to(dtype)
    bias = torch.randn(experts, device=device) * 0.5
    return scores, bias


def _graph_replay_equal(config: tuple, tokens: int, device) -> bool:
    """Capture the op once (padding count as a device tensor), replay on new inputs, compare with an eager call."""
    opts = _options(config)
    experts = config[1]
    scores, bias = _inputs(tokens, experts, device=device)
    n_valid = torch.tensor(tokens, dtype=torch.int32, device=device)
    out = (torch.empty(tokens, opts["topk"], device=device), torch.empty(tokens, opts["topk"], dtype=torch.int32,
                                                                      device=device))
    call = functools.partial(moe_fused_gate, scores, bias, **opts, num_token_non_padded=n_valid, out=out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    new_scores, new_bias = _inputs(tokens, experts, device=device)
    scores.copy_(new_scores)
    bias.copy_(new_bias)
    n_valid.fill_(max(tokens - 3, 0))
    graph.replay()
    torch.cuda.synchronize()
    want = moe_fused_gate(new_scores, new_bias, **opts, num_token_non_padded=max(tokens - 3, 0))
    return torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


def check(device: torch.device | str = "cuda") -> list[dict[str, Any]]:
    """Kernel vs float64 reference on every configuration at real token counts, plus a graph-replay check."""
    device = torch.device(device)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for config in CONFIGS:
        opts = _options(config)
        dists = [("N(0,2)", 0.0, torch.float32), ("N(0,2) bf16", 0.0, torch.bfloat16)]
        if config[5] == "sqrtsoftplus":
            dists.append(("N(-14,2)", -14.0, torch.float32))
        for logits, mean, dtype in dists:
            for tokens in CHECK_TOKENS:
                scores, bias = _inputs(tokens, config[1], mean=mean, dtype=dtype, device=device)
                weights, ids = moe_fused_gate(scores, bias, **opts)
                verdict = compare_to_reference(weights, ids, scores, bias, **opts)
                rows.append({"config": config[0], "logits": logits, "M": tokens, **verdict})
        rows[-1]["graph_ok"] = _graph_replay_equal(config, 512, device)
    for row in rows:
        row["ok"] = (row["bad_rows"] == 0 and row["invalid_rows"] == 0 and row["weight_err"] <= WEIGHT_TOL
                     and row.get("graph_ok", True))
    return rows


def _anchor_us(config: tuple, tokens: int) -> float | None:
    _, experts, topk, groups, kept, scoring, shared = config
    for row in report.anchors(torch.cuda.get_device_name())["router_best_public_triton"]["rows"]:
        if (row["num_experts"], row["topk"], row["num_expert_group"], row["topk_group"], row["scoring"],
                row["fused_shared"], row["tokens"]) == (experts, topk, groups, kept, scoring, shared, tokens):
            return float(row["us"])
    return None


def run(ceilings: timing.Ceilings, quick: bool = False) -> list[dict[str, Any]]:
    """Device time per call for every (configuration, M); see the module docstring for the columns."""
    rows = []
    for config in CONFIGS:
        opts = _options(config)
        experts, topk = config[1], opts["topk"]
        reference = functools.partial(moe_fused_gate_torch, **opts)
        torch._dynamo.reset()  # a fresh compile cache per configuration keeps the recompile limit out of the way
        compiled = torch.compile(reference, dynamic=True)
        for tokens in QUICK_TOKENS if quick else TOKENS:
            nbytes = tokens * experts * 4 + experts * 4 + tokens * topk * (4 + 4)
            sets = [_inputs(tokens, experts) for _ in range(timing.rotations(nbytes))]
            outs = [(torch.empty(tokens, topk, device="cuda"), torch.empty(tokens, topk, dtype=torch.int32,
                                                                           device="cuda")) for _ in sets]
            us = timing.graph_time_us(
                [functools.partial(moe_fused_gate, *s, **opts, out=o) for s, o in zip(sets, outs)])
            eager_us = timing.time_or_none([functools.partial(reference, *s) for s in sets])
            compile_us = None if quick else timing.time_or_none([functools.partial(compiled, *s) for s in sets])
            floor_us = ceilings.memory_floor_us(nbytes)
            anchor = _anchor_us(config, tokens)
            block_m, warps = kernel.launch_config(tokens, experts, opts["num_expert_group"])
            rows.append({
                "config": config[0], "M": tokens, "us": us, "floor_us": floor_us, "x_floor": us / floor_us,
                "anchor_us": anchor, "speedup": anchor / us if anchor else None, "eager_us": eager_us,
                "torch_compile_us": compile_us, "block_m": block_m, "warps": warps,
            })
            del sets, outs
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only M in {QUICK_TOKENS}, no torch.compile")
    args = parser.parse_args(argv)
    print(report.format_table(check("cuda"), CHECK_COLUMNS, "router: kernel vs float64 reference"), flush=True)
    print(report.format_table(run(timing.measure_ceilings(gemm=False), quick=args.quick), COLUMNS, TITLE))


if __name__ == "__main__":
    main()
