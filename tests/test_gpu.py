"""GPU-only checks: CUDA-graph replay equals eager for every op and the layer (bf16, fp8, MXFP4), the layer's
self-captured decode graphs (when they re-capture, that they stay correct, what they hold), and the stages under
compute-sanitizer.

Skipped on a machine without a GPU (CI): the interpreter has no CUDA graphs and no sanitizer.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moefuse import MoEConfig, MoELayer, moe_layer_torch
from moefuse.dispatch import moe_dispatch
from moefuse.experts import moe_experts, pick_block_m
from moefuse.finalize import moe_finalize_fuse_shared
from moefuse.route import moe_fused_gate, router_logits
from moefuse.testing import assert_rel_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the sanitizer need a GPU")

CONFIG = MoEConfig(hidden_size=72, intermediate_size=40, num_experts=12, top_k=3, num_shared_experts=1,
                   num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)


def _replayed(fn):
    """fn() eagerly, then fn() captured into a CUDA graph and replayed: (eager result, replayed result)."""
    eager = fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    graph.replay()
    torch.cuda.synchronize()
    return eager, static


def _flat(result):
    if isinstance(result, torch.Tensor):
        return [result]
    if hasattr(result, "expert_offsets"):  # DispatchPlan
        return [result.expert_offsets, result.permuted_to_expanded, result.expanded_to_permuted,
                result.tile_expert, result.tile_row_start]
    return [t for part in result for t in _flat(part)]


@pytest.mark.parametrize("M", [1, 7, 33])
def test_graph_replay_equals_eager_for_every_op(M, gen):
    c, dev, bf16 = CONFIG, "cuda", torch.bfloat16
    x = torch.randn(M, c.hidden_size, generator=gen).to(dev, bf16)
    w_router = torch.randn(c.num_experts, c.hidden_size, generator=gen).to(dev)
    bias = torch.rand(c.num_experts, generator=gen).to(dev)
    w1 = (torch.randn(c.num_experts, 2 * c.intermediate_size, c.hidden_size, generator=gen) * 0.1).to(dev, bf16)
    w2 = (torch.randn(c.num_experts, c.hidden_size, c.intermediate_size, generator=gen) * 0.1).to(dev, bf16)
    shared = torch.randn(M, c.hidden_size, generator=gen).to(dev, bf16)
    logits = router_logits(x, w_router)
    weights, ids = moe_fused_gate(logits, bias, c.top_k, "sigmoid", renormalize=True, routed_scaling_factor=2.5,
                                  apply_routed_scaling_factor_on_output=True, num_expert_group=4, topk_group=2)
    block_m = pick_block_m(M, c.num_experts, c.hidden_size, c.intermediate_size, c.top_k, bf16)
    plan = moe_dispatch(ids, c.num_experts, block_m)
    gemm2_out = moe_experts(x, w1, w2, plan)
    n_valid = int(plan.expert_offsets[-1])
    ops = {
        "router_logits": lambda: router_logits(x, w_router),
        "moe_fused_gate": lambda: moe_fused_gate(logits, bias, c.top_k, "sigmoid", renormalize=True,
                                                 routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=True,
                                                 num_expert_group=4, topk_group=2),
        "moe_dispatch": lambda: moe_dispatch(ids, c.num_experts, block_m),
        "moe_experts": lambda: moe_experts(x, w1, w2, plan)[:n_valid],  # rows past n_valid are never written
        "moe_finalize_fuse_shared": lambda: moe_finalize_fuse_shared(gemm2_out, plan.expanded_to_permuted, weights,
                                                                      shared, c.top_k),
    }
    for name, fn in ops.items():
        eager, replayed = _replayed(fn)
        for a, b in zip(_flat(eager), _flat(replayed)):
            assert torch.equal(a, b), f"{name}: graph replay differs from eager at M = {M}"


def _layer(seed: int) -> MoELayer:
    return MoELayer(CONFIG, dtype=torch.bfloat16, device="cuda").init_random_(seed, std=0.1)


def _plain(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    kept, layer.graphs.max_tokens = layer.graphs.max_tokens, 0
    try:
        return layer(x)
    finally:
        layer.graphs.max_tokens = kept


@pytest.mark.parametrize("M", [1, 4, 16])
def test_layer_graph_equals_plain_path(M, gen):
    layer = _layer(int(torch.randint(1 << 30, (), generator=gen)))
    x = torch.randn(1, M, CONFIG.hidden_size, generator=gen).to("cuda", torch.bfloat16)  # [batch, seq, H]
    with torch.no_grad():
        first = layer(x)  # captures
        again = layer(x)  # replays
        assert len(layer.graphs) == 1
        plain = _plain(layer, x)
    assert torch.equal(first, plain) and torch.equal(again, plain)
    assert_rel_close(first.float(), moe_layer_torch(layer, x, route_dtype=torch.float32), 1e-2)


QUANTIZED = {  # H and I multiples of 128: on Hopper the MXFP4 experts run the Gluon kernels
    "fp8": MoEConfig(hidden_size=128, intermediate_size=128, num_experts=6, top_k=2, num_shared_experts=1,
                     routed_scaling_factor=1.5),
    "mxfp4": MoEConfig(hidden_size=256, intermediate_size=128, num_experts=6, top_k=2, num_shared_experts=1,
                       routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=0.5),
}


@pytest.mark.parametrize("quant", sorted(QUANTIZED))
@pytest.mark.parametrize("M", [1, 5])
def test_quantized_layer_graph_and_compile_equal_plain_path(quant, M, gen):
    """The fp8 and MXFP4 layers (shared expert on the side stream): the layer's own decode graph, replayed, and
    torch.compile(fullgraph=True) give the plain path's output bit for bit."""
    config = QUANTIZED[quant]
    layer = MoELayer(config, quant=quant, device="cuda").init_random_(int(torch.randint(1 << 30, (), generator=gen)),
                                                                    std=0.1)
    x = torch.randn(M, config.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    with torch.no_grad():
        first = layer(x)  # captures
        again = layer(x)  # replays
        assert len(layer.graphs) == 1
        plain = _plain(layer, x)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(first, plain) and torch.equal(again, plain) and torch.equal(compiled, plain)
    assert_rel_close(plain.float(), moe_layer_torch(layer, x, route_dtype=torch.float32), 1e-2)


def test_layer_graph_output_is_not_overwritten_by_the_next_call(gen):
    layer = _layer(1)
    a, b = (torch.randn(3, CONFIG.hidden_size, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        out_a = layer(a)
        kept = out_a.clone()
        layer(b)
    assert torch.equal(out_a, kept)


def test_layer_graph_follows_weight_changes(gen):
    """In-place updates are read by the same graph; a replaced tensor, a move or a dtype change re-captures."""
    layer = _layer(2)
    other = _layer(3)
    x = torch.randn(2, CONFIG.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    with torch.no_grad():
        layer(x)
        graph_key = layer.graphs._key
        layer.load_state_dict(other.state_dict())  # in place: same addresses, same graph, new values
        assert torch.equal(layer(x), _plain(other, x))
        assert layer.graphs._key == graph_key
        layer.experts.down_proj = torch.nn.Parameter(layer.experts.down_proj * 2)  # replaced: re-capture
        assert torch.equal(layer(x), _plain(layer, x))
        assert layer.graphs._key != graph_key
        layer.cpu().cuda()  # moved away and back: new addresses
        assert torch.equal(layer(x), _plain(layer, x))
        layer.float()
        assert torch.equal(layer(x.float()), _plain(layer, x.float()))


def test_layer_graph_holds_one_graph_per_token_count_and_clears(gen):
    layer = _layer(4)
    with torch.no_grad():
        for M in (1, 2, 3, 2, 1, 17):  # 17 > graph_max_tokens: not captured
            layer(torch.randn(M, CONFIG.hidden_size, generator=gen).to("cuda", torch.bfloat16))
    assert len(layer.graphs) == 3
    layer.graphs.clear()
    assert len(layer.graphs) == 0


def test_layer_graph_not_used_with_autograd_or_under_capture(gen):
    layer = _layer(5)
    x = torch.randn(2, CONFIG.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    layer(x)  # grad mode on: the plain path
    assert len(layer.graphs) == 0
    with torch.no_grad():
        eager, replayed = _replayed(lambda: layer(x))  # the eager call captures; the outer capture records plain
    assert len(layer.graphs) == 1
    assert torch.equal(eager, replayed)


def test_layer_copies_capture_their_own(gen):
    import copy

    layer = _layer(6)
    x = torch.randn(2, CONFIG.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    with torch.no_grad():
        want = layer(x)
        twin = copy.deepcopy(layer)
        assert len(twin.graphs) == 0
        assert torch.equal(twin(x), want)


SANITIZE = Path(__file__).resolve().parent.parent / "scripts" / "sanitize.py"


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not on the PATH")
def test_stages_under_compute_sanitizer():
    """memcheck over every stage at odd shapes (scripts/sanitize.py): no out-of-bounds access."""
    proc = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", sys.executable,
                           str(SANITIZE)], capture_output=True, text=True, timeout=900)
    if "Device not supported" in proc.stdout + proc.stderr:
        pytest.skip("compute-sanitizer does not support this device (gVisor)")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout


def _sweep(layer: MoELayer, counts) -> list[str]:
    """The kernels compiled while the layer runs each token count of ``counts``, as "name at N tokens"."""
    from moefuse.warmup import Compilations

    found: list[str] = []
    with torch.no_grad():
        for tokens in counts:
            compiled = Compilations()
            layer(torch.randn(tokens, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16))
            found += [f"{name} at {tokens} tokens" for name in compiled]
    return found


def test_compilations_are_counted(gen):
    """The counter the warm-up tests rely on sees a variant compiled or loaded: the dispatch kernels' in-memory
    caches are emptied for the call (so each launched kernel loads again, from the disk cache), then restored."""
    from moefuse.dispatch import kernel
    from moefuse.warmup import Compilations, _kernels

    mine = [fn for fn in _kernels() if fn.fn.__module__ == kernel.__name__]
    saved = {fn: fn.device_caches for fn in mine}
    ids = torch.randint(0, 8, (37, 2), dtype=torch.int32, generator=gen).cuda()
    try:
        for fn in mine:
            fn.device_caches = type(saved[fn])(saved[fn].default_factory)
        compiled = Compilations()
        moe_dispatch(ids, 8, 16)
        names = compiled.names()
    finally:
        for fn, caches in saved.items():
            fn.device_caches = caches
    assert names and set(names) <= {fn.fn.__qualname__ for fn in mine}, names


def test_no_compiles_after_warmup_across_every_token_count():
    """After warm-up to 4096 tokens, no batch size from 1 to 4096 compiles a kernel (heuristic tiles)."""
    from moefuse.warmup import warmup

    layer = _layer(7)
    report = warmup(layer, 4096, progress=False)
    assert report.compiled is not None and len(report.token_counts) < 200
    assert _sweep(layer, range(1, 4097)) == []


def test_no_compiles_after_warmup_for_a_tuned_preset():
    """The same for a preset whose tiles come from the tuned table and that runs its shared expert as a slot at
    decode (GLM-4.5-Air, full size): every token count to 64, then a stride through 4096 and each power of two
    and its neighbours."""
    from moefuse import preset
    from moefuse.warmup import warmup

    layer = MoELayer(preset("glm-4.5-air"), dtype=torch.bfloat16, device="cuda").init_random_(0)
    warmup(layer, 4096, progress=False)
    counts = set(range(1, 65)) | set(range(65, 4097, 29))
    counts |= {p + d for p in (2**i for i in range(6, 13)) for d in (-1, 0, 1) if p + d <= 4096}
    assert _sweep(layer, sorted(counts)) == []


@pytest.mark.parametrize("quant", sorted(QUANTIZED))
def test_no_compiles_after_warmup_for_quantized_layers(quant):
    """fp8 and MXFP4 layers (on Hopper the Gluon kernels, W4A8 from 512 tokens; the fp8 shared expert's own
    grouped GEMM): after warm-up to 1024 tokens no batch size compiles a kernel: every count to 64, a stride to
    1024, and each count from 508 to 523 (rows that are and are not multiples of 16 on both sides of W4A8's start)."""
    from moefuse.warmup import warmup

    layer = MoELayer(QUANTIZED[quant], quant=quant, device="cuda").init_random_(8, std=0.1)
    warmup(layer, 1024, progress=False)
    counts = set(range(1, 65)) | set(range(65, 1025, 23)) | set(range(508, 524)) | {1023, 1024}
    assert _sweep(layer, sorted(counts)) == []


def test_fp8_shared_expert_on_cublas_under_graphs_compile_and_warmup(gen):
    """The fp8 layer at prefill on Hopper, its shared expert on cuBLAS's block-scaled GEMMs: CUDA-graph replay and
    torch.compile(fullgraph=True) give the eager output bit for bit, and after warm-up no token count on either side
    of the switch from the slot compiles a kernel (rows that are and are not multiples of 4 and 16)."""
    from moefuse.experts.fp8 import mlp as fp8_mlp
    from moefuse.warmup import warmup

    config = MoEConfig(hidden_size=512, intermediate_size=512, num_experts=4, top_k=2, num_shared_experts=1)
    tokens = fp8_mlp.MIN_TOKENS + 2
    if not fp8_mlp.takes(tokens, 512, 512, torch.bfloat16, torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU and a torch with cuBLAS's block scaling (2.9, CUDA 12.9)")
    layer = MoELayer(config, quant="fp8", device="cuda").init_random_(int(torch.randint(1 << 30, (), generator=gen)),
                                                                      std=0.1)
    x = torch.randn(tokens, 512, generator=gen).to("cuda", torch.bfloat16)
    with torch.no_grad():
        eager, replayed = _replayed(lambda: layer(x))
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(replayed, eager) and torch.equal(compiled, eager)
    warmup(layer, tokens + 20, progress=False)
    assert _sweep(layer, range(fp8_mlp.MIN_TOKENS - 20, tokens + 21)) == []


def test_sharded_layer_on_a_nccl_group_of_one(tmp_path, gen):
    """Every parallel mode through NCCL with one rank equals the layer; the fixed-capacity all-to-all has no host
    sync, so a decode step captured in a CUDA graph replays to the same result."""
    import torch.distributed as dist

    from moefuse.parallel import ShardedMoELayer

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        layer = _layer(8)
        x = torch.randn(5, CONFIG.hidden_size, generator=gen).to("cuda", torch.bfloat16)
        with torch.no_grad():
            want = _plain(layer, x).float()
            for mode, capacity in (("ep", None), ("tp", None), ("ep-a2a", None), ("ep-a2a", 5 * CONFIG.top_k)):
                sharded = ShardedMoELayer.from_layer(layer, mode, capacity=capacity)
                assert_rel_close(sharded(x).float(), want, 1e-2, f"{mode} capacity={capacity}")
            eager, replayed = _replayed(lambda: sharded(x))
        assert torch.equal(eager, replayed)
    finally:
        dist.destroy_process_group()
