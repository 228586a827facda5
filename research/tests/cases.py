"""What the fp8 decode probes' tests share: the device, the random fp8 cases, the fused kernels' item order read
back from the kernel, and the fp8 tolerances the kernels were held to."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moefuse.dispatch import DispatchPlan, moe_dispatch
from moefuse.experts import plan_block_m
from moefuse.formats import BlockFP8
from research.fused_decode import _item_at

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# tests/tolerances.py's fp8 rows as of 2026-12-05, when these kernels last ran on a GPU: (max, RMS) relative error
# against the float64 spec emulation on tiles of 16-32 rows (mma.sync, fp32 sums) and of 64-128 (wgmma's fp8 sums).
_FP8_TOLERANCE = {"short": (5e-2, 1e-2), "tall": (7.5e-2, 2e-2)}


def fp8_tolerance(block_m: int, rows: int | None = None) -> tuple[float, float]:
    """``tests/tolerances.experts_tolerance("fp8", block_m, rows)``: the RMS bound widened to ``max / rows ** 0.25``
    over few rows (a flipped e4m3 rounding of one intermediate value moves every output of its row)."""
    max_tol, rms_tol = _FP8_TOLERANCE["short" if block_m <= 32 else "tall"]
    if rows:
        rms_tol = max(rms_tol, max_tol / rows ** 0.25)
    return max_tol, rms_tol


def fp8_case(E: int, H: int, I: int, M: int, K: int, gen: torch.Generator,  # noqa: E741 (SPEC's name)
             dtype: torch.dtype = torch.bfloat16, dropped: int = 0,
             block_m: int | None = None) -> tuple[torch.Tensor, BlockFP8, BlockFP8, DispatchPlan]:
    """Random fp8 block-scale experts (E experts of widths H and I), M tokens of ``dtype`` routed to K distinct
    experts each with ``dropped`` slots set to -1, and their plan in ``block_m``-row tiles (None: the op's,
    ``plan_block_m``)."""
    w1 = BlockFP8.quantize((torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(DEVICE))
    w2 = BlockFP8.quantize((torch.randn(E, H, I, generator=gen) / I**0.5).to(DEVICE))
    x = torch.randn(M, H, generator=gen).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(M)]).int()
    ids.view(-1)[torch.randperm(M * K, generator=gen)[:dropped]] = -1
    plan = moe_dispatch(ids.to(DEVICE), E, plan_block_m(M, w1, K, dtype) if block_m is None else block_m)
    return x, w1, w2, plan


@triton.jit
def _order_kernel(gemm1_ptr, tile_ptr, sub_ptr, total, num_tiles, lag, g1n, g2n, BLOCK: tl.constexpr):
    items = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    gemm1, tile, sub = _item_at(items, num_tiles, lag, g1n, g2n)
    tl.store(gemm1_ptr + items, gemm1.to(tl.int32), mask=items < total)
    tl.store(tile_ptr + items, tile, mask=items < total)
    tl.store(sub_ptr + items, sub, mask=items < total)


def fused_order(num_tiles: int, lag: int, g1n: int, g2n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused_decode._item_at`` at every place of the order: (GEMM1 or not, tile, index among the tile's items of
    that GEMM), int32 tensors of ``num_tiles`` · (g1n + g2n) items."""
    total = num_tiles * (g1n + g2n)
    gemm1, tile, sub = (torch.empty(total, dtype=torch.int32, device=DEVICE) for _ in range(3))
    _order_kernel[(triton.cdiv(total, 256),)](gemm1, tile, sub, total, num_tiles, lag, g1n, g2n, BLOCK=256)
    return gemm1, tile, sub
