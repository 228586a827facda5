"""Does wgmma give a row the same bits with its operands swapped (the weights as the MMA's M, 16 rows as its N) as
in a 64-row tile? (GPU.)

The batch-invariant experts plan 64 rows or more so that their GEMMs run wgmma at every size (a 16-row tile runs
mma.sync, whose sums differ). If swapped wgmma (the fp8 GEMM2's decode tiles: the weights as M, the rows as N) gave
a row a 64-row tile's bits, the invariant token could keep the default's 16-row plans, and fp8 GEMM1's halves would
not spend a third of each pipeline stage on a 64-row activation box. Per dtype, this sums a 64-row activation tile
against one 128-column weight tile over K unswapped, and its first 16 rows swapped, for random draws of several
magnitudes, and counts the output elements whose bits differ: fp8 through the experts' ``_add_scaled`` (each
128-deep step's product promoted by its scales, SPEC §5), bf16 and fp16 as the 16-bit GEMMs sum (the products of
the steps accumulated in fp32 by the MMA). Prints one JSON object a dtype.

With ``--permute`` the swapped 16 rows multiply both operands with K permuted within each group of 32 as an fp8
register operand would hold a thread's packed word (:func:`word_order`), against the 64-row tile in natural order:
does the order within 32 change fp8 wgmma's sums? (W4A8's decode and 128-row kernels both take this order, so
their bits do not rest on the answer.)

    python -m research.swap_bits [--dtypes fp8 bf16 fp16] [--draws 60] [--k 7168] [--permute]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from moefuse.experts.fp8.kernels import _add_scaled

DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16}


def word_order(K: int, device: str = "cpu") -> torch.Tensor:
    """Column ``p`` of the permuted operand is column ``order[p]`` of the natural one: in each group of 32, an fp8
    wgmma register operand's thread t holds positions 4t..4t+3 and 16+4t..16+4t+3, and a thread converting its own
    word (MXFP4 codes 8t..8t+7) puts codes 8t..8t+3 at the first four and 8t+4..8t+7 at the second."""
    p = torch.arange(32)
    t, j, high = (p % 16) // 4, p % 4, p // 16
    group = 8 * t + 4 * high + j
    return (torch.arange(0, K, 32)[:, None] + group[None, :]).reshape(-1).to(device)


@triton.jit
def _steps_kernel(a_ptr, w_ptr, as_ptr, ws_ptr, out_ptr, K, BLOCK_M: tl.constexpr, SWAP: tl.constexpr,
                  SCALED: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, 128)
    ks = tl.arange(0, 128)
    if SWAP:
        acc = tl.zeros([128, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    for k0 in range(0, K, 128):
        a = tl.load(a_ptr + rows[:, None] * K + (k0 + ks)[None, :])
        w = tl.load(w_ptr + cols[None, :] * K + (k0 + ks)[:, None])  # [K, N] view of the [N, K] weight
        if SCALED:
            a_scale = tl.load(as_ptr + rows * (K // 128) + k0 // 128)
            acc = _add_scaled(acc, a, w, a_scale, tl.load(ws_ptr + k0 // 128), True, SWAP)
        elif SWAP:
            acc = tl.dot(w.T, a.T, acc)
        else:
            acc = tl.dot(a, w, acc)
    if SWAP:
        acc = acc.T
    tl.store(out_ptr + rows[:, None] * 128 + cols[None, :], acc)


def differing(name: str, draws: int, K: int, device: str = "cuda", permute: bool = False) -> dict:
    """The elements of ``draws`` draws whose bits differ between the 64-row tile and the swapped 16 rows (with
    ``permute``, those on K in :func:`word_order`)."""
    dtype, scaled = DTYPES[name], name == "fp8"
    count, wgmma = 0, None
    for draw in range(draws):
        gen = torch.Generator(device).manual_seed(draw)
        spread = 10.0 ** (draw % 5 - 2)  # activations from 1e-2 to 1e2 times the weights' magnitude
        top = 448 if scaled else 6e4
        a = (torch.randn(64, K, device=device, generator=gen) * 100 * spread).clamp(-top, top).to(dtype)
        w = (torch.randn(128, K, device=device, generator=gen) * 100).clamp(-top, top).to(dtype)
        if not scaled:  # 16-bit sums of K such products stay finite in fp32
            a, w = a / 100, w / 100
        a_scales = torch.rand(64, K // 128, device=device, generator=gen) + 0.5
        w_scales = torch.rand(K // 128, device=device, generator=gen) + 0.5
        tall = torch.empty(64, 128, device=device)
        short = torch.empty(16, 128, device=device)
        c64 = _steps_kernel[(1,)](a, w, a_scales, w_scales, tall, K, BLOCK_M=64, SWAP=False, SCALED=scaled,
                                  num_warps=4)
        order = word_order(K, device) if permute else slice(None)
        c16 = _steps_kernel[(1,)](a[:16, order].contiguous(), w[:, order].contiguous(), a_scales[:16].contiguous(),
                                  w_scales, short, K, BLOCK_M=16, SWAP=True, SCALED=scaled, num_warps=4)
        count += int((tall[:16].view(torch.int32) != short.view(torch.int32)).sum())
        if device == "cuda":
            wgmma = "wgmma" in c64.asm["ptx"] and "wgmma" in c16.asm["ptx"]
    return {"dtype": name, "draws": draws, "K": K, "permuted": permute, "elements": draws * 16 * 128,
            "differing": count, "both_on_wgmma": wgmma}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--draws", type=int, default=60)
    parser.add_argument("--k", type=int, default=7168, help="the reduction length, a multiple of 128")
    parser.add_argument("--permute", action="store_true", help="the swapped rows on K in word_order")
    args = parser.parse_args(argv)
    for name in args.dtypes:
        row = differing(name, args.draws, args.k, permute=args.permute)
        print(json.dumps({**row, "gpu": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
