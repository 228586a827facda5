"""Does fp8 wgmma give a row the same bits swapped (weights as the MMA's M, 16 rows as its N) as in a 64-row tile?
(GPU.)

The batch-invariant fp8 experts plan 64 rows or more so that GEMM1 runs wgmma at every size (a 16-row tile runs
mma.sync, whose sums differ). If swapped wgmma (GEMM2's decode tiles: the weights as M, the rows as N) gave a row a
64-row tile's bits, the invariant token could keep the default's 16-row plan and GEMM2, and GEMM1's halves would not
spend a third of each pipeline stage on a 64-row activation box. This runs ``_add_scaled`` (one step's product,
promoted by its scales) over K on a 64-row activation tile unswapped and on its first 16 rows swapped, against one
128-column weight tile, for random e4m3 draws of several magnitudes, and counts the output elements whose bits
differ. Prints one JSON object.

    python -m research.fp8_swap_bits [--draws 60] [--k 7168]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from moefuse.experts.fp8.kernels import _add_scaled


@triton.jit
def _steps_kernel(a_ptr, w_ptr, as_ptr, ws_ptr, out_ptr, K, BLOCK_M: tl.constexpr, SWAP: tl.constexpr):
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
        a_scale = tl.load(as_ptr + rows * (K // 128) + k0 // 128)
        acc = _add_scaled(acc, a, w, a_scale, tl.load(ws_ptr + k0 // 128), True, SWAP)
    if SWAP:
        acc = acc.T
    tl.store(out_ptr + rows[:, None] * 128 + cols[None, :], acc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=60)
    parser.add_argument("--k", type=int, default=7168, help="the reduction length, a multiple of 128")
    args = parser.parse_args(argv)
    K, dev = args.k, "cuda"
    differing, wgmma = 0, None
    for draw in range(args.draws):
        gen = torch.Generator(dev).manual_seed(draw)
        spread = 10.0 ** (draw % 5 - 2)  # activations from 1e-2 to 1e2 times the weights' magnitude
        a = (torch.randn(64, K, device=dev, generator=gen) * 100 * spread).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = (torch.randn(128, K, device=dev, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        a_scales = torch.rand(64, K // 128, device=dev, generator=gen) + 0.5
        w_scales = torch.rand(K // 128, device=dev, generator=gen) + 0.5
        tall, short = torch.empty(64, 128, device=dev), torch.empty(16, 128, device=dev)
        c64 = _steps_kernel[(1,)](a, w, a_scales, w_scales, tall, K, BLOCK_M=64, SWAP=False, num_warps=4)
        c16 = _steps_kernel[(1,)](a[:16].contiguous(), w, a_scales[:16].contiguous(), w_scales, short, K,
                                  BLOCK_M=16, SWAP=True, num_warps=4)
        differing += int((tall[:16].view(torch.int32) != short.view(torch.int32)).sum())
        wgmma = "wgmma" in c64.asm["ptx"] and "wgmma" in c16.asm["ptx"]
    print(json.dumps({"draws": args.draws, "K": K, "elements": args.draws * 16 * 128, "differing": differing,
                      "both_on_wgmma": wgmma, "gpu": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
