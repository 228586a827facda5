"""What the experts' Triton kernels share, whatever the weight format: program order, tile span, rounding,
SwiGLU, TMA descriptors.

- ``_program_start`` / ``_program_tile``: the grouped GEMMs' grid, one program per (tile, column block),
  ``T_max * cdiv(N, BLOCK_N)`` programs in groups of GROUP_M tiles (``bf16.py`` describes the order); the bf16,
  fp8 and MXFP4 ``tl`` kernels all start with it.
- ``_tile_span``: a program's rows and columns as the fp8 and MXFP4 kernels use them.
- ``_round`` (fp32 to the output dtype, to nearest even also under the interpreter) and ``_swiglu`` (SiLU(gate) * up
  after DeepSeek-V4's clamp): the epilogues of the ``tl`` kernels and of the fp8 shared expert's SwiGLU kernel
  (``gluon_common.swiglu`` computes the same for the Gluon kernels).
- ``weight_descriptor`` / ``rows_descriptor``: TMA descriptors of stacked expert weights and of a tile's contiguous
  rows, or None where TMA cannot read them (``_tma_readable``). A TMA load copies one *box* of the tensor (a block
  of rows and columns) into shared memory.
- ``gather_rows``: the plan's rows of ``hidden`` in plan order, for the Gluon kernels (TMA reads contiguous rows).

A piece one format alone uses stays in that format's file; what the Gluon kernels share is in ``gluon_common.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import _runtime
from ..dispatch import DispatchPlan


@triton.jit
def _program_tile(num_tiles, num_col_blocks, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                  BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """Map this program to (tile, column block), the tile index fastest within a group of tiles.

    GROUP_M > 0: groups of GROUP_M consecutive tiles. GROUP_M == 0: one group per expert (its tiles are
    consecutive): programs ``[first·C, (first + size)·C)`` of C column blocks belong to the expert whose tiles
    are ``first .. first + size - 1``, so ``pid // C`` is one of them, and it tells the expert, its first tile
    and its tile count. Unused tiles come last; their programs map to themselves (and exit).
    """
    pid = tl.program_id(0)
    if GROUP_M == 0:
        probe = pid // num_col_blocks
        expert = tl.load(tile_expert_ptr + probe)
        if expert < 0:
            return probe, 0
        expert_start = tl.load(expert_offsets_ptr + expert)
        first_tile = probe - (tl.load(tile_row_start_ptr + probe) - expert_start) // BLOCK_M
        group_size = tl.cdiv(tl.load(expert_offsets_ptr + expert + 1) - expert_start, BLOCK_M)
        local = pid - first_tile * num_col_blocks
        return first_tile + local % group_size, local // group_size
    per_group = GROUP_M * num_col_blocks
    first_tile = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_tiles - first_tile, GROUP_M)
    tile = first_tile + (pid % per_group) % group_size
    col_block = (pid % per_group) // group_size
    return tile, col_block


@triton.jit
def _program_start(num_tiles, N, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, USE_PDL: tl.constexpr):
    """A grouped GEMM program's (tile, column block, expert); the expert is -1 for an unused tile (the caller returns).

    With PDL it first waits for the kernels it depends on (the plan from dispatch, GEMM1's intermediate for GEMM2)
    and lets the next one start its prologue.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tile, col_block = _program_tile(num_tiles, tl.cdiv(N, BLOCK_N), tile_expert_ptr, tile_row_start_ptr,
                                    expert_offsets_ptr, BLOCK_M, GROUP_M)
    return tile, col_block, tl.load(tile_expert_ptr + tile)


@triton.jit
def _tile_span(tile, col_block, expert, N, tile_row_start_ptr, expert_offsets_ptr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows and columns of a program's tile (its expert is ``expert`` >= 0), as the fp8 and MXFP4 kernels use them.

    Returns ``row_start``; ``rows`` [BLOCK_M] and ``row_ok`` (rows of the expert); ``a_rows`` (int64: rows past the
    expert's end re-read its first one, so loads need no row mask); ``cols`` [BLOCK_N] and ``col_ok`` (< N); and
    ``wrapped`` (columns past N wrapped around to real rows, which the store drops).
    """
    row_start = tl.load(tile_row_start_ptr + tile)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    a_rows = tl.where(row_ok, rows, row_start).to(tl.int64)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    return row_start, rows, row_ok, a_rows, cols, cols < N, cols % N


@triton.jit
def _round(x, dtype: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """Round fp32 ``x`` to ``dtype`` to nearest-even.

    The GPU's cast does that; the interpreter's fp32 -> bf16 cast truncates (up to 2**-7 relative error),
    so there the rounding is done on the bits first and the cast is then exact.
    """
    if EMULATE_RTNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _swiglu(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """``SiLU(gate) * up`` in fp32, after DeepSeek-V4's clamp (gate <= limit, up within [-limit, limit]) where
    ``HAS_LIMIT``. The clamp keeps NaN, as ``torch.clamp`` does (the hardware's min and max would return the limit):
    a token whose hidden state holds a NaN gets NaN rows, never finite ones."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(up, limit, propagate_nan=tl.PropagateNan.ALL)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _rows_swiglu_kernel(gate_ptr, up_ptr, out_ptr, I, limit, stride_gm, stride_um, stride_om,
                        HAS_LIMIT: tl.constexpr, EMULATE_RTNE: tl.constexpr, BLOCK: tl.constexpr):
    """``out[r] = _swiglu(gate[r], up[r])`` rounded once, program (r, c) taking row r's c-th BLOCK columns (unit
    column strides): a row's values the same bits in any batch."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    gate = tl.load(gate_ptr + row * stride_gm + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_um + cols, mask=ok, other=0.0).to(tl.float32)
    act = _swiglu(gate, up, limit, HAS_LIMIT)
    tl.store(out_ptr + row * stride_om + cols, _round(act, out_ptr.dtype.element_ty, EMULATE_RTNE), mask=ok)


def rows_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    """The grouped GEMM1 epilogue's SwiGLU (``_swiglu``, one rounding to gate's dtype) on [M, I] tensors with unit
    column strides, row by row: the batch-invariant shared expert's activation. (PyTorch's CPU kernels give an
    element other bits in a vectorised body than in a scalar tail, so ``swiglu_torch`` would not do.)"""
    M, I = gate.shape
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    if M == 0 or I == 0:
        return out
    block = min(1024, triton.next_power_of_2(max(I, 16)))
    _rows_swiglu_kernel[(M, triton.cdiv(I, block))](
        gate, up, out, I, 0.0 if limit is None else float(limit), gate.stride(0), up.stride(0), out.stride(0),
        HAS_LIMIT=limit is not None, EMULATE_RTNE=_runtime.interpreting() and out.dtype == torch.bfloat16, BLOCK=block,
        num_warps=4,
    )
    return out


def _tma_readable(weight: torch.Tensor, block_k: int) -> bool:
    """Whether TMA can read ``weight`` [E, R, C] as [E·R, C] rows: on a Hopper-class GPU (or the interpreter), the
    rows of all experts stacked with one stride (``stride(0) == R·stride(1)``), the last dim contiguous, the base
    and row stride 16-byte aligned, and a box row of at least 16 bytes."""
    E, R, _ = weight.shape
    size = weight.element_size()
    if not _runtime.interpreting() and (weight.device.type != "cuda" or _runtime.capability(weight.device)[0] < 9):
        return False
    if weight.stride(2) != 1 or (R > 1 and E > 1 and weight.stride(0) != R * weight.stride(1)) or E * R == 0:
        return False
    return not (weight.data_ptr() % 16 or (weight.stride(1) * size) % 16 or block_k * size < 16)


def weight_descriptor(weight: torch.Tensor, block_n: int, block_k: int) -> Optional[TensorDescriptor]:
    """A TMA descriptor of ``weight`` [E, R, C] seen as [E·R, C] with [block_n, block_k] boxes, or None.

    None (pointer loads instead) off Hopper-class GPUs and for layouts TMA cannot read (``_tma_readable``).
    Under the interpreter it is used too, so CPU tests cover it.
    """
    if not _tma_readable(weight, block_k):
        return None
    E, R, C = weight.shape
    rows = weight.as_strided((E * R, C), (weight.stride(1), 1))
    return TensorDescriptor.from_tensor(rows, [block_n, block_k])


def rows_descriptor(rows: torch.Tensor, block_m: int, block_k: int) -> Optional[TensorDescriptor]:
    """A TMA descriptor of a [R, C] tensor of a tile's contiguous rows (plan order) with [block_m, block_k] boxes,
    or None where :func:`weight_descriptor` would give none."""
    return weight_descriptor(rows[None], block_m, block_k)


@triton.jit
def _gather_kernel(hidden_ptr, p2e_ptr, out_ptr, H, top_k, stride_hm, stride_hk, stride_om, PAIRED: tl.constexpr,
                   BLOCK: tl.constexpr):
    """out[r, p] = hidden[token(r), n(p)]: the plan's rows (token = permuted_to_expanded // top_k; zeros for the
    rows past the valid ones, whose entry is -1). n(p) = p, or with ``PAIRED`` column 8t + 4b + j of each group of
    32 at position 8j + 2t + b (the MXFP4 MMA's K order, ``mxfp4.kernels._paired``). One program per row and BLOCK
    columns."""
    row = tl.program_id(0)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = p
    if PAIRED:
        n = (p & ~31) | (((p >> 1) & 3) << 3) | ((p & 1) << 2) | ((p >> 3) & 3)
    expanded = tl.load(p2e_ptr + row)
    token = (tl.maximum(expanded, 0) // top_k).to(tl.int64)
    x = tl.load(hidden_ptr + token * stride_hm + n * stride_hk, mask=p < tl.where(expanded >= 0, H, 0), other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + p, x, mask=p < H)


def gather_rows(hidden: torch.Tensor, plan: DispatchPlan, paired: bool = False) -> torch.Tensor:
    """The plan's rows of ``hidden`` (any strides) in plan order, [plan.num_rows, H], zeros past the valid rows: the
    activations of the Gluon GEMMs, which read contiguous rows through TMA. ``paired``: each group of 32 columns in
    the MXFP4 MMA's K order."""
    rows, width = plan.num_rows, hidden.shape[1]
    out = torch.empty(rows, width, dtype=hidden.dtype, device=hidden.device)
    if rows:
        block = min(1024, triton.next_power_of_2(width))
        _gather_kernel[(rows, triton.cdiv(width, block))](
            hidden, plan.permuted_to_expanded, out, width, plan.top_k, hidden.stride(0), hidden.stride(1),
            out.stride(0), PAIRED=paired, BLOCK=block)
    return out
