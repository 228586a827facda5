"""Every stage once at odd shapes, for ``compute-sanitizer --tool memcheck`` (``tests/test_gpu.py`` runs it).

Shapes are chosen to hit the edges: widths that are not multiples of any tile, -1 slots, empty experts, a
strided hidden state, 128-row tiles with short tails, the shared expert as a slot, and the layer's own graphs.

    compute-sanitizer --tool memcheck python scripts/sanitize.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefuse import MoEConfig, MoELayer  # noqa: E402
from moefuse.dispatch import moe_dispatch  # noqa: E402
from moefuse.experts import GemmTiles, TileConfig, configs, moe_experts  # noqa: E402
from moefuse.finalize import moe_finalize_fuse_shared  # noqa: E402
from moefuse.route import moe_fused_gate, router_logits  # noqa: E402


def main() -> None:
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
    torch.cuda.synchronize()
    print("sanitize: every stage ran")


if __name__ == "__main__":
    main()
