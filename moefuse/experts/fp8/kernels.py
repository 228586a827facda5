"""Triton grouped GEMMs of the routed experts on fp8 block-scale weights (W8A8, SPEC §5).

Contract (inputs validated by :func:`moefuse.experts.moe_experts`):

- ``hidden`` [M, H] bf16 or fp16, any strides; ``gate_up`` and ``down``: :class:`moefuse.formats.BlockFP8`
  ([E, 2I, H] and [E, H, I] e4m3 values, fp32 scales per 128 x 128 block); ``plan`` as for the bf16 kernels.
- GEMM1 writes the intermediate in e4m3, [M·K, I], with its fp32 scales [M·K, ceil(I/128)]; GEMM2 writes ``out``
  [M·K, H] in hidden's dtype. Rows of no token are not written.

How:

- **The activations are quantized once, before GEMM1**, by ``quantize.quantize_rows_into`` (a kernel of its
  own, the *quantization pass*): per token row and 128 columns, gathered into the plan's row order, e4m3 values
  and one fp32 scale a group, which GEMM1 reads through TMA. Quantizing in GEMM1's loop instead would save the
  pass's launch but quantize each row once per column block (406 instructions a step per warp against 249); the
  pass is as fast or faster on every preset, e.g. DeepSeek-V3 at two tokens 258.2 against 266.1 µs (H100,
  2026-12-05; docs/CHOICES.md). Same bits either way (one ``_quantize``).
- **Both GEMMs promote per block.** Each 128-deep step is one fp8 ``tl.dot`` into a fresh fp32 tile, scaled by
  the rows' activation scales and the tile's weight-block scale (one scalar per step: a tile's columns lie in one
  block) and added to the fp32 accumulator: DeepSeek-V3's recipe (promotion every 128 products). Within a step,
  Hopper's fp8 wgmma (GEMM1's tiles of 64 rows or more, all of GEMM2's: ``_add_scaled``) sums with fewer bits than
  fp32; GEMM1's 16-row tiles run on mma.sync, which sums in fp32 (on wgmma too in the batch-invariant order).
  Promoting more often (Triton's ``max_num_imprecise_acc``) buys little accuracy for much time: every 32 products
  against every 128, 5.4e-3 against 7.8e-3 max and 2.5e-3 against 3.6e-3 RMS from float64, and 7,796 against
  5,931 µs at 4096 tokens (DeepSeek-V3 widths, H200, 2026-12-01). The largest errors (3e-2 max on narrow test
  shapes, the same at 32, 64 and 128) come from e4m3 roundings of the intermediate that any non-fp32 sum flips.
- **GEMM1's epilogue quantizes the intermediate**: SwiGLU (and the clamp) in fp32, then per row of the 128-column
  tile the same quantization, written as e4m3 plus one scale per row.

Grid and tile order are the bf16 kernels' (``common._program_tile``); at a token or two GEMM1 also splits along K
(``configs.fp8_split_k``: its grid would leave SMs idle or a short second wave). BLOCK_K is 128 (one scale step;
the tile of one operand for one such step is a *box*, the block one TMA load copies); short tiles' pipelined steps
load two K-adjacent boxes (``BOXES``), which the DRAM serves like one box of 256-byte rows, and promote each box on
its own, so the sums are those of one-box steps. GEMM1's BLOCK_N is 128 (one intermediate scale group per tile
row); GEMM2's BLOCK_N is at most 128, so a tile's columns lie in one weight block. Weights go through TMA on sm90+
where their layout allows, as in ``bf16.py``. The quantization itself, and its rounding under the interpreter, are
in ``quantize.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ... import _runtime
from ...dispatch import DispatchPlan
from ...formats import BLOCK, BlockFP8
from ..common import _program_start, _round, _swiglu, _tile_span, rows_descriptor, weight_descriptor
from ..configs import (
    FP8_HALVES_STAGES,
    FP8_HALVES_WARPS,
    FP8_NARROW_HALVES_STAGES,
    FP8_SPLIT_PAIR_STAGES,
    FP8_SPLIT_STAGES,
    SMEM_BUDGET,
    SMEM_SLACK,
    WGMMA_MIN_ROWS,
    GemmTiles,
    fp8_half_columns,
    fp8_halves,
    fp8_split_k,
)
from .quantize import _quantize, quantize_rows_into, quantized_rows


@triton.jit
def _add_scaled(acc, a, w, a_scale, w_scale, ONE_BLOCK: tl.constexpr, SWAP: tl.constexpr):
    """``acc + (a @ w) · a_scale[row] · w_scale``: one step's fp32 product of the activation tile ``a`` [BLOCK_M,
    BLOCK_K] and the weight tile ``w`` [BLOCK_K, BLOCK_N], scaled by its rows' activation scales and its weight-block
    scale (``ONE_BLOCK``: a scalar; else [BLOCK_N], for a tile that straddles two blocks).

    ``SWAP``: ``acc`` is transposed, [BLOCK_N, BLOCK_M], and the product is ``w^T @ a^T``, so that a decode tile's few
    rows are the MMA's N and the weights its M: wgmma (64 rows or more) reads the fp8 weights from shared memory
    as they are, where a 16-row tile runs on mma.sync, which on sm_90 takes fp8 only after a conversion to fp16 in
    registers (GEMM2's loop: 169 instructions a step against 298). A row's sums have the same bits swapped as in a
    64-row wgmma tile (16 rows against 64, 60 random draws of K = 7,168, every element equal: H100, 2026-12-06,
    research/swap_bits.py). GEMM2 swaps by default; GEMM1 only where the sums must be a 64-row tile's
    (``experts_fp8(wgmma=True)``, the batch-invariant order). wgmma sums fp8 products with fewer bits than fp32,
    which in GEMM1 flips e4m3 roundings of the intermediate (SPEC §5): swapped, GEMM1 would take DeepSeek-V3's
    experts at one token from 108.7 to 100.1 µs but their error from 2.8e-3 to 7.0e-3 (1.2e-2 at 128 tokens): too
    much error for the default's time. GEMM2's sums only meet the bf16 output rounding: 2.8e-3 either way, 108.6 ->
    106.9 µs at one token (H200, 2026-12-01)."""
    if SWAP:
        if ONE_BLOCK:
            acc += tl.dot(w.T, a.T) * (a_scale * w_scale)[None, :]
        else:
            acc += tl.dot(w.T, a.T) * a_scale[None, :] * w_scale[:, None]
    elif ONE_BLOCK:
        acc += tl.dot(a, w) * (a_scale * w_scale)[:, None]  # one multiply per row, one FMA per element
    else:
        acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
    return acc


@triton.jit
def _load_box(a_ptr, a_desc, as_ptr, a_rows, row_start, k0, K, ks, stride_am, stride_ak, stride_asm, stride_asg,
              A_TMA: tl.constexpr, BLOCK_K: tl.constexpr, BOXES: tl.constexpr):
    """The box at K offset ``k0``: its 128-column scale group, the mask ``k_ok`` of its columns before K, the e4m3
    activation tile of contiguous rows ``a_rows`` (from ``row_start``) and each row's scale of that group.
    Through TMA, rows past the tensor and columns past K read zeros. With two boxes a step, the last step's second
    box may start past K: its loads read zeros, and its group is clamped to the last so that its scale loads stay in
    range (a finite scale times a zero product adds nothing)."""
    k_ok = ks < K - k0
    if BOXES == 1:
        group = k0 // BLOCK_K
    else:
        group = tl.minimum(k0, K - 1) // BLOCK_K
    if A_TMA:
        a = a_desc.load([row_start, k0])
    else:  # addresses formed per step: a [BLOCK_M, BLOCK_K] pointer tile kept across steps would hold 2 registers each
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + ks)[None, :] * stride_ak, mask=k_ok[None, :], other=0.0)
    return group, k_ok, a, tl.load(as_ptr + a_rows * stride_asm + group * stride_asg)


@triton.jit
def _split_range(K, run, STEP: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K range of run ``run`` of ``STEP``-deep steps: all of K, or the ``run``-th of SPLIT_K runs of whole steps
    (the last may be shorter or empty)."""
    if SPLIT_K == 1:
        return 0, K
    per = tl.cdiv(tl.cdiv(K, STEP), SPLIT_K) * STEP
    k_begin = run * per
    return k_begin, tl.minimum(k_begin + per, K)


@triton.jit(do_not_specialize=["num_tiles", "num_rows"])  # they vary with the token count: one variant for all
def _gemm1_fp8_kernel(
    a_ptr, a_desc, as_ptr, w_ptr, w_desc, ws_ptr, inter_ptr, is_ptr,
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, part_ptr, arrivals_ptr,
    num_tiles, N, K, limit, num_rows,
    stride_am, stride_ak, stride_asm, stride_asg,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_im, stride_in, stride_ism, stride_isg,
    HAS_LIMIT: tl.constexpr, EMULATE_RTNE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, W_TMA: tl.constexpr, A_TMA: tl.constexpr, USE_PDL: tl.constexpr,
    UP_ALIGNED: tl.constexpr, SPLIT_K: tl.constexpr, BOXES: tl.constexpr, HALF_N: tl.constexpr = 0,
    SWAP: tl.constexpr = False,
):
    """intermediate[rows, n] = quant(SwiGLU(deq(a) @ deq(W)[e, n]^T, ... [e, N + n]^T)). N = I, K = H; ``a``: the
    activations quantized in the plan's row order (``a_ptr``/``a_desc``, scales ``as_ptr``, from
    ``_quantize_rows_kernel``).

    ``SPLIT_K`` > 1 (decode, where a program a tile and column block leaves SMs idle): program (p, s) of the 2-D grid
    sums the s-th of SPLIT_K runs of steps into ``part_ptr`` [SPLIT_K, num_rows, 2N] (fp32), and the last of
    a tile's programs to arrive (``arrivals_ptr``, zero at the launch) adds the runs in split order and runs the
    epilogue: the same bits whichever program arrives last. It sets its counter back to zero, so that a workspace
    given to ``experts_fp8`` needs no zeroing before the next launch.

    ``HALF_N`` > 0, the halves (with SPLIT_K 1 and UP_ALIGNED; decode, where the unsplit grid leaves SMs idle but K
    must not be split, as in a batch-invariant layer): program (p, 2c) sums the c-th ``HALF_N`` columns of the gate
    tile and (p, 2c + 1) those of the up tile over all of K, each into ``part_ptr`` [num_rows, 2N] (fp32), and the
    last to arrive runs the epilogue on the whole tile: 2 · BLOCK_N / HALF_N programs, each reading its share of the
    weights, and a row's sums and their order unchanged, so the same bits.

    ``UP_ALIGNED``: N is a multiple of 128, so the up tile's rows N + cols start a weight block as the gate tile's do.
    ``BOXES``: K-adjacent 128-deep boxes a pipelined step (1 or 2; ``fp8_tiles``), each promoted on its own in K
    order, so the sums are the same whatever the count; a split's runs hold whole steps.

    ``SWAP`` (tiles under 64 rows): the sums on swapped wgmma, the weights as M (``_add_scaled``), which gives a row
    the bits of a 64-row wgmma tile (the batch-invariant order); unswapped, such a tile runs on mma.sync.
    """
    tile, col_block, expert = _program_start(num_tiles, N, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                                             BLOCK_M, BLOCK_N, GROUP_M, USE_PDL)
    if expert < 0:
        return
    row_start, rows, row_ok, a_rows, cols, col_ok, wrapped = _tile_span(
        tile, col_block, expert, N, tile_row_start_ptr, expert_offsets_ptr, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k_begin, k_end = _split_range(K, tl.program_id(1), BOXES * BLOCK_K, SPLIT_K)
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    gate_ptrs = (w_expert + wrapped[None, :].to(tl.int64) * stride_wn
                 + (k_begin + ks)[:, None] * stride_wk)  # [BLOCK_K, BLOCK_N]
    up_ptrs = gate_ptrs + N * stride_wn
    gate_row = expert * 2 * N + col_block * BLOCK_N  # first weight row of the tile in the [E·2N, K] view
    # The weight-block scale of the tile's columns: one scalar per step for the gate tile (BLOCK_N is one block, and
    # wrapped columns past N are never stored), and for the up tile when its rows N + cols start a block too.
    s_expert = ws_ptr + expert.to(tl.int64) * stride_se
    gate_scale_ptrs = s_expert + col_block * stride_sn
    if UP_ALIGNED:
        up_scale_ptrs = s_expert + (N // 128 + col_block) * stride_sn
    else:  # [BLOCK_N]: the up tile straddles two weight blocks
        up_scale_ptrs = s_expert + ((N + wrapped) // 128) * stride_sn
    HALVES: tl.constexpr = HALF_N > 0
    TILE_N: tl.constexpr = HALF_N if HALVES else BLOCK_N  # the columns this program sums
    if HALVES:  # its columns of the gate tile (half 0) or the up one (1), through the gate's pointers (UP_ALIGNED)
        half = tl.program_id(1) % 2
        first_col = (tl.program_id(1) // 2) * TILE_N  # within the tile: inside its weight block
        tile_cols = col_block * BLOCK_N + first_col + tl.arange(0, TILE_N)  # < N: N is a multiple of BLOCK_N
        gate_row += half * N + first_col
        gate_ptrs = (w_expert + (half * N + tile_cols)[None, :].to(tl.int64) * stride_wn
                     + (k_begin + ks)[:, None] * stride_wk)
        gate_scale_ptrs += half * (N // 128) * stride_sn
    if SWAP:
        acc_gate = tl.zeros([TILE_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([TILE_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_gate = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
    for k_step in range(k_begin, k_end, BOXES * BLOCK_K):
        for box in tl.static_range(BOXES):
            k0 = k_step + box * BLOCK_K
            group, k_ok, a, a_scale = _load_box(a_ptr, a_desc, as_ptr, a_rows, row_start, k0, K, ks, stride_am,
                                                stride_ak, stride_asm, stride_asg, A_TMA, BLOCK_K, BOXES)
            if W_TMA:  # zero-filled past K
                gate_w = w_desc.load([gate_row, k0]).T
                if not HALVES:
                    up_w = w_desc.load([gate_row + N, k0]).T
            else:
                gate_w = tl.load(gate_ptrs, mask=k_ok[:, None], other=0.0)
                if not HALVES:
                    up_w = tl.load(up_ptrs, mask=k_ok[:, None], other=0.0)
            step = group * stride_sk
            acc_gate = _add_scaled(acc_gate, a, gate_w, a_scale, tl.load(gate_scale_ptrs + step), True, SWAP)
            if not HALVES:
                acc_up = _add_scaled(acc_up, a, up_w, a_scale, tl.load(up_scale_ptrs + step), UP_ALIGNED, SWAP)
            gate_ptrs += BLOCK_K * stride_wk
            up_ptrs += BLOCK_K * stride_wk
    if SWAP:
        acc_gate = acc_gate.T
        acc_up = acc_up.T

    if SPLIT_K > 1 or HALVES:
        done = row_ok[:, None] & col_ok[None, :]
        part = part_ptr + rows.to(tl.int64)[:, None] * (2 * N) + cols[None, :]
        split_stride = num_rows.to(tl.int64) * (2 * N)
        if HALVES:
            tile_part = part_ptr + rows.to(tl.int64)[:, None] * (2 * N) + tile_cols[None, :]
            tl.store(tile_part + half * N, acc_gate, mask=row_ok[:, None])
        else:
            tl.store(part + tl.program_id(1) * split_stride, acc_gate, mask=done)
            tl.store(part + tl.program_id(1) * split_stride + N, acc_up, mask=done)
        # acq_rel: this program's partial sums are visible to the last arriver, and the last sees every one
        arrivals: tl.constexpr = 2 * (BLOCK_N // TILE_N) if HALVES else SPLIT_K
        if tl.atomic_add(arrivals_ptr + tl.program_id(0), 1, sem="acq_rel") < arrivals - 1:
            return
        tl.store(arrivals_ptr + tl.program_id(0), 0)  # every run has arrived: a caller's workspace stays zeroed
        if HALVES:  # loaded as stored: the bits of the unsplit sums
            acc_gate = tl.load(part, mask=done, other=0.0, cache_modifier=".cg")
            acc_up = tl.load(part + N, mask=done, other=0.0, cache_modifier=".cg")
        else:
            acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):  # in split order, not arrival order
                acc_gate += tl.load(part + split * split_stride, mask=done, other=0.0, cache_modifier=".cg")
                acc_up += tl.load(part + split * split_stride + N, mask=done, other=0.0, cache_modifier=".cg")

    act = _swiglu(acc_gate, acc_up, limit, HAS_LIMIT)
    act = tl.where(col_ok[None, :], act, 0.0)  # a partial last group: its missing columns must not set the amax
    q, scale = _quantize(act, EMULATE_RTNE)
    out_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_im + cols[None, :] * stride_in
    tl.store(out_ptrs, q, mask=row_ok[:, None] & col_ok[None, :])
    tl.store(is_ptr + rows.to(tl.int64) * stride_ism + col_block * stride_isg, scale, mask=row_ok)


@triton.jit(do_not_specialize=["num_tiles"])
def _gemm2_fp8_kernel(
    inter_ptr, inter_desc, is_ptr, w_ptr, w_desc, ws_ptr, out_ptr,
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
    num_tiles, N, K,
    stride_im, stride_ik, stride_ism, stride_isg, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    stride_om, stride_on,
    EMULATE_RTNE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, W_TMA: tl.constexpr, A_TMA: tl.constexpr, USE_PDL: tl.constexpr, SWAP: tl.constexpr,
    BOXES: tl.constexpr,
):
    """out[rows, n] = deq(intermediate[rows]) @ deq(down)[e, n]^T.  N = H, K = I; ``BOXES`` as in GEMM1."""
    tile, col_block, expert = _program_start(num_tiles, N, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                                             BLOCK_M, BLOCK_N, GROUP_M, USE_PDL)
    if expert < 0:
        return
    row_start, rows, row_ok, a_rows, cols, col_ok, wrapped = _tile_span(
        tile, col_block, expert, N, tile_row_start_ptr, expert_offsets_ptr, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + wrapped[None, :].to(tl.int64) * stride_wn
              + ks[:, None] * stride_wk)
    w_row = expert * N + col_block * BLOCK_N
    # BLOCK_N <= 128: the tile's columns lie in one weight block (wrapped ones past N are never stored).
    w_scale_ptrs = ws_ptr + expert.to(tl.int64) * stride_se + (col_block * BLOCK_N // 128) * stride_sn
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_step in range(0, K, BOXES * BLOCK_K):
        for box in tl.static_range(BOXES):
            k0 = k_step + box * BLOCK_K
            group, k_ok, a, a_scale = _load_box(inter_ptr, inter_desc, is_ptr, a_rows, row_start, k0, K, ks, stride_im,
                                                stride_ik, stride_ism, stride_isg, A_TMA, BLOCK_K, BOXES)
            if W_TMA:
                w = w_desc.load([w_row, k0]).T
            else:
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            # This weight-block scale's load goes out after the step's TMA wait: issued before it, or a step ahead, it
            # is no faster at one token (H100, 2026-12-05).
            acc = _add_scaled(acc, a, w, a_scale, tl.load(w_scale_ptrs + group * stride_sk), True, SWAP)
            w_ptrs += BLOCK_K * stride_wk
    if SWAP:
        acc = acc.T
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, _round(acc, out_ptr.dtype.element_ty, EMULATE_RTNE), mask=row_ok[:, None] & col_ok[None, :])


def fp8_tiles(tiles: GemmTiles, block_m: int, gemm1: bool, a_bytes: int, split_k: int = 1,
              budget: int = SMEM_BUDGET, *, half_columns: int = 0, wgmma: bool = False) -> GemmTiles:
    """The tile choice adapted to the format: steps of one 128-deep box (one scale step), or of two K-adjacent boxes
    where the choice asks for steps of 256 or more (``configs.heuristic``, item 6: short tiles); GEMM1's BLOCK_N 128
    (one intermediate scale group per tile row), GEMM2's BLOCK_N at most 128; pipeline stages cut until the operand
    buffers fit in shared memory, and for a GEMM1 split along K (``split_k`` > 1) to at most
    ``FP8_SPLIT_STAGES`` (``FP8_SPLIT_PAIR_STAGES`` of two-box steps), so that two programs share an SM. The model
    counts the activation tile at ``a_bytes`` an element for one-box steps, the stage counts every such launch was
    timed with (GEMM1 passes hidden's width), and at its e4m3 byte for two-box steps (counted at 2 bytes, GEMM1's 3
    stages on 16 rows would be cut to 2). GEMM1 in gate and up halves (``half_columns`` not 0: the columns of a tile
    each program sums) takes a launch of its own: one-box steps on ``FP8_HALVES_WARPS`` warps and
    ``FP8_HALVES_STAGES`` stages, whatever the choice asked for, or where its programs sum 64 columns (each an SM of
    its own) on ``FP8_NARROW_HALVES_STAGES``, as many as fit ``budget``. ``wgmma`` (the batch-invariant order): a
    swapped tile (under ``WGMMA_MIN_ROWS`` rows) takes at least that many columns, its MMA's M, below which Triton
    runs the swapped product on mma.sync (sm_90 SASS of GEMM2 on 16 and 32 rows: HMMA at 32 columns, HGMMA at 64
    and 128)."""
    if half_columns:
        stages = FP8_HALVES_STAGES
        if half_columns < BLOCK:
            stages = FP8_NARROW_HALVES_STAGES
            while stages > FP8_HALVES_STAGES and stages * BLOCK * (block_m * a_bytes + half_columns) > budget:
                stages -= 1
        return GemmTiles(BLOCK, BLOCK, tiles.group_m, FP8_HALVES_WARPS, stages)
    block_n = 128 if gemm1 else min(tiles.block_n, 128)
    if wgmma and block_m < WGMMA_MIN_ROWS:
        block_n = max(block_n, WGMMA_MIN_ROWS)
    operands = 2 if gemm1 else 1
    paired = tiles.block_k >= 2 * BLOCK
    depth, cap = (2 * BLOCK, FP8_SPLIT_PAIR_STAGES) if paired else (BLOCK, FP8_SPLIT_STAGES)
    a_bytes = 1 if paired else a_bytes
    stages = min(tiles.num_stages, cap) if split_k > 1 else tiles.num_stages
    while stages > 2 and stages * depth * (block_m * a_bytes + operands * block_n) > budget:
        stages -= 1
    return GemmTiles(block_n, depth, tiles.group_m, tiles.num_warps, stages)


def default_split_k(num_rows: int, width: int, device: torch.device) -> int:
    """GEMM1's split along K for a plan of ``num_rows`` rows (M·K) and intermediate width ``width`` on ``device``:
    ``configs.fp8_split_k`` on a GPU; 1 under the interpreter (its programs run one after another) and off CUDA."""
    if device.type != "cuda" or _runtime.interpreting():
        return 1
    return fp8_split_k(num_rows, width, _runtime.sm_count(device))


def default_halves(num_rows: int, width: int, split_k: Optional[int], device: torch.device) -> bool:
    """Whether GEMM1 runs its gate and up tiles as programs of their own (``HALF_N``) where the caller asked for no
    split along K (``split_k`` 1: a batch-invariant layer; None, the default, splits K instead where it helps): on a
    grid that fills at most two programs an SM (``configs.fp8_halves``), with I a multiple of 128 (each tile's block
    scale one scalar a step); never under the interpreter and off CUDA, as :func:`default_split_k`."""
    if split_k != 1 or width % BLOCK or device.type != "cuda" or _runtime.interpreting():
        return False
    return fp8_halves(num_rows, width, _runtime.sm_count(device))


def default_half_columns(num_rows: int, width: int, device: torch.device) -> int:
    """The columns a program of GEMM1's ``halves`` sums (``configs.fp8_half_columns``; 128 off CUDA)."""
    if device.type != "cuda":
        return BLOCK
    return fp8_half_columns(num_rows, width, _runtime.sm_count(device))


def experts_fp8(
    hidden: torch.Tensor,
    gate_up: BlockFP8,
    down: BlockFP8,
    plan: DispatchPlan,
    out: torch.Tensor,
    gemm1_tiles: GemmTiles,
    gemm2_tiles: GemmTiles,
    swiglu_limit: Optional[float] = None,
    *,
    use_pdl: bool = False,
    split_k: Optional[int] = None,
    workspace: Optional[torch.Tensor] = None,
    halves: Optional[bool] = None,
    half_columns: Optional[int] = None,
    wgmma: bool = False,
) -> None:
    """Quantize the activations in the plan's row order, then launch GEMM1 (+ SwiGLU, intermediate quantization)
    and GEMM2, into ``out``.
    ``split_k``: GEMM1's K in that many runs of steps, each its own program (``_gemm1_fp8_kernel``; stages as
    ``fp8_tiles`` cuts them); None: :func:`default_split_k`. ``halves``: GEMM1's gate and up tiles as programs of
    their own (``HALF_N``: the same bits, on a launch of their own, ``fp8_tiles``; needs ``split_k`` 1 or None and I
    a multiple of 128); None: :func:`default_halves`. ``half_columns``: the columns of a tile each of the halves'
    programs sums, 128 (the whole tile) or 64 (two programs a half); None: :func:`default_half_columns`.
    ``wgmma``: both GEMMs sum on wgmma at every tile height (tiles under 64 rows swapped: ``_add_scaled``; GEMM2's
    at least 64 columns wide, ``fp8_tiles``), so that a row's bits do not depend on the plan's ``block_m`` (the
    batch-invariant order); else GEMM1's short tiles run mma.sync, whose fp32 sums of exact products are more
    accurate, and GEMM2's narrower than 64 columns too. ``workspace``: int32 zeros (``moe_experts``'s)
    that a split GEMM1 counts its runs' (or halves') arrivals in and leaves zeroed, where it holds a counter per
    program of the unsplit grid; else the counters are zeroed here, one more kernel before GEMM1 (which also keeps
    GEMM1 from starting under the previous kernel's tail with PDL).
    """
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be a positive int or None, got {split_k!r}")
    if halves is not None and not isinstance(halves, bool):
        raise TypeError(f"halves must be a bool or None, got {type(halves).__name__}")
    if halves and (split_k not in (None, 1) or down.shape[2] % BLOCK):
        raise ValueError(f"halves=True needs split_k 1 and an intermediate width multiple of {BLOCK}, got split_k="
                         f"{split_k!r} and {down.shape[2]}")
    if half_columns is not None and (not isinstance(half_columns, int) or isinstance(half_columns, bool)):
        raise TypeError(f"half_columns must be an int or None, got {type(half_columns).__name__}")
    if half_columns not in (None, BLOCK, BLOCK // 2):
        raise ValueError(f"half_columns must be None, {BLOCK} or {BLOCK // 2}, got {half_columns!r}")
    if not isinstance(wgmma, bool):
        raise TypeError(f"wgmma must be a bool, got {type(wgmma).__name__}")
    num_tiles = plan.tile_expert.numel()
    width, hidden_size = down.shape[2], hidden.shape[1]
    if num_tiles == 0 or width == 0:
        return
    device = hidden.device
    inter, inter_scales = quantized_rows(plan, width, device)
    emulate = _runtime.interpreting()
    launch = {"launch_pdl": True} if use_pdl else {}
    if halves is None:
        halves = default_halves(plan.expanded_to_permuted.numel(), width, split_k, device)
    half_n = 0  # the columns a program of GEMM1's halves sums; 0: whole tiles
    if halves:
        split_k = 1
        half_n = half_columns or default_half_columns(plan.expanded_to_permuted.numel(), width, device)
    if split_k is None:
        split_k = default_split_k(plan.expanded_to_permuted.numel(), width, device)
    # The stage model counts GEMM1's e4m3 activation tiles at hidden's width, the stage counts the fp8 tiles were
    # timed with: at 1 byte, 128-row tiles would take a fourth stage, which no timing backs.
    budget = SMEM_BUDGET if emulate else _runtime.gpu(device).smem - SMEM_SLACK  # the GPU's own shared memory
    t1 = fp8_tiles(gemm1_tiles, plan.block_m, True, hidden.element_size(), split_k, budget, half_columns=half_n)
    t2 = fp8_tiles(gemm2_tiles, plan.block_m, False, 1, budget=budget, wgmma=wgmma)
    a, a_scales = quantized_rows(plan, hidden_size, device)
    quantize_rows_into(hidden, a, a_scales, plan, gather=True, use_pdl=use_pdl)
    a_desc = rows_descriptor(a, plan.block_m, BLOCK)  # boxes of one scale group; a step loads t1.block_k // BLOCK
    columns = half_n or t1.block_n  # the columns a GEMM1 program sums
    desc1 = weight_descriptor(gate_up.values, columns, BLOCK)
    programs = num_tiles * triton.cdiv(width, t1.block_n)
    if split_k > 1 or half_n:  # each run's (or half's) fp32 sums, and each tile's count of them done
        part = torch.empty(split_k, plan.num_rows, 2 * width, dtype=torch.float32, device=device)
        if workspace is not None and workspace.numel() >= programs:
            arrivals = workspace
        else:
            arrivals = torch.zeros(programs, dtype=torch.int32, device=device)
    else:  # not read
        part, arrivals = inter_scales, plan.tile_expert
    _gemm1_fp8_kernel[(programs, 2 * t1.block_n // columns if half_n else split_k)](
        a, a if a_desc is None else a_desc, a_scales,
        gate_up.values, gate_up.values if desc1 is None else desc1, gate_up.scales, inter, inter_scales,
        plan.tile_expert, plan.tile_row_start, plan.expert_offsets, part, arrivals,
        num_tiles, width, hidden_size, 0.0 if swiglu_limit is None else float(swiglu_limit), plan.num_rows,
        *a.stride(), *a_scales.stride(),
        *gate_up.values.stride(), *gate_up.scales.stride(), *inter.stride(), *inter_scales.stride(),
        HAS_LIMIT=swiglu_limit is not None, EMULATE_RTNE=emulate, BLOCK_M=plan.block_m, BLOCK_N=t1.block_n,
        BLOCK_K=BLOCK, GROUP_M=t1.group_m, W_TMA=desc1 is not None, A_TMA=a_desc is not None, USE_PDL=use_pdl,
        UP_ALIGNED=width % BLOCK == 0, SPLIT_K=split_k, BOXES=t1.block_k // BLOCK,
        HALF_N=half_n, SWAP=wgmma and plan.block_m < WGMMA_MIN_ROWS, num_warps=t1.num_warps,
        num_stages=t1.num_stages, **launch,
    )
    desc2 = weight_descriptor(down.values, t2.block_n, BLOCK)
    inter_desc = rows_descriptor(inter, plan.block_m, BLOCK)
    _gemm2_fp8_kernel[(num_tiles * triton.cdiv(hidden_size, t2.block_n),)](
        inter, inter if inter_desc is None else inter_desc, inter_scales,
        down.values, down.values if desc2 is None else desc2, down.scales, out,
        plan.tile_expert, plan.tile_row_start, plan.expert_offsets,
        num_tiles, hidden_size, width,
        *inter.stride(), *inter_scales.stride(), *down.values.stride(), *down.scales.stride(), *out.stride(),
        EMULATE_RTNE=emulate and out.dtype == torch.bfloat16, BLOCK_M=plan.block_m, BLOCK_N=t2.block_n,
        BLOCK_K=BLOCK, GROUP_M=t2.group_m, W_TMA=desc2 is not None, A_TMA=inter_desc is not None,
        USE_PDL=use_pdl, SWAP=plan.block_m < WGMMA_MIN_ROWS, BOXES=t2.block_k // BLOCK, num_warps=t2.num_warps,
        num_stages=t2.num_stages, **launch,
    )
