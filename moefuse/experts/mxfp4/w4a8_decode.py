"""MXFP4 W4A8 on decode tiles (16 and 32 rows), in Gluon for sm_90: ``ws.py``'s programs with W4A8's numerics.

The 128-row kernels of ``w4a8.py`` convert a program's 128 weight rows once for 128 tokens; at a few rows an
expert they convert a whole weight for a row or two and run 1.8-2.6x W4A16's time (docs/PERF-NOTES.md). Here
W4A16's warp-specialized programs (``ws.py``: a producer warp streaming two 64-row boxes of packed codes and the
tile's activation rows a step, two consumer warp groups with the weights as the swapped MMA's first operand, from
registers) carry W4A8's arithmetic (SPEC §6):

- each consumer converts its codes to e4m3 (``w4a8._e4m3_asm``: a group scaled by 2^(e - base), flushed below
  base - 5) straight into the fp8 wgmma's register operand. A thread loads one packed word of each group of 32
  (codes 8t..8t+7, four contiguous bytes: ``CODE_LAYOUT``), whose two e4m3 registers are its operand registers
  at K positions 4t..4t+3 and 16+4t..16+4t+3; the activations are laid out to match (``fp8.quantize.
  word_position``: column 8t + 4h + j of each group at 4t + 16h + j). Natural order would put a thread's codes in
  two halves of two words: 4.1 instructions a weight in the main loop against 3.0 (sm_90 SASS, ``scripts/sass.py``;
  W4A16's ws kernels take 3.5);
- the tile's activation rows are e4m3, quantized per token and 128 columns (``fp8.quantize``; a permutation within
  32 columns leaves the scales as they are): GEMM1's gathered from ``hidden`` in word order, GEMM2's from the bf16
  intermediate, which GEMM1 stores in word order (a pass of its own, as SPEC §6 defines it);
- each 128-deep step's product is a fresh accumulator, added times the tokens' activation scales of the step, and
  the sum is multiplied by the row's 2^(base - 127) at the end; base = max(the row's largest exponent - 6, 1),
  found by each consumer for its 64 rows before its first step, while the producer's first loads are in flight.
- where W4A16 runs narrow programs (``ws.narrow_grid``: a token of DeepSeek-V4-Flash, 192 wide programs on 132
  SMs), so do these: one consumer a program, GEMM1's 32 gate rows over the 32 up rows of the same columns, GEMM2's
  one 64-row box; each row's sums the same MMAs in the same order.

That is the 128-row kernels' arithmetic element by element in their K order (they take word order too), with the
weights as the MMA's first operand instead of its second: where wgmma gives a row the same sums either way
(``research/swap_bits.py`` found it so for fp8 tiles of 16 rows against 64) a token's output does not depend on
which kernel its batch ran (tested on the GPU: ``tests/test_experts_mxfp4.py``,
``test_w4a8_decode_kernels_give_the_128_row_bits``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...dispatch import DispatchPlan
from ...formats import MXFP4
from ..fp8.quantize import quantize_rows_into, quantized_rows
from . import w4a8, ws
from .ws import PRODUCER_REGS, ROWS, Launch, _exponent_words, gluon, widths_fit

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..gluon_common import swiglu
    from .w4a8 import _byte_max, _offsets
    from .ws import WORD_LAYOUT, _narrow_swiglu, _produce, _program, _ring, _rows, _store, handover_layout

BLOCK_K = 128  # one activation scale and one int32 of weight exponents per row and step

# As ``ws.LAUNCH`` (the same programs, e4m3 operands of half the registers), per tile height. scripts/sass.py
# checks that each compiles without spills.
LAUNCH = {
    16: Launch(56, 72, 4),
    32: Launch(80, 104, 6),  # consumers at 104 (80 spill): two programs an SM either way
}


def fits(block_m: int, hidden_size: int, width: int) -> bool:
    """Whether these kernels take a plan of ``block_m``-row tiles on experts of these widths (where
    ``ws.ws_eligible`` holds, which they need too)."""
    return block_m in LAUNCH and widths_fit(hidden_size, width)


if gluon is not None:
    _E4M3: gl.constexpr = gl.constexpr(w4a8._e4m3_asm())
    _BK: gl.constexpr = gl.constexpr(BLOCK_K)
    _ROWS: gl.constexpr = gl.constexpr(ROWS)

    # Where each thread of a 4-warp consumer holds the packed bytes of its 64 x 128 weight box (64 bytes a row):
    # of rows r and r + 8 (r = 16 w + lane / 4), word t of each group of 32 codes (bytes 4t..4t+3 of each 16,
    # t = lane % 4), one word a conversion, which LDSM loads as they lie.
    CODE_LAYOUT = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0], [0, 16], [0, 32]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[ROWS, BLOCK_K // 2])

    @gluon.jit
    def _bases(s_ptr, s_row, s_jump, stride_sn, k_steps, layout: gl.constexpr):
        """The base (SPEC §6: max(the row's largest exponent - 6, 1)) of a box's 64 rows (``s_row ..``, the second 32
        ``s_jump`` further) over their exponent words (one int32 a row and step), 16 words a row at once, in
        ``layout``'s slice along rows."""
        WL: gl.constexpr = WORD_LAYOUT  # the rows as CODE_LAYOUT holds them, 16 words a row across lanes
        rows = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, WL))
        words = gl.arange(0, _BK // 8, layout=gl.SliceLayout(0, WL))
        first = s_ptr + s_row.to(gl.int64) * stride_sn  # the box's first row; offsets from it in int32: registers
        offsets = gl.expand_dims(_rows(rows, s_jump) * stride_sn, 1) + gl.expand_dims(words, 0)
        top = gl.zeros([_ROWS], gl.int32, gl.SliceLayout(1, WL))
        for k0 in range(0, k_steps, _BK // 8):
            word = gl.load(first + (offsets + k0), mask=gl.expand_dims(k0 + words < k_steps, 0), other=0)
            top = gl.maximum(top, gl.max(_byte_max(word), axis=1))
        return gl.convert_layout(gl.maximum(top, 7) - 6, gl.SliceLayout(1, layout))  # max(top - 6, 1)

    @gluon.jit
    def _consume(w_smem, a_smem, ready, empty, s_ptr, as_ptr, s_row, s_jump, stride_sn, stride_am, stride_ag,
                 row_start, num_rows, k_steps, PART: gl.constexpr, BUFS: gl.constexpr, BLOCK_M: gl.constexpr,
                 STAGES: gl.constexpr, MMA: gl.constexpr):
        """A consumer's 64 weight rows (buffer ``BUFS`` · slot + ``PART``; exponent rows ``s_row ..``, the second 32
        ``s_jump`` further) times the tile's activation rows (from ``row_start``; their scales ``as_ptr``):
        [64, BLOCK_M] in fp32 (swapped), scaled by each row's 2^(base - 127)."""
        CL: gl.constexpr = CODE_LAYOUT
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
        rows = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, CL))
        byte = gl.arange(0, _BK // 2, layout=gl.SliceLayout(0, CL))
        shift = gl.expand_dims((byte // 16) * 8, 0)  # byte c of a row's step is in group c / 16
        base = _bases(s_ptr, s_row, s_jump, stride_sn, k_steps, CL)
        first = s_ptr + s_row.to(gl.int64) * stride_sn  # the box's first exponent row; int32 offsets from it
        s_rows = _rows(rows, s_jump) * stride_sn
        m = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
        a_rows = gl.minimum(m, num_rows - 1) * stride_am  # rows past the plan: never stored
        exponents = gl.load(first + s_rows)
        acc = gl.zeros([_ROWS, BLOCK_M], gl.float32, MMA)
        for i in range(k_steps):
            s = i % STAGES
            d = _offsets(exponents, shift, gl.expand_dims(base, 1))
            exponents = gl.load(first + (s_rows + gl.minimum(i + 1, k_steps - 1)))  # the next step's, meanwhile
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            codes = w_smem.index(BUFS * s + PART).load(CL)
            lo, hi = gl.inline_asm_elementwise(_E4M3, "=r,=r,r,r,r,r,r", [codes, d], dtype=(gl.float8e4nv,) * 2,
                                               is_pure=True, pack=4)
            # Byte j of word t's lo (hi) register is code 8t + j (8t + 4 + j) of its group g, at K position
            # 32g + 4t + j (32g + 16 + 4t + j): from [row, g, t, j] x (lo, hi) to [row, g, hi, t, j].
            w = gl.join(lo, hi).reshape(_ROWS, _BK // 32, 4, 4, 2).permute(0, 1, 4, 2, 3).reshape(_ROWS, _BK)
            w = gl.convert_layout(w, dot_a)  # the same registers (the layouts differ in register order only)
            part = warpgroup_mma(w, a_smem.index(s).permute((1, 0)), acc, use_acc=False, is_async=True)
            a_scale = gl.load(as_ptr + (a_rows + i * stride_ag))  # while the MMA runs
            part = warpgroup_mma_wait(0, deps=[part])
            mbarrier.arrive(empty.index(s))
            acc += part * gl.expand_dims(a_scale, 0)
        scale = gl.convert_layout((base << 23).to(gl.float32, bitcast=True), gl.SliceLayout(1, MMA))
        return acc * gl.expand_dims(scale, 1)

    @gluon.jit
    def _gemm1_up(w_smem, a_smem, ready, empty, s_ptr, as_ptr, s_row, stride_sn, stride_am, stride_ag, row_start,
                  num_rows, k_steps, handed, handover, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                  MMA: gl.constexpr):
        """The up consumer: its rows' sums go to the gate consumer through shared memory."""
        up = _consume(w_smem, a_smem, ready, empty, s_ptr, as_ptr, s_row, 0, stride_sn, stride_am, stride_ag,
                      row_start, num_rows, k_steps, 1, 2, BLOCK_M, STAGES, MMA)
        handover.store(up)
        mbarrier.arrive(handed)

    @gluon.jit
    def _gemm1_gate(w_smem, a_smem, ready, empty, s_ptr, as_ptr, inter_ptr, s_row, stride_sn, stride_am, stride_ag,
                    col0, stride_im, row_start, row_end, num_rows, k_steps, handed, handover, limit,
                    HAS_LIMIT: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr):
        """The gate consumer: SwiGLU of its rows' sums and the up consumer's, stored in bf16 in word order (GEMM2's
        K order)."""
        gate = _consume(w_smem, a_smem, ready, empty, s_ptr, as_ptr, s_row, 0, stride_sn, stride_am, stride_ag,
                        row_start, num_rows, k_steps, 0, 2, BLOCK_M, STAGES, MMA)
        mbarrier.wait(handed, 0)
        act = swiglu(gate, handover.load(MMA), limit, HAS_LIMIT)
        _store(act, inter_ptr, row_start, row_end, col0, stride_im, "words", BLOCK_M, MMA)

    @gluon.jit
    def _gemm1_narrow(w_smem, a_smem, ready, empty, s_ptr, as_ptr, inter_ptr, s_row, up_jump, stride_sn, stride_am,
                      stride_ag, col0, stride_im, row_start, row_end, num_rows, k_steps, handed, handover, limit,
                      HAS_LIMIT: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr):
        """A narrow GEMM1 program's consumer (``ws._gemm1_narrow``): 32 gate rows over the 32 up rows of the same
        columns, meeting through shared memory for SwiGLU."""
        acc = _consume(w_smem, a_smem, ready, empty, s_ptr, as_ptr, s_row, up_jump, stride_sn, stride_am, stride_ag,
                       row_start, num_rows, k_steps, 0, 1, BLOCK_M, STAGES, MMA)
        _narrow_swiglu(acc, handed, handover, inter_ptr, row_start, row_end, col0, stride_im, limit, HAS_LIMIT, "words",
                       BLOCK_M)

    @gluon.jit
    def _gemm2_part(w_smem, a_smem, ready, empty, s_ptr, as_ptr, out_ptr, s_row, stride_sn, stride_am, stride_ag,
                    col0, stride_om, row_start, row_end, num_rows, k_steps, PART: gl.constexpr, BUFS: gl.constexpr,
                    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr):
        acc = _consume(w_smem, a_smem, ready, empty, s_ptr, as_ptr, s_row + PART * _ROWS, 0, stride_sn, stride_am,
                       stride_ag, row_start, num_rows, k_steps, PART, BUFS, BLOCK_M, STAGES, MMA)
        _store(acc, out_ptr, row_start, row_end, col0 + PART * _ROWS, stride_om, "natural", BLOCK_M, MMA)

    @gluon.jit(do_not_specialize=["num_rows"])
    def _gemm1_kernel(w_desc, a_desc, s_ptr, as_ptr, inter_ptr, tile_expert_ptr, tile_row_start_ptr,
                      expert_offsets_ptr, N, K, num_rows, stride_sn, stride_am, stride_ag, stride_im, limit,
                      HAS_LIMIT: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                      PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, NARROW: gl.constexpr):
        """intermediate[rows, n] = SwiGLU(x @ gate[e, n]^T, x @ up[e, n]^T) in bf16 for 64 columns n a program (32
        ``NARROW``; N = I, K = H), x the tile's quantized activation rows (``a_desc``, scales ``as_ptr`` [rows,
        K/128])."""
        BN: gl.constexpr = _ROWS // 2 if NARROW else _ROWS
        expert, col_block, row_start, row_end = _program(gl.program_id(0), tile_expert_ptr, tile_row_start_ptr,
                                                         expert_offsets_ptr, N, BN)
        if expert >= 0:
            MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, BLOCK_M, 32])
            CONSUMERS: gl.constexpr = 1 if NARROW else 2
            w_smem, a_smem, ready, empty = _ring(w_desc, a_desc, BLOCK_M, STAGES, CONSUMERS)
            handover = gl.allocate_shared_memory(gl.float32, [_ROWS, BLOCK_M], handover_layout(BLOCK_M, NARROW))
            handed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(handed, count=1)
            gate_row = expert * 2 * N + col_block * BN  # rows of the [E·2N, K/2] bytes and [E·2N, K/128] words
            k_steps = K // _BK
            if NARROW:
                gl.warp_specialize([
                    (_gemm1_narrow, (w_smem, a_smem, ready, empty, s_ptr, as_ptr, inter_ptr, gate_row, N - BN,
                                     stride_sn, stride_am, stride_ag, col_block * BN, stride_im, row_start, row_end,
                                     num_rows, k_steps, handed, handover, limit, HAS_LIMIT, BLOCK_M, STAGES, MMA)),
                    (_produce, (w_desc, a_desc, w_smem, a_smem, ready, empty, gate_row, gate_row + N, row_start,
                                k_steps, STAGES, 2, 1)),
                ], [1], [PRODUCER_REGS])
            else:
                gl.warp_specialize([
                    (_gemm1_gate, (w_smem, a_smem, ready, empty, s_ptr, as_ptr, inter_ptr, gate_row, stride_sn,
                                   stride_am, stride_ag, col_block * BN, stride_im, row_start, row_end, num_rows,
                                   k_steps, handed, handover, limit, HAS_LIMIT, BLOCK_M, STAGES, MMA)),
                    (_produce, (w_desc, a_desc, w_smem, a_smem, ready, empty, gate_row, gate_row + N, row_start,
                                k_steps, STAGES, 2, 2)),
                    (_gemm1_up, (w_smem, a_smem, ready, empty, s_ptr, as_ptr, gate_row + N, stride_sn, stride_am,
                                 stride_ag, row_start, num_rows, k_steps, handed, handover, BLOCK_M, STAGES, MMA)),
                ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])

    @gluon.jit(do_not_specialize=["num_rows"])
    def _gemm2_kernel(w_desc, a_desc, s_ptr, as_ptr, out_ptr, tile_expert_ptr, tile_row_start_ptr,
                      expert_offsets_ptr, N, K, num_rows, stride_sn, stride_am, stride_ag, stride_om,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, NARROW: gl.constexpr):
        """out[rows, n] = intermediate[rows] @ down[e, n]^T in bf16 for 128 columns n a program (64 ``NARROW``;
        N = H, K = I), on the quantized intermediate (``a_desc``, scales ``as_ptr``)."""
        CONSUMERS: gl.constexpr = 1 if NARROW else 2
        expert, col_block, row_start, row_end = _program(gl.program_id(0), tile_expert_ptr, tile_row_start_ptr,
                                                         expert_offsets_ptr, N, CONSUMERS * _ROWS)
        if expert >= 0:
            MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, BLOCK_M, 32])
            w_smem, a_smem, ready, empty = _ring(w_desc, a_desc, BLOCK_M, STAGES, CONSUMERS)
            w_row = expert * N + col_block * CONSUMERS * _ROWS
            col0 = col_block * CONSUMERS * _ROWS
            k_steps = K // _BK
            if NARROW:
                gl.warp_specialize([
                    (_gemm2_part, (w_smem, a_smem, ready, empty, s_ptr, as_ptr, out_ptr, w_row, stride_sn,
                                   stride_am, stride_ag, col0, stride_om, row_start, row_end, num_rows, k_steps, 0,
                                   1, BLOCK_M, STAGES, MMA)),
                    (_produce, (w_desc, a_desc, w_smem, a_smem, ready, empty, w_row, w_row, row_start, k_steps,
                                STAGES, 1, 1)),
                ], [1], [PRODUCER_REGS])
            else:
                gl.warp_specialize([
                    (_gemm2_part, (w_smem, a_smem, ready, empty, s_ptr, as_ptr, out_ptr, w_row, stride_sn,
                                   stride_am, stride_ag, col0, stride_om, row_start, row_end, num_rows, k_steps, 0,
                                   2, BLOCK_M, STAGES, MMA)),
                    (_produce, (w_desc, a_desc, w_smem, a_smem, ready, empty, w_row, w_row + _ROWS, row_start,
                                k_steps, STAGES, 2, 2)),
                    (_gemm2_part, (w_smem, a_smem, ready, empty, s_ptr, as_ptr, out_ptr, w_row, stride_sn,
                                   stride_am, stride_ag, col0, stride_om, row_start, row_end, num_rows, k_steps, 1,
                                   2, BLOCK_M, STAGES, MMA)),
                ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


def descriptors(values: torch.Tensor, rows: torch.Tensor, block_m: int,
                box_rows: int = ROWS) -> tuple[object, object]:
    """TMA descriptors of a box of ``box_rows`` rows of packed bytes (``values`` [E, N, K/2] seen as [E·N, K/2], a
    step's 64 bytes a row) and of a tile's e4m3 activation rows (a step's 128)."""
    E, N, half_k = values.shape
    w_layout = gl.NVMMASharedLayout.get_default_for([box_rows, BLOCK_K // 2], gl.int8)
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], gl.float8e4nv)
    return (TensorDescriptor.from_tensor(values.view(torch.int8).reshape(E * N, half_k), [box_rows, BLOCK_K // 2],
                                         w_layout),
            TensorDescriptor.from_tensor(rows, [block_m, BLOCK_K], a_layout))


def experts_mxfp4_w4a8_decode(
    hidden: torch.Tensor,
    gate_up: MXFP4,
    down: MXFP4,
    plan: DispatchPlan,
    out: torch.Tensor,
    swiglu_limit: Optional[float] = None,
) -> None:
    """Quantize GEMM1's rows (in word order), GEMM1 + SwiGLU (bf16, in word order), quantize the intermediate,
    GEMM2, into ``out``. Call only where :func:`fits` and ``ws.ws_eligible`` hold."""
    num_tiles = plan.tile_expert.numel()
    width, hidden_size = down.shape[2], hidden.shape[1]
    if num_tiles == 0:
        return
    shape = LAUNCH[plan.block_m]
    consts = {"BLOCK_M": plan.block_m, "STAGES": shape.stages, "PRODUCER_REGS": PRODUCER_REGS,
              "CONSUMER_REGS": shape.consumer_regs, "num_warps": 4, "maxnreg": shape.maxnreg}
    rows, row_scales = quantized_rows(plan, hidden_size, hidden.device)
    quantize_rows_into(hidden, rows, row_scales, plan, gather=True, word_order=True)
    inter = torch.empty(plan.num_rows, width, dtype=torch.bfloat16, device=hidden.device)
    s1, s2 = _exponent_words(gate_up.scales), _exponent_words(down.scales)
    grid, narrow = ws.launch_grid(num_tiles * (width // ROWS), plan.block_m, hidden.device)  # as W4A16's
    w_desc, a_desc = descriptors(gate_up.values, rows, plan.block_m, ROWS // 2 if narrow else ROWS)
    _gemm1_kernel[grid](
        w_desc, a_desc, s1, row_scales, inter, plan.tile_expert, plan.tile_row_start, plan.expert_offsets,
        width, hidden_size, plan.num_rows, s1.stride(0), row_scales.stride(0), row_scales.stride(1), inter.stride(0),
        0.0 if swiglu_limit is None else float(swiglu_limit), HAS_LIMIT=swiglu_limit is not None, NARROW=narrow,
        **consts)
    inter_rows, inter_scales = quantized_rows(plan, width, hidden.device)
    quantize_rows_into(inter, inter_rows, inter_scales, plan, gather=False)
    grid, narrow = ws.launch_grid(num_tiles * (hidden_size // (2 * ROWS)), plan.block_m, hidden.device)
    w_desc, a_desc = descriptors(down.values, inter_rows, plan.block_m)
    _gemm2_kernel[grid](
        w_desc, a_desc, s2, inter_scales, out, plan.tile_expert, plan.tile_row_start, plan.expert_offsets,
        hidden_size, width, plan.num_rows, s2.stride(0), inter_scales.stride(0), inter_scales.stride(1),
        out.stride(0), NARROW=narrow, **consts)
