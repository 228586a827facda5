"""Triton grouped GEMMs of the routed experts on 16- and 32-bit weights: GEMM1 with fused SwiGLU, then GEMM2.

Contract (inputs validated by :func:`moefuse.experts.moe_experts`):

- ``hidden`` [M, H]; ``gate_up_proj`` [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1); ``down_proj`` [E, H, I];
  all bf16, fp16 or fp32, any strides. ``plan``: a :class:`moefuse.dispatch.DispatchPlan` of M·K rows.
- ``intermediate`` [M·K, I] and ``out`` [M·K, H] (hidden's dtype): permuted row p of expert e gets
  ``act(x W_g^T) * (x W_u^T)`` resp. its product with ``down_proj[e]^T``, x = hidden[permuted_to_expanded[p] // K].
  Rows of no token (p >= n_valid) are not written.

Grid, both GEMMs: one program per (tile, column block), ``T_max * cdiv(N, BLOCK_N)`` programs, ordered in
groups of GROUP_M consecutive tiles: within a group the tile index runs fastest, so the tiles of one expert
(consecutive in the schedule) load the same weight tile at about the same time and share it through L2.
With GROUP_M = 1 all column blocks of one tile run together instead (they share the gathered activations).
GROUP_M = 0 makes each expert's tiles one group, so a group never splits an expert (see
``common._program_tile``; the fp8 and MXFP4 ``tl`` kernels share this order).
A program whose tile is unused (expert -1) returns at once.

Each program: rows ``[row_start, min(row_start + BLOCK_M, expert_end))`` of its expert's segment. With
128-row tiles (prefill, ``HALF_TILES``) half-tile pieces of 64 rows cut the padding of ragged experts:

- an expert of at most 64 rows runs a 64-row variant of the loop (half the MMA work);
- an expert's last tile, when 1 to 64 rows follow it, takes them as a second, 64-row piece on the same
  weight tiles, and the tile of those rows exits: each weight tile goes from L2 to the SM once for up to 192
  rows instead of twice. The prefill GEMMs are bound by L2 -> SM traffic (Nsight Compute, M = 4096: L2 93-97%
  busy, DRAM 78-83%), so a second program re-reading a 64-row tail's weights costs almost as much as a full tile:
  DeepSeek-V3's GEMM1 + GEMM2 at 4096 tokens of random routing take 6,727-6,767 µs with the tails taken by the
  previous tile (padded rows masked out of the loads), against 7,418-7,549 with the tails run as their own
  half-height tiles (H200, 2026-12-01; outputs bit-identical).

Weights are read through TMA descriptors (``common.weight_descriptor``: each load copies one *box*, a block of the
weight's rows and columns, into shared memory) on sm90+ when their layout allows, else by pointer loads; TMA frees
the registers and instructions of the weight addresses, which lets the prefill tiles pipeline 4 stages deep.

- GEMM1 gathers its activation rows straight from ``hidden`` through ``permuted_to_expanded`` (no permuted
  copy of the activations), accumulates the gate and the up tile of the same BLOCK_N columns in fp32
  (weight rows n and I + n), and in the epilogue applies the optional clamp (gate <= limit, up in
  [-limit, limit]) and ``SiLU(gate) * up``, rounding once to the activation dtype. On wgmma tiles the gate and
  up tiles come in one TMA copy as one [2·BLOCK_N, BLOCK_K] operand of one MMA (``gate_up_descriptor``:
  wgmma 64x256 instead of two 64x128, the activation tile read from shared memory once per step, one barrier
  wait instead of two; outputs bit-identical), as fast or faster: DeepSeek-V3's GEMM1 + GEMM2 at 8192 tokens take
  11,692-11,788 µs against 12,524-12,852 with two MMAs (H200, 2026-12-01).
- GEMM2 reads the contiguous intermediate rows of its tile and multiplies by ``down_proj[e]^T``.

Reductions run in fp32 (``tl.dot`` accumulators); fp32 operands use IEEE products, not TF32. Under
Triton's interpreter, 16-bit operands are upcast to float64 first (its ``tl.dot`` on bf16/fp16 is wrong in
Triton 3.6 to 3.9) and summed in float64, then rounded to fp32 once: numpy's fp32 sums follow the operands'
shapes (a 16- and a 64-row fp16 tile differed by fp16's least subnormal in one output of 1,280), its float64 sums
of 16-bit products are exact, so a row gets the same bits on every tile, as on a GPU's wgmma; bf16 results are
rounded to nearest on the bits (its cast truncates).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import _runtime
from ..dispatch import DispatchPlan
from .common import _program_start, _round, _swiglu, _tma_readable, weight_descriptor
from .configs import SMEM_BUDGET, WGMMA_MIN_ROWS, GemmTiles, smem_bytes


@triton.jit
def _half_tile_pieces(tile, expert, tile_row_start_ptr, expert_offsets_ptr, BLOCK_M: tl.constexpr,
                      HALF_TILES: tl.constexpr):
    """A bf16 GEMM program's rows, ``row_start`` of its tile and ``row_end`` of its expert, and with ``HALF_TILES``
    (128-row tiles) what it runs instead of its tile: ``taken``, nothing (its rows are the 1 to BLOCK_M / 2 last of
    an expert, which the previous tile takes); ``with_tail``, its tile plus those rows; ``half``, its tile at half
    height (the expert has at most BLOCK_M / 2 rows)."""
    row_start = tl.load(tile_row_start_ptr + tile)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    short = row_end - row_start <= BLOCK_M // 2
    taken = HALF_TILES and short and row_start > tl.load(expert_offsets_ptr + expert)
    with_tail = HALF_TILES and row_end - row_start > BLOCK_M and row_end - row_start <= BLOCK_M + BLOCK_M // 2
    return row_start, row_end, taken, with_tail, HALF_TILES and short


@triton.jit
def _halves(acc, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The gate and up halves of a joint [ROWS, 2·BLOCK_N] accumulator (gate columns first)."""
    return acc.reshape(ROWS, 2, BLOCK_N).permute(0, 2, 1).split()


