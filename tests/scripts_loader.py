"""What the tests of ``scripts/`` share: a script imported as a module (the scripts import each other by name, as
they run from that folder), and the fp8 decode cases and the item order of issue 40's two one-launch kernels'
tests."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import torch
import triton
import triton.language as tl
from conftest import DEVICE

from moefuse.dispatch import DispatchPlan, moe_dispatch
from moefuse.experts import plan_block_m
from moefuse.formats import BlockFP8

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module, with the folder on ``sys.path`` so that its own imports of the others
    resolve to the same modules."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


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


_item_at = script("fused_decode")._item_at


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
