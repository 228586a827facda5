"""Triton kernel for the finalize stage: weighted combine of each token's expert rows plus the shared output.

Contract of ``_finalize_kernel``:

- Inputs: ``gemm2_out`` [R, Hp] (bf16/fp16/fp32), ``idx`` int32 [M * TOP_K] (row of slot k, the k-th routed
  choice, of token t at ``t * TOP_K + k``, -1 = absent), ``weights`` [M, TOP_K] (fp32/bf16), optionally
  ``shared`` [M, H] of gemm2_out's dtype. Every tensor comes with all its strides, so views (column slices,
  transposes, expanded weights) need no copy; Triton specialises a stride equal to 1, so the contiguous case gets
  vector loads.
- Output: ``out`` [M, H] of gemm2_out's dtype, every element written exactly once.
- Grid: (M, cdiv(H, BLOCK_H)). Program (t, c) owns token t and columns [c * BLOCK_H, (c + 1) * BLOCK_H).
- Each program reads token t's TOP_K row indices and weights (scalars, once), issues the TOP_K masked row loads
  of its column slice (TOP_K is a constexpr, so the loop is unrolled and all loads are independent of the
  running sum and can be in flight together), accumulates ``w * x`` in fp32 in slot order, adds the shared
  slice and stores once in the output dtype. A slot whose row is outside [0, R) is absent: its load is masked
  off, so the kernel never reads out of bounds whatever the indices hold.
- Memory-bound: TOP_K row slices + the shared slice in, one slice out, nothing re-read. A 16-byte access per
  thread per row (BLOCK_H = 16 bytes x 32 lanes x num_warps) keeps the loads as wide as the hardware allows.
  Those vector accesses need what Triton can prove at launch: unit column strides, 16-byte aligned base
  pointers, and H and row strides divisible by 16 (Triton specialises such integers), as every real model
  width is. Otherwise the result is the same, with narrower accesses.
- Rounding: compiled, ``acc + w * x`` becomes one FMA (one rounding); the interpreter and the PyTorch reference
  multiply and add separately, so the GPU result may sit one output ulp from the reference. The final fp32 ->
  output conversion is round-to-nearest-even everywhere (the interpreter needs ``SOFT_BF16`` for that).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _runtime

# Column tiles of 1024 elements at 16 bytes per thread (4 warps for bf16/fp16, 8 for fp32): within 0.05 µs of the
# best of 8 tile shapes at every size swept (one H200, scripts/sweep_finalize.py: bf16, M = 1 / 16 / 128 / 4096 at
# H = 7168, 4096, 2048 with top-8/6/8), while narrower tiles that spread a small M over more programs lose up to
# 25% at M = 16 and 128.
_VECTOR_BYTES = 16
_TILE_ELEMS = 1024


def finalize_tile(num_tokens: int, hidden: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` for M tokens of width H in ``dtype``: a pure function, so CUDA graphs stay valid.

    One program per (token, 1024-column tile), each thread moving 16 bytes per row: the fastest at every M (see
    above), so the shape depends on the dtype alone.
    """
    per_warp = _VECTOR_BYTES // dtype.itemsize * 32  # elements one warp moves in one 16-byte access per thread
    return _TILE_ELEMS, max(1, _TILE_ELEMS // per_warp)


@triton.jit
def _to_bf16_rtne(x):
    """fp32 -> bf16, round to nearest even, in integer ops: the interpreter's own cast truncates (Triton 3.6)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # a carry into the exponent is the correct round-up
    rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits >> 16) | 0x40, rounded)  # NaN stays a (quiet) NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


# Integers that vary with the token count are not specialised: no new variant per batch size (moefuse.warmup).
@triton.jit(do_not_specialize=["num_rows"])
def _finalize_kernel(
    gemm2_ptr,
    idx_ptr,
    weights_ptr,
    shared_ptr,
    out_ptr,
    num_rows,
    hidden,
    stride_g_row,
    stride_g_col,
    stride_idx,
    stride_w_tok,
    stride_w_slot,
    stride_s_tok,
    stride_s_col,
    stride_o_tok,
    stride_o_col,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # int64: token * stride can pass 2**31 for large M x H
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < hidden

    if USE_PDL:
        # Everything this kernel reads (indices, weights, expert rows, shared output) may come from the
        # previous kernel: wait for it before the first load.
        tl.extra.cuda.gdc_wait()

    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(idx_ptr + (token * TOP_K + k) * stride_idx).to(tl.int64)
        weight = tl.load(weights_ptr + token * stride_w_tok + k * stride_w_slot).to(tl.float32)
        present = (row >= 0) & (row < num_rows)
        safe_row = tl.where(present, row, 0)  # an absent slot's address is never formed from a wild index
        # where(), not col_mask & present: Triton 3.9's interpreter gives a vector & scalar no mask dtype.
        values = tl.load(
            gemm2_ptr + safe_row * stride_g_row + cols * stride_g_col, mask=tl.where(present, col_mask, False),
            other=0.0,
        ).to(tl.float32)
        # Skip rather than add 0 * w: an absent slot must not contribute even if its weight is inf or NaN.
        acc = tl.where(present, acc + weight * values, acc)
    if HAS_SHARED:
        shared = tl.load(shared_ptr + token * stride_s_tok + cols * stride_s_col, mask=col_mask, other=0.0)
        acc += shared.to(tl.float32)

    if USE_PDL:
        # All reads are done; the next kernel may start its prologue (it still waits for our stores).
        tl.extra.cuda.gdc_launch_dependents()
    if SOFT_BF16:
        result = _to_bf16_rtne(acc)
    else:
        result = acc.to(out_ptr.dtype.element_ty)  # compiled: cvt.rn, one round-to-nearest-even
    tl.store(out_ptr + token * stride_o_tok + cols * stride_o_col, result, mask=col_mask)


def finalize_triton(
    gemm2_out: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    expert_weights: torch.Tensor,
    shared_output: torch.Tensor | None,
    top_k: int,
    out: torch.Tensor,
    use_pdl: bool,
) -> None:
    """Launch ``_finalize_kernel`` writing ``out`` [M, H]. Inputs are assumed validated; M = 0 launches nothing.

    No host sync, no allocation: safe under CUDA-graph capture. ``use_pdl`` must already account for the
    device and the interpreter (``_runtime.pdl_enabled``).
    """
    num_tokens, hidden = out.shape
    if num_tokens == 0 or hidden == 0:
        return
    block_h, num_warps = finalize_tile(num_tokens, hidden, out.dtype)
    # Without a shared output the pointer is never dereferenced (HAS_SHARED prunes the load); `out` stands in.
    shared = shared_output if shared_output is not None else out
    launch_options = {"launch_pdl": True} if use_pdl else {}  # the interpreter rejects the option altogether
    _finalize_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        gemm2_out,
        expanded_idx_to_permuted_idx,
        expert_weights,
        shared,
        out,
        gemm2_out.shape[0],
        hidden,
        gemm2_out.stride(0),
        gemm2_out.stride(1),
        expanded_idx_to_permuted_idx.stride(0),
        expert_weights.stride(0),
        expert_weights.stride(1),
        shared.stride(0),
        shared.stride(1),
        out.stride(0),
        out.stride(1),
        TOP_K=top_k,
        HAS_SHARED=shared_output is not None,
        BLOCK_H=block_h,
        USE_PDL=use_pdl,
        SOFT_BF16=out.dtype == torch.bfloat16 and _runtime.interpreting(),
        num_warps=num_warps,
        **launch_options,
    )