@triton.jit
def _load_rows_tile(ptrs, row_ok, ks, k_left, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """An activation tile [rows, BLOCK_K] at ``ptrs``: rows not ``row_ok`` (past the expert's end) read zeros, and,
    unless ``EVEN_K``, so do columns at or past ``k_left``; float64 under the interpreter (``UPCAST``)."""
    if EVEN_K:
        x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=row_ok[:, None] & (ks < k_left)[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float64)
    return x


@triton.jit
def _load_weight_tile(w_desc, row, k0, ptrs, ks, k_left, W_TMA: tl.constexpr, EVEN_K: tl.constexpr,
                      UPCAST: tl.constexpr):
    """A weight tile [BLOCK_K, BLOCK_N] at K offset ``k0``: rows ``row ..`` of the [E·R, K] view through TMA (zeros
    past K), else through ``ptrs`` (masked at or past ``k_left`` unless ``EVEN_K``); float64 under the interpreter."""
    if W_TMA:
        w = w_desc.load([row, k0]).T
    elif EVEN_K:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=(ks < k_left)[:, None], other=0.0)
    if UPCAST:
        w = w.to(tl.float64)
    return w


@triton.jit
def _gemm1_tile(
    hidden_ptr, w_ptr, w_desc, inter_ptr, p2e_ptr, expert, row_start, row_end, col_block,
    N, K, top_k, limit, stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_im, stride_in,
    HAS_LIMIT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    EMULATE_RTNE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_TMA: tl.constexpr, W_JOINT: tl.constexpr, TAIL_M: tl.constexpr = 0, SWAP: tl.constexpr = False,
):
    """One GEMM1 tile: rows [row_start, min(row_start + BLOCK_M + TAIL_M, row_end)) x columns of ``col_block``.

    TAIL_M > 0: the rows past the first BLOCK_M form a second piece of TAIL_M rows that multiplies the same
    weight tiles, so an expert of up to BLOCK_M + TAIL_M rows reads its weights once.

    W_JOINT (``w_desc`` a :func:`gate_up_descriptor`): one TMA copy brings the gate and the up tile as one
    [2·BLOCK_N, BLOCK_K] operand, and one MMA of twice the width multiplies it (wgmma N = 256 for BLOCK_N = 128),
    reading the activation tile from shared memory once per step instead of once per half.

    SWAP (tiles under 64 rows, the batch-invariant order; neither W_JOINT nor TAIL_M): the products summed as
    ``W @ a^T``, the weights the MMA's M and the rows its N, so that the tile runs wgmma, which gives a row the
    bits of a 64-row tile (``swapped``)."""
    rows = row_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] permuted rows
    row_ok = rows < row_end
    # Rows past the expert's end are masked out of the activation loads (zeros): the prefill GEMMs are bound by
    # L2 -> SM traffic, and an expert's padded rows would otherwise read whole rows of token 0. Columns past N
    # wrap around (or, through TMA, read the next rows of the stacked weights or zeros), so the weight loads
    # need no masks unless BLOCK_K does not divide K; the store drops the extra rows/columns.
    tokens = tl.load(p2e_ptr + rows, mask=row_ok, other=0) // top_k  # [BLOCK_M] rows of hidden
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]

    a_ptrs = hidden_ptr + tokens.to(tl.int64)[:, None] * stride_hm + ks[None, :] * stride_hk  # [BLOCK_M, BLOCK_K]
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    gate_ptrs = w_expert + (cols % N)[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    up_ptrs = gate_ptrs + N * stride_wn  # [BLOCK_K, BLOCK_N]
    gate_row = expert * 2 * N + col_block * BLOCK_N  # first weight row of the tile in the [E·2N, K] view
    ACC: tl.constexpr = tl.float64 if UPCAST else tl.float32  # the interpreter's sums: exact, whatever the shape
    if W_JOINT:
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=ACC)
    elif SWAP:
        acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=ACC)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=ACC)
    else:
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    if TAIL_M > 0:
        tail_rows = row_start + BLOCK_M + tl.arange(0, TAIL_M)  # [TAIL_M]
        tail_ok = tail_rows < row_end
        tail_tokens = tl.load(p2e_ptr + tail_rows, mask=tail_ok, other=0) // top_k
        tail_ptrs = hidden_ptr + tail_tokens.to(tl.int64)[:, None] * stride_hm + ks[None, :] * stride_hk
        if W_JOINT:
            tail_acc = tl.zeros([TAIL_M, 2 * BLOCK_N], dtype=ACC)
        else:
            tail_gate = tl.zeros([TAIL_M, BLOCK_N], dtype=ACC)
            tail_up = tl.zeros([TAIL_M, BLOCK_N], dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        a = _load_rows_tile(a_ptrs, row_ok, ks, K - k0, EVEN_K, UPCAST)  # [BLOCK_M, BLOCK_K]
        if TAIL_M > 0:
            t = _load_rows_tile(tail_ptrs, tail_ok, ks, K - k0, EVEN_K, UPCAST)  # [TAIL_M, BLOCK_K]
            tail_ptrs += BLOCK_K * stride_hk
        if W_JOINT:  # zero-filled past N and K
            w = w_desc.load([2 * expert, col_block * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
            if UPCAST:
                w = w.to(tl.float64)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)  # [BLOCK_M, 2·BLOCK_N]: gate, then up columns
            if TAIL_M > 0:
                tail_acc = tl.dot(t, w, tail_acc, input_precision=PRECISION)
        else:
            gate_w = _load_weight_tile(w_desc, gate_row, k0, gate_ptrs, ks, K - k0, W_TMA, EVEN_K, UPCAST)
            up_w = _load_weight_tile(w_desc, gate_row + N, k0, up_ptrs, ks, K - k0, W_TMA, EVEN_K, UPCAST)
            if SWAP:
                acc_gate = tl.dot(gate_w.T, a.T, acc_gate, input_precision=PRECISION)
                acc_up = tl.dot(up_w.T, a.T, acc_up, input_precision=PRECISION)
            else:
                acc_gate = tl.dot(a, gate_w, acc_gate, input_precision=PRECISION)
                acc_up = tl.dot(a, up_w, acc_up, input_precision=PRECISION)
            if TAIL_M > 0:
                tail_gate = tl.dot(t, gate_w, tail_gate, input_precision=PRECISION)
                tail_up = tl.dot(t, up_w, tail_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_hk
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk

    if W_JOINT:
        acc_gate, acc_up = _halves(acc.to(tl.float32), BLOCK_M, BLOCK_N)
    elif SWAP:
        acc_gate = acc_gate.to(tl.float32).T
        acc_up = acc_up.to(tl.float32).T
    else:
        acc_gate = acc_gate.to(tl.float32)
        acc_up = acc_up.to(tl.float32)
    act = _swiglu(acc_gate, acc_up, limit, HAS_LIMIT)  # [BLOCK_M, BLOCK_N]
    out_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_im + cols[None, :] * stride_in
    tl.store(out_ptrs, _round(act, inter_ptr.dtype.element_ty, EMULATE_RTNE), mask=row_ok[:, None] & col_ok[None, :])
    if TAIL_M > 0:
        if W_JOINT:
            tail_gate, tail_up = _halves(tail_acc.to(tl.float32), TAIL_M, BLOCK_N)
        act = _swiglu(tail_gate.to(tl.float32), tail_up.to(tl.float32), limit, HAS_LIMIT)  # [TAIL_M, BLOCK_N]
        out_ptrs = inter_ptr + tail_rows.to(tl.int64)[:, None] * stride_im + cols[None, :] * stride_in
        tl.store(out_ptrs, _round(act, inter_ptr.dtype.element_ty, EMULATE_RTNE),
                 mask=tail_ok[:, None] & col_ok[None, :])


# Integers that vary with the token count are not specialised: no new variant per batch size (moefuse.warmup).
@triton.jit(do_not_specialize=["num_tiles"])
def _gemm1_swiglu_kernel(
    hidden_ptr, w_ptr, w_desc, inter_ptr,
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, p2e_ptr,
    num_tiles, N, K, top_k, limit,
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_im, stride_in,
    HAS_LIMIT: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RTNE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_TMA: tl.constexpr, W_JOINT: tl.constexpr, HALF_TILES: tl.constexpr, USE_PDL: tl.constexpr,
    SWAP: tl.constexpr = False,
):
    """intermediate[rows, n] = SwiGLU(hidden[tok(rows)] @ W[e, n]^T, hidden[tok(rows)] @ W[e, N + n]^T).

    N = I (columns of the intermediate), K = H (reduction).
    """
    tile, col_block, expert = _program_start(num_tiles, N, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                                             BLOCK_M, BLOCK_N, GROUP_M, USE_PDL)
    if expert < 0:
        return
    row_start, row_end, taken, with_tail, half = _half_tile_pieces(tile, expert, tile_row_start_ptr,
                                                                   expert_offsets_ptr, BLOCK_M, HALF_TILES)
    if taken:
        return  # an expert's last few rows: its previous tile took them
    if with_tail:
        _gemm1_tile(hidden_ptr, w_ptr, w_desc, inter_ptr, p2e_ptr, expert, row_start, row_end, col_block,
                    N, K, top_k, limit, stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_im, stride_in,
                    HAS_LIMIT, EVEN_K, PRECISION, UPCAST, EMULATE_RTNE, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, W_JOINT,
                    BLOCK_M // 2)
    elif half:  # an expert of at most half a tile: half the MMA work
        _gemm1_tile(hidden_ptr, w_ptr, w_desc, inter_ptr, p2e_ptr, expert, row_start, row_end, col_block,
                    N, K, top_k, limit, stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_im, stride_in,
                    HAS_LIMIT, EVEN_K, PRECISION, UPCAST, EMULATE_RTNE, BLOCK_M // 2, BLOCK_N, BLOCK_K, W_TMA, W_JOINT)
    else:
        _gemm1_tile(hidden_ptr, w_ptr, w_desc, inter_ptr, p2e_ptr, expert, row_start, row_end, col_block,
                    N, K, top_k, limit, stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_im, stride_in,
                    HAS_LIMIT, EVEN_K, PRECISION, UPCAST, EMULATE_RTNE, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, W_JOINT,
                    0, SWAP)


@triton.jit
def _gemm2_tile(
    inter_ptr, w_ptr, w_desc, out_ptr, expert, row_start, row_end, col_block, N, K,
    stride_im, stride_ik, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RTNE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_TMA: tl.constexpr,
    TAIL_M: tl.constexpr = 0, SWAP: tl.constexpr = False,
):
    """One GEMM2 tile: rows [row_start, min(row_start + BLOCK_M + TAIL_M, row_end)) x columns of ``col_block``
    (TAIL_M: a second piece of rows on the same weight tiles, as in GEMM1; SWAP: the product swapped, as there)."""
    rows = row_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] permuted rows
    row_ok = rows < row_end
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]

    # As in GEMM1: rows past the expert's end are masked out of the activation loads, columns past N wrap
    # around (through TMA: the next expert's rows, zeros past the last); the store drops them.
    a_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_im + ks[None, :] * stride_ik  # [BLOCK_M, BLOCK_K]
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
              + (cols % N)[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk)  # [BLOCK_K, BLOCK_N]
    w_row = expert * N + col_block * BLOCK_N  # first weight row of the tile in the [E·N, K] view
    ACC: tl.constexpr = tl.float64 if UPCAST else tl.float32  # as in GEMM1
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=ACC)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    if TAIL_M > 0:
        tail_rows = row_start + BLOCK_M + tl.arange(0, TAIL_M)  # [TAIL_M]
        tail_ok = tail_rows < row_end
        tail_ptrs = inter_ptr + tail_rows.to(tl.int64)[:, None] * stride_im + ks[None, :] * stride_ik
        tail_acc = tl.zeros([TAIL_M, BLOCK_N], dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        a = _load_rows_tile(a_ptrs, row_ok, ks, K - k0, EVEN_K, UPCAST)  # [BLOCK_M, BLOCK_K]
        w = _load_weight_tile(w_desc, w_row, k0, w_ptrs, ks, K - k0, W_TMA, EVEN_K, UPCAST)  # [BLOCK_K, BLOCK_N]
        if SWAP:
            acc = tl.dot(w.T, a.T, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if TAIL_M > 0:
            t = _load_rows_tile(tail_ptrs, tail_ok, ks, K - k0, EVEN_K, UPCAST)  # [TAIL_M, BLOCK_K]
            tail_acc = tl.dot(t, w, tail_acc, input_precision=PRECISION)
            tail_ptrs += BLOCK_K * stride_ik
        a_ptrs += BLOCK_K * stride_ik
        w_ptrs += BLOCK_K * stride_wk

    acc = acc.to(tl.float32)
    if SWAP:
        acc = acc.T
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on  # [BLOCK_M, BLOCK_N]
    tl.store(out_ptrs, _round(acc, out_ptr.dtype.element_ty, EMULATE_RTNE), mask=row_ok[:, None] & col_ok[None, :])
    if TAIL_M > 0:
        out_ptrs = out_ptr + tail_rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, _round(tail_acc.to(tl.float32), out_ptr.dtype.element_ty, EMULATE_RTNE),
                 mask=tail_ok[:, None] & col_ok[None, :])


# Integers that vary with the token count are not specialised: no new variant per batch size (moefuse.warmup).
@triton.jit(do_not_specialize=["num_tiles"])
def _gemm2_kernel(
    inter_ptr, w_ptr, w_desc, out_ptr,
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
    num_tiles, N, K,
    stride_im, stride_ik, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, EMULATE_RTNE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_TMA: tl.constexpr, HALF_TILES: tl.constexpr, USE_PDL: tl.constexpr, SWAP: tl.constexpr = False,
):
    """out[rows, n] = intermediate[rows] @ down_proj[e, n]^T.  N = H (output columns), K = I (reduction)."""
    tile, col_block, expert = _program_start(num_tiles, N, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                                             BLOCK_M, BLOCK_N, GROUP_M, USE_PDL)
    if expert < 0:
        return
    row_start, row_end, taken, with_tail, half = _half_tile_pieces(tile, expert, tile_row_start_ptr,
                                                                   expert_offsets_ptr, BLOCK_M, HALF_TILES)
    if taken:
        return  # an expert's last few rows: its previous tile took them
    if with_tail:
        _gemm2_tile(inter_ptr, w_ptr, w_desc, out_ptr, expert, row_start, row_end, col_block, N, K,
                    stride_im, stride_ik, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                    EVEN_K, PRECISION, UPCAST, EMULATE_RTNE, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, BLOCK_M // 2)
    elif half:  # an expert of at most half a tile: half the MMA work
        _gemm2_tile(inter_ptr, w_ptr, w_desc, out_ptr, expert, row_start, row_end, col_block, N, K,
                    stride_im, stride_ik, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                    EVEN_K, PRECISION, UPCAST, EMULATE_RTNE, BLOCK_M // 2, BLOCK_N, BLOCK_K, W_TMA)
    else:
        _gemm2_tile(inter_ptr, w_ptr, w_desc, out_ptr, expert, row_start, row_end, col_block, N, K,
                    stride_im, stride_ik, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                    EVEN_K, PRECISION, UPCAST, EMULATE_RTNE, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, 0, SWAP)


def _dtype_flags(dtype: torch.dtype) -> dict:
    """fp32 operands get IEEE products (the default would be TF32); the interpreter's 16-bit ``tl.dot`` and
    bf16 cast need the work-arounds above."""
    interpreting = _runtime.interpreting()
    return {
        "PRECISION": "ieee" if dtype == torch.float32 or interpreting else "tf32",
        "UPCAST": interpreting and dtype != torch.float32,
        "EMULATE_RTNE": interpreting and dtype == torch.bfloat16,
    }


# GEMM1 reads gate and up as one operand on these tiles (``joint_operand``).
JOINT_MIN_BLOCK_M = 64
JOINT_MAX_COLUMNS = 256
HALF_TILES_MIN_BLOCK_M = 128  # smallest tile height with half-tile pieces (wgmma is 64 rows tall)


def joint_operand(block_m: int, block_n: int) -> bool:
    """Whether GEMM1 tiles of this shape read gate and up as one operand (``gate_up_descriptor``): wgmma tiles
    (64 rows or more) of at most 256 columns (the widest wgmma)."""
    return block_m >= JOINT_MIN_BLOCK_M and 2 * block_n <= JOINT_MAX_COLUMNS


def swapped(block_m: int, tiles: GemmTiles, operands: int, element_size: int) -> Optional[GemmTiles]:
    """The launch of a batch-invariant tile of ``block_m`` rows, or None where it runs unswapped (64 rows or more,
    or fp32, whose sums are FMAs on every tile): the product swapped, the weights the MMA's M and the rows its N, so
    that it runs wgmma, which gives a row the bits of a 64-row tile (16 rows against 64, bf16 and fp16: every
    element equal over 20 random draws of K = 7,168, H100, 2026-12-06, research/swap_bits.py). wgmma's M is at
    least 64, so the tile takes at least 64 columns (narrower, Triton runs the product on mma.sync), and as many
    pipeline stages as then fit."""
    if block_m >= WGMMA_MIN_ROWS or element_size == 4:
        return None
    tiles = replace(tiles, block_n=max(tiles.block_n, WGMMA_MIN_ROWS))
    while tiles.num_stages > 2 and smem_bytes(block_m, tiles, operands, element_size) > SMEM_BUDGET:
        tiles = replace(tiles, num_stages=tiles.num_stages - 1)
    return tiles


def gate_up_descriptor(gate_up_proj: torch.Tensor, block_n: int, block_k: int) -> Optional[TensorDescriptor]:
    """A TMA descriptor of ``gate_up_proj`` [E, 2I, H] seen as [E·2, I, H] with [2, block_n, block_k] boxes (a
    gate tile and the up tile of the same columns in one copy; zeros past I and H), or None where
    :func:`weight_descriptor` would give none."""
    if not _tma_readable(gate_up_proj, block_k) or gate_up_proj.shape[1] % 2:
        return None
    E, R, C = gate_up_proj.shape
    halves = gate_up_proj.as_strided((E * 2, R // 2, C), (R // 2 * gate_up_proj.stride(1), gate_up_proj.stride(1), 1))
    return TensorDescriptor.from_tensor(halves, [2, block_n, block_k])


def gemm1_swiglu(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    plan: DispatchPlan,
    intermediate: torch.Tensor,
    tiles: GemmTiles,
    swiglu_limit: Optional[float] = None,
    *,
    use_pdl: bool = False,
    wgmma: bool = False,
) -> None:
    """Launch GEMM1 + SwiGLU into ``intermediate`` [M·K, I] with the plan's BLOCK_M and these tiles; ``wgmma``
    (the batch-invariant order): tiles under 64 rows swapped (:func:`swapped`)."""
    num_tiles = plan.tile_expert.numel()
    n, k = intermediate.shape[1], hidden.shape[1]
    if num_tiles == 0 or n == 0:
        return
    swap = swapped(plan.block_m, tiles, 2, hidden.element_size()) if wgmma else None
    tiles = swap or tiles
    grid = (num_tiles * triton.cdiv(n, tiles.block_n),)
    desc = None
    if joint_operand(plan.block_m, tiles.block_n):
        desc = gate_up_descriptor(gate_up_proj, tiles.block_n, tiles.block_k)
    joint = desc is not None
    if not joint:
        desc = weight_descriptor(gate_up_proj, tiles.block_n, tiles.block_k)
    _gemm1_swiglu_kernel[grid](
        hidden, gate_up_proj, gate_up_proj if desc is None else desc, intermediate,
        plan.tile_expert, plan.tile_row_start, plan.expert_offsets, plan.permuted_to_expanded,
        num_tiles, n, k, plan.top_k, 0.0 if swiglu_limit is None else float(swiglu_limit),
        hidden.stride(0), hidden.stride(1), *gate_up_proj.stride(), *intermediate.stride(),
        HAS_LIMIT=swiglu_limit is not None, EVEN_K=k % tiles.block_k == 0, **_dtype_flags(hidden.dtype),
        BLOCK_M=plan.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        W_TMA=desc is not None, W_JOINT=joint, HALF_TILES=plan.block_m >= HALF_TILES_MIN_BLOCK_M, USE_PDL=use_pdl,
        SWAP=swap is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **({"launch_pdl": True} if use_pdl else {}),
    )


def gemm2(
    intermediate: torch.Tensor,
    down_proj: torch.Tensor,
    plan: DispatchPlan,
    out: torch.Tensor,
    tiles: GemmTiles,
    *,
    use_pdl: bool = False,
    wgmma: bool = False,
) -> None:
    """Launch GEMM2 into ``out`` [M·K, H] with the plan's BLOCK_M and these tiles; ``wgmma`` as GEMM1 takes it."""
    num_tiles = plan.tile_expert.numel()
    n, k = out.shape[1], intermediate.shape[1]
    if num_tiles == 0 or n == 0:
        return
    swap = swapped(plan.block_m, tiles, 1, intermediate.element_size()) if wgmma else None
    tiles = swap or tiles
    grid = (num_tiles * triton.cdiv(n, tiles.block_n),)
    desc = weight_descriptor(down_proj, tiles.block_n, tiles.block_k)
    _gemm2_kernel[grid](
        intermediate, down_proj, down_proj if desc is None else desc, out,
        plan.tile_expert, plan.tile_row_start, plan.expert_offsets,
        num_tiles, n, k,
        *intermediate.stride(), *down_proj.stride(), *out.stride(),
        EVEN_K=k % tiles.block_k == 0, **_dtype_flags(intermediate.dtype),
        BLOCK_M=plan.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        W_TMA=desc is not None, HALF_TILES=plan.block_m >= HALF_TILES_MIN_BLOCK_M, USE_PDL=use_pdl,
        SWAP=swap is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **({"launch_pdl": True} if use_pdl else {}),
    )
