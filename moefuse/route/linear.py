"""Triton router linear for decode batches: fp32 logits ``x @ weight^T`` read straight from 16-bit ``x``.

At decode the router linear is on the critical path before routing can start, and through cuBLAS it costs two
launches (the ``x.float()`` copy, then an fp32 GEMV that is not bandwidth-efficient at M = 1). This kernel reads
``x`` (bf16, fp16 or fp32) and ``weight`` (any of those, fp32 in the checkpoints) and multiplies in fp32 in
registers: one launch, and no upcast copy of a 16-bit router weight either.

Contract of ``_router_logits_kernel``: ``x`` [M, H] with M <= ``MAX_TOKENS``, ``weight`` [E, H], ``out`` fp32
[M, E], any strides. One program per expert: it holds all M rows, walks H in ``BLOCK_K`` chunks with
elementwise fp32 FMAs into a [BLOCK_M, BLOCK_K] accumulator, and reduces it once at the end. Products and sums
are fp32 (IEEE), as in ``F.linear(x.float(), weight.float())``; only the order of the sum differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TOKENS = 16  # larger batches go to cuBLAS's fp32 GEMM, which has the tiles for them
_ELEMS = 8192  # accumulator elements per program: 32 fp32 registers per thread at NUM_WARPS warps
NUM_WARPS = 8


# Integers that vary with the token count are not specialised: no new variant per batch size (moefuse.warmup).
@triton.jit(do_not_specialize=["M"])
def _router_logits_kernel(
    x_ptr, w_ptr, out_ptr, M, H,
    stride_xm, stride_xk, stride_we, stride_wk, stride_om, stride_oe,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + ks * stride_wk  # [BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = ks < H - k0
        w = tl.load(w_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += x * w[None, :]
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    tl.store(out_ptr + rows * stride_om + e * stride_oe, tl.sum(acc, axis=1), mask=row_ok)


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``x @ weight^T`` (fp32) into ``out`` [M, E]; M <= MAX_TOKENS (validated by the caller)."""
    M, H = x.shape
    E = weight.shape[0]
    if M == 0 or E == 0:
        return
    if H == 0:
        out.zero_()
        return
    block_m, block_k = block_shape(M, H)
    _router_logits_kernel[(E,)](
        x, weight, out, M, H, *x.stride(), *weight.stride(), *out.stride(),
        BLOCK_M=block_m, BLOCK_K=block_k, num_warps=NUM_WARPS,
    )


def block_shape(M: int, H: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K): all M rows in one program, and H in as few chunks as the accumulator allows
    (one chunk at M = 1 for H <= 8192, so every load of a program is in flight at once)."""
    block_m = triton.next_power_of_2(M)
    return block_m, max(16, min(triton.next_power_of_2(H), _ELEMS // block_m))
