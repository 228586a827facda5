"""Every stage once at odd shapes, for ``compute-sanitizer --tool memcheck`` (``tests/test_gpu.py`` runs it).

Shapes are chosen to hit the edges: widths that are not multiples of any tile, -1 slots, empty experts, a
strided hidden state, 128-row tiles with short tails, the shared expert as a slot, and the layer's own graphs;
then the quantized experts (SPEC §5, §6): fp8 block-scale, MXFP4 on the Triton kernels (widths not multiples of 128) and
on the warp-specialized Gluon kernels at every tile height they launch (sm_90; W4A8 on 16, 32 and 128 rows), and the fp8
and MXFP4 layers with their fp8 shared experts; then the persistent prefill GEMMs (sm_90).

    compute-sanitizer --tool memcheck python scripts/sanitize.py
"""

from __future__ import annotations

import argparse

import torch

from moefuse import MoEConfig, MoELayer
from moefuse.dispatch import moe_dispatch
from moefuse.experts import GemmTiles, TileConfig, configs, moe_experts, persistent
from moefuse.experts.mxfp4 import w4a8_decode as mxfp4_w4a8_decode
from moefuse.experts.mxfp4 import ws as mxfp4_ws
from moefuse.finalize import moe_finalize_fuse_shared
from moefuse.formats import MXFP4, BlockFP8, ExpertWeight, tile_dtype
from moefuse.layer import Quant
from moefuse.route import moe_fused_gate, router_logits


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    E, H, I, K = 12, 200, 72, 3
    wide = torch.randn(37, H + 9, device=dev, dtype=bf16)
    x = wide[:, 5:5 + H]  # strided rows
    logits = router_logits(x, torch.randn(E, H, device=dev))
    weights, ids = moe_fused_gate(logits, torch.rand(E, device=dev), K, "sigmoid", num_expert_group=4, topk_group=2,
                                  routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=True)
    ids[::5, 1] = -1  # absent slots
    ids[ids == 7] = 8  # expert 7 empty
    w1 = torch.randn(E, 2 * I, H, device=dev, dtype=bf16) * 0.05
    w2 = torch.randn(E, H, I, device=dev, dtype=bf16) * 0.05
    for block_m, tiles in ((16, None), (128, TileConfig(128, GemmTiles(64, 64, 2, 8, 3), GemmTiles(128, 64, 0, 8, 3)))):
        plan = moe_dispatch(ids, E, block_m)
        if tiles is None:
            out = moe_experts(x, w1, w2, plan, swiglu_limit=7.0)
        else:
            with configs.override(tiles):
                out = moe_experts(x, w1, w2, plan)
        moe_finalize_fuse_shared(out, plan.expanded_to_permuted, weights, x.contiguous(), K)
    config = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, num_shared_experts=1,
                       num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)
    layer = MoELayer(config, dtype=bf16, device=dev).init_random_(0)
    with torch.no_grad():
        for tokens in (1, 7, 300):
            h = torch.randn(tokens, H, device=dev, dtype=bf16)
            layer(h)  # graphs at decode sizes, the plain path at 300
            layer.shared_slot_max_tokens = 16
            layer(h)
            layer.shared_slot_max_tokens = None
    quantized()
    persistent_gemms()
    torch.cuda.synchronize()
    print("sanitize: every stage ran")


def persistent_gemms() -> None:
    """The persistent prefill GEMMs (``experts/persistent.py``, sm_90 only; bf16 and fp8 block-scale): ragged and
    empty experts, partial tiles of every height, an I that is not a power of two, a strided hidden state, each item
    order, grid and schedule."""
    if torch.cuda.get_device_capability() != (9, 0):
        return
    dev, bf16 = "cuda", torch.bfloat16
    E, H, I, K = 10, 512, 384, 3
    x = torch.randn(300, 2 * H, device=dev, dtype=bf16)[:, ::2]
    w1 = torch.randn(E, 2 * I, H, device=dev, dtype=bf16) * 0.05
    w2 = torch.randn(E, H, I, device=dev, dtype=bf16) * 0.05
    ids = _ids(300, E, K)
    ids[:200, 0] = 2  # one expert of two tiles and a remainder
    plan = moe_dispatch(ids, E, persistent.BLOCK_M)
    out = torch.empty(plan.num_rows, H, device=dev, dtype=bf16)
    q1, q2 = BlockFP8.quantize(w1), BlockFP8.quantize(w2)
    for programs, dynamic in ((None, False), (1 << 30, False), (None, True), (3, True)):
        persistent.experts_persistent(x, w1, w2, plan, out, 7.0, programs=programs, dynamic=dynamic)
        persistent.experts_persistent_fp8(x, q1, q2, plan, out, 7.0, programs=programs, dynamic=dynamic)


def _ids(tokens: int, E: int, K: int) -> torch.Tensor:
    """Top-K ids without repeats, every fifth token's second slot absent, expert 1 empty."""
    ids = torch.rand(tokens, E - 1, device="cuda").argsort(dim=1)[:, :K].int()
    ids = ids + (ids >= 1).int()
    ids[::5, 1] = -1
    return ids


def quantized() -> None:
    """The fp8 and MXFP4 experts and layers (which run only where their formats are given)."""
    dev, bf16 = "cuda", torch.bfloat16
    E, K = 10, 3
    for H, I, tokens in ((200, 72, (7, 300)), (224, 96, (7, 300)), (256, 384, (1, 40, 300, 520))):
        w1 = torch.randn(E, 2 * I, H, device=dev) * 0.05
        w2 = torch.randn(E, H, I, device=dev) * 0.05
        formats: list[tuple[ExpertWeight, ExpertWeight]] = [(BlockFP8.quantize(w1), BlockFP8.quantize(w2))]
        if H % 32 == 0 and I % 32 == 0:
            formats.append((MXFP4.quantize(w1), MXFP4.quantize(w2)))
        for m in tokens:
            x = torch.randn(m, H + 3, device=dev, dtype=bf16)[:, 1:1 + H]  # strided rows
            ids = _ids(m, E, K)
            for gate_up, down in formats:
                # The Gluon kernels (whole 128-deep steps, sm_90) at every height they launch; W4A8 on its decode
                # kernels' heights and 128 rows.
                if isinstance(gate_up, MXFP4) and mxfp4_ws.widths_fit(H, I) and m >= 40:
                    heights = sorted(mxfp4_ws.LAUNCH)
                    for block_m in (*sorted(mxfp4_w4a8_decode.LAUNCH), 128):
                        moe_experts(x, gate_up, down, moe_dispatch(ids, E, block_m), swiglu_limit=7.0,
                                    activation_quant="fp8")
                else:
                    heights = [configs.pick_block_m(m, E, H, I, K, tile_dtype(gate_up, bf16))]
                for block_m in heights:
                    moe_experts(x, gate_up, down, moe_dispatch(ids, E, block_m), swiglu_limit=7.0)
    layers: tuple[tuple[Quant, int, int], ...] = (("fp8", 200, 128), ("mxfp4", 256, 128))
    for quant, H, I in layers:
        config = MoEConfig(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, num_shared_experts=1,
                           routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=0.5)
        for activation_quant in ("default", "fp8") if quant == "mxfp4" else ("default",):
            layer = MoELayer(config, quant=quant, device=dev, activation_quant=activation_quant)
            layer.init_random_(seed=1, std=0.1)
            with torch.no_grad():
                for n in (1, 7, 300):
                    layer(torch.randn(n, H, device=dev, dtype=bf16))


if __name__ == "__main__":
    main()
