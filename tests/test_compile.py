"""torch.compile(fullgraph=True) of a whole MoELayer forward (bf16, fp8 and MXFP4): every op is a registered custom
op with a fake implementation, so Dynamo traces the block without a graph break."""

from __future__ import annotations

import pytest
import torch
from tolerances import experts_tolerance

from moefuse import MoEConfig, MoELayer, _runtime
from moefuse.testing import assert_rel_close

CONFIG = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2, num_shared_experts=1,
                   num_expert_group=2, topk_group=1, routed_scaling_factor=2.5)


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "not-deferred"])
def test_layer_compiles_without_graph_breaks(deferred, gen, monkeypatch):
    monkeypatch.setattr(_runtime.DEFAULTS, "deferred_finalize", deferred)
    torch._dynamo.reset()
    layer = MoELayer(CONFIG, dtype=torch.float32, backend="reference").init_random_(7, std=0.1)
    x = torch.randn(5, CONFIG.hidden_size, generator=gen)
    with torch.no_grad():
        want = layer(x)
        got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert_rel_close(got, want, 1e-6)


QUANTIZED = {  # the shared expert is fp8 block-scale in both, so I is a multiple of 128
    "fp8": MoEConfig(hidden_size=128, intermediate_size=128, num_experts=6, top_k=2, num_shared_experts=1,
                     routed_scaling_factor=1.5),
    "mxfp4": MoEConfig(hidden_size=96, intermediate_size=128, num_experts=6, top_k=2, num_shared_experts=1,
                       routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=0.5),
}


@pytest.mark.parametrize("quant", sorted(QUANTIZED))
def test_quantized_layer_compiles_without_graph_breaks(quant, gen):
    """The fp8 and MXFP4 layers too: the quantized experts are custom ops, and the fp8 shared expert's check that
    its gate and up tensors share one storage is taken at trace time (addresses cannot be traced)."""
    torch._dynamo.reset()
    layer = MoELayer(QUANTIZED[quant], quant=quant, backend="reference").init_random_(7, std=0.1)
    x = torch.randn(5, QUANTIZED[quant].hidden_size, generator=gen).bfloat16()
    with torch.no_grad():
        want = layer(x)
        got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    # Usually bit-equal, but aot_eager's decompositions may round an op before the activation quantization
    # differently, which flips one e4m3 rounding (an H100 machine's CPU, torch 2.11, seed 4005251529, 2026-12-05):
    # the bound is the format's own (tests/tolerances.py), far below an O(1) error.
    assert_rel_close(got.float(), want.float(), experts_tolerance(quant, 16)[0])


def test_dispatch_and_experts_ops_pass_opcheck(gen):
    # torch.library.opcheck runs the schema, fake-tensor, autograd-registration and AOT-dispatch checks of a custom
    # op on real arguments (router and finalize have their own in their test files).
    from moefuse.dispatch import moe_dispatch
    from moefuse.experts import pick
    from moefuse.experts.op import _tiles_to_list

    E, H, I, M, K, block_m = 6, 32, 16, 5, 2, 16
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(M)]).to(torch.int32)
    plan = moe_dispatch(ids, E, block_m, backend="reference")
    outputs = [torch.empty_like(t) for t in (plan.expert_offsets, plan.permuted_to_expanded,
                                             plan.expanded_to_permuted, plan.tile_expert, plan.tile_row_start)]
    torch.library.opcheck(torch.ops.moefuse.dispatch.default, (ids, E, block_m, False, "reference", *outputs))

    hidden = torch.randn(M, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    config = pick(M, E, H, I, K, hidden.dtype, block_m=block_m)
    out = torch.empty(M * K, H)
    torch.library.opcheck(torch.ops.moefuse.experts.default, (
        hidden, w13, w2, plan.expert_offsets, plan.permuted_to_expanded, plan.expanded_to_permuted,
        plan.tile_expert, plan.tile_row_start, K, block_m, None,
        _tiles_to_list(config.gemm1) + _tiles_to_list(config.gemm2), False, "reference", [0, 0], out))
