"""Warp-specialized MXFP4 GEMMs (W4A16) on Hopper, in Gluon (sm_90 only; ``kernels.py`` runs elsewhere).

Same contract and numerics as the Triton kernels of ``kernels.py`` (SPEC §6): the same unpacking (``_unpack_asm``),
the same swapped MMA (the unpacked weights are the wgmma's first operand, from registers; a tile's tokens its N),
the same K order and 128-deep steps, so the outputs are bit-identical to theirs. What differs is who does what.
Words used below: a *box* is the block one TMA load copies into shared memory (here 64 weight rows of a 128-deep
step, or a tile's activation rows for that step); a *slot* is one stage of the shared-memory ring the loads fill,
with a ``ready`` barrier (its bytes have landed) and an ``empty`` one (its readers are done with it). A program
holds 128 weight rows and runs three partitions:

- a producer warp that streams, per 128-deep step, the two 64-row boxes of packed words and the tile's activation
  rows through TMA into the next slot;
- two independent 4-warp consumers (one warp group each), one per 64-row box: each waits for a slot, loads its
  words in the MMA operand's per-thread order (LDSM), unpacks them, issues the step's eight wgmmas, waits for them
  and frees the slot (the empty barrier counts both consumers).

In the Triton kernel every warp issues its own loads and waits on its own pipeline, and 8 warps share one tile;
here the loads and their bookkeeping leave the unpacking warps, a step's multiplier costs two instructions a word
(the exponents come as one int32 per row and step, loaded a step ahead), and at 16-row tiles three programs fit
an SM (``LAUNCH``). The op runs these on Hopper because they are faster at every token count: DeepSeek-V4-Flash
experts on one H200, 48 against 64 µs at one token, 3,349 against 4,367 at 4,096 (2026-12-01; the history is in
docs/PERF-NOTES.md).

The tiles' activations come through TMA, so they must be contiguous rows in the MMA's K order: GEMM1's are
gathered first (``common.gather_rows``: the plan's rows of ``hidden``, columns permuted within each group of 32 as
``kernels._paired`` does in registers), and GEMM1 writes the intermediate in that order for GEMM2 to read as it is.
SwiGLU pairs a gate row with the up row of the same column, which the other consumer holds: the up consumer hands
its accumulator over through shared memory and an mbarrier, and the gate consumer finishes the tile.

Where a grid of such programs would put two on some SMs and one on the rest (a token: DeepSeek-V4-Flash's six
experts make 192 programs on 132 SMs, 60 of them running two), the kernels run *narrow* programs of one consumer
instead (``NARROW``, :func:`narrow_grid`): GEMM2's hold one 64-row box, GEMM1's a box of 32 gate rows over the 32
up rows of the same columns (two 32-row TMA loads into one slot), the consumer exchanging its halves through shared
memory for SwiGLU. Twice the programs, each half the work, about three an SM; each row's sums are the same MMAs in
the same order, so the bits are the wide programs'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ... import _runtime
from ...dispatch import DispatchPlan
from ...formats import MXFP4
from ..common import gather_rows
from .kernels import _unpack_asm

try:  # Gluon ships with Triton >= 3.5; without it (or off Hopper) the Triton kernels run
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..gluon_common import swiglu, tma_load, word_position
except ImportError:  # pragma: no cover - every supported Triton has it
    gluon = None

BLOCK_K = 128  # one int32 of exponents (four groups of 32) per row and step
ROWS = 64  # weight rows per consumer: one wgmma M
NARROW_HEIGHTS = (16,)  # tile heights that may run narrow programs (a token or two: 16-row tiles)
PRODUCER_REGS = 24  # the producer warp's registers after the hand-over (setmaxnreg); the consumers take the rest


@dataclass(frozen=True)
class Launch:
    """Per tile height: registers a thread at launch (``maxnreg``: how many 12-warp programs fit an SM's 64K),
    the consumers' registers after the hand-over (``setmaxnreg``), and the ring's slots. Each is the fewest
    registers that compile without spills for both GEMMs (``scripts/sass.py`` checks it), so that as many programs
    as possible share an SM."""

    maxnreg: int
    consumer_regs: int
    stages: int


LAUNCH = {
    16: Launch(56, 72, 4),  # three programs an SM: GEMM2 at 16 tokens 124 µs, against 134 for two (H200, 2026-12-01)
    32: Launch(80, 88, 6),  # two: at 56 registers the 32-column accumulators spill
    64: Launch(128, 152, 4),  # one
    128: Launch(168, 232, 4),  # one (GEMM1's hand-over spills at 128 registers)
}

if gluon is not None:
    _UNPACK: gl.constexpr = gl.constexpr(_unpack_asm(from_exponents=True))
    _BK: gl.constexpr = gl.constexpr(BLOCK_K)  # the kernels' copies of the constants above
    _ROWS: gl.constexpr = gl.constexpr(ROWS)

    # Where each thread of a 4-warp consumer holds the packed words of its 64 x 128 weight box: word t of each group
    # of 32 columns of rows r and r + 8 (r = 16 w + lane / 4, t = lane % 4), the four pairs of bf16 it unpacks to
    # being the thread's registers of that row in the wgmma operand (``kernels._mma_order``).
    WORD_LAYOUT = gl.DistributedLinearLayout(
        reg_bases=[[8, 0], [0, 4], [0, 8]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[ROWS, BLOCK_K // 8])

    @gluon.constexpr_function
    def handover_layout(block_m, narrow):
        """The layout of GEMM1's hand-over buffer ([64 weight rows, ``block_m`` tokens] of fp32), swizzled so that
        its accesses meet in as few banks as they can (``research/smem_banks.py``). Wide programs write and read it
        in the wgmma accumulator's layout, a 16-lane phase of 8-byte accesses covering four rows' 32 bytes: each
        row's 32-byte units XORed with the row puts the four in different banks (4-way conflicts before). At 16
        tokens it stays plain (2-way): sm_90 SASS of the swizzled build (Triton 3.6) had 0.9% more instructions in
        the main loop, which the decode kernels' time follows. A narrow program reads it a column a thread
        (``_narrow_swiglu``): 32 rows of 64 bytes, 16-way before, 2-way with each row pair's columns moved along."""
        if narrow:
            return gl.SwizzledSharedLayout(2, 2, 16, order=[1, 0])
        if block_m < 32:
            return gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        return gl.SwizzledSharedLayout(8, 1, 4, order=[1, 0])

    @gluon.jit
    def _produce(w_desc, a_desc, w_smem, a_smem, ready, empty, w_row0, w_row1, a_row, k_steps,
                 STAGES: gl.constexpr, BOXES: gl.constexpr, BUFS: gl.constexpr):
        """The producer warp: per step, the weight boxes (rows ``w_row0 ..`` and, with two, ``w_row1 ..``) and the
        activation rows into slot i % STAGES: two boxes into two buffers (wide programs) or the two halves of one
        (narrow GEMM1's 32-row boxes), one box into one buffer (narrow GEMM2)."""
        step: gl.constexpr = w_desc.block_shape[1]  # a weight box's columns: a 128-deep step's words or bytes
        for i in range(k_steps):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # the first lap finds every slot free
            mbarrier.expect(ready.index(s), BOXES * w_desc.block_type.nbytes + a_desc.block_type.nbytes)
            if BOXES == 1:
                tma_load(w_desc, [w_row0, i * step], ready.index(s), w_smem.index(s))
            elif BUFS == 2:
                tma_load(w_desc, [w_row0, i * step], ready.index(s), w_smem.index(2 * s))
                tma_load(w_desc, [w_row1, i * step], ready.index(s), w_smem.index(2 * s + 1))
            else:
                tma_load(w_desc, [w_row0, i * step], ready.index(s), w_smem.index(s).slice(0, _ROWS // 2))
                tma_load(w_desc, [w_row1, i * step], ready.index(s), w_smem.index(s).slice(_ROWS // 2, _ROWS // 2))
            tma_load(a_desc, [a_row, i * _BK], ready.index(s), a_smem.index(s))

    @gluon.jit
    def _rows(rows, s_jump):
        """A box's rows of exponents from its first: its second 32 rows ``s_jump`` further (narrow GEMM1's up rows)."""
        return rows + gl.where(rows >= _ROWS // 2, s_jump, 0)

    @gluon.jit
    def _consume(w_smem, a_smem, ready, empty, s_ptr, s_row, s_jump, stride_sn, k_steps, PART: gl.constexpr,
                 BUFS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, WL: gl.constexpr,
                 MMA: gl.constexpr):
        """A consumer's main loop over K: ``acc`` [64, BLOCK_M] (fp32, swapped) of its weight box (buffer
        ``BUFS`` · slot + ``PART``), rows ``s_row ..`` of the exponents (an int32 view, one word per row and step),
        its second 32 rows ``s_jump`` further (narrow GEMM1's up rows)."""
        G: gl.constexpr = _BK // 32
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        rows = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, WL))
        cols = gl.arange(0, _BK // 8, layout=gl.SliceLayout(0, WL))
        selector = gl.expand_dims((cols // 4) * 0x1010 + 0x0404, 0)  # word c is in group c / 4 of the step
        s_ptrs = s_ptr + (s_row + _rows(rows, s_jump)).to(gl.int64) * stride_sn
        exponents = gl.load(s_ptrs)
        acc = gl.zeros([_ROWS, BLOCK_M], gl.float32, MMA)
        for i in range(k_steps):
            s = i % STAGES
            biased = gl.expand_dims(exponents, 1) + 0x7E7E7E7E  # e + 126 per byte: no carry for e <= 129
            exponents = gl.load(s_ptrs + gl.minimum(i + 1, k_steps - 1))  # the next step's, while this one runs
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            words = w_smem.index(BUFS * s + PART).load(WL)
            biased, sel = gl.broadcast(biased, selector)
            x0, x4, x1, x5, x2, x6, x3, x7 = gl.inline_asm_elementwise(
                _UNPACK, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, biased, sel], dtype=(gl.bfloat16,) * 8,
                is_pure=True, pack=1)
            # Into the operand's K order: weight 8t + j + 4b of each group at 8j + 2t + b (kernels._mma_order); the
            # conversion moves no data (the words were loaded where the operand wants them).
            p0 = gl.join(x0.reshape(_ROWS, G, 4), x4.reshape(_ROWS, G, 4))
            p1 = gl.join(x1.reshape(_ROWS, G, 4), x5.reshape(_ROWS, G, 4))
            p2 = gl.join(x2.reshape(_ROWS, G, 4), x6.reshape(_ROWS, G, 4))
            p3 = gl.join(x3.reshape(_ROWS, G, 4), x7.reshape(_ROWS, G, 4))
            pairs = gl.join(gl.join(p0, p2), gl.join(p1, p3))
            w = gl.convert_layout(pairs.permute(0, 1, 4, 5, 2, 3).reshape(_ROWS, _BK), dot_a)
            acc = warpgroup_mma(w, a_smem.index(s).permute((1, 0)), acc, is_async=True)
            # Waited for at once: keeping a step in flight makes ptxas serialize the wgmmas (their register
            # operands), which is slower; the other consumer and programs fill the wait.
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index(s))
        return acc

    @gluon.jit
    def _store(acc, out_ptr, row_start, row_end, col0, stride_om, ORDER: gl.constexpr, BLOCK_M: gl.constexpr,
               MMA: gl.constexpr, COLS: gl.constexpr = _ROWS):
        """``out[rows, col0 + n] = acc[n, rows - row_start]`` in bf16 for the expert's rows (``acc`` [COLS,
        BLOCK_M] in layout ``MMA``), column n of each group of 32 where the next GEMM's operand wants it: as it is
        (``ORDER`` "natural"), column 8t + 4b + j at 8j + 2t + b ("paired": W4A16's K order) or at 4t + 16b + j
        ("words": W4A8's, ``gluon_common.word_position``)."""
        m = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
        n = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(1, MMA))
        if ORDER == "paired":
            n = (n & ~31) | ((n & 3) << 3) | (((n >> 3) & 3) << 1) | ((n >> 2) & 1)
        elif ORDER == "words":
            n = word_position(n)
        ptrs = out_ptr + gl.expand_dims(m.to(gl.int64) * stride_om, 0) + gl.expand_dims(n, 1)
        gl.store(ptrs, acc.to(gl.bfloat16), mask=gl.expand_dims(m < row_end, 0) & gl.expand_dims(n >= 0, 1))

    @gluon.jit
    def _gemm2_part(w_smem, a_smem, ready, empty, s_ptr, out_ptr, s_row, stride_sn, col0, stride_om, row_start,
                    row_end, k_steps, PART: gl.constexpr, BUFS: gl.constexpr, BLOCK_M: gl.constexpr,
                    STAGES: gl.constexpr, WL: gl.constexpr, MMA: gl.constexpr):
        acc = _consume(w_smem, a_smem, ready, empty, s_ptr, s_row + PART * _ROWS, 0, stride_sn, k_steps, PART, BUFS,
                       BLOCK_M, STAGES, WL, MMA)
        _store(acc, out_ptr, row_start, row_end, col0 + PART * _ROWS, stride_om, "natural", BLOCK_M, MMA)

    @gluon.jit
    def _gemm1_up(w_smem, a_smem, ready, empty, s_ptr, s_row, stride_sn, k_steps, handed, handover,
                  BLOCK_M: gl.constexpr, STAGES: gl.constexpr, WL: gl.constexpr, MMA: gl.constexpr):
        """The up consumer: its accumulator goes to the gate consumer through shared memory."""
        acc = _consume(w_smem, a_smem, ready, empty, s_ptr, s_row, 0, stride_sn, k_steps, 1, 2, BLOCK_M, STAGES, WL,
                       MMA)
        handover.store(acc)
        mbarrier.arrive(handed)

    @gluon.jit
    def _gemm1_gate(w_smem, a_smem, ready, empty, s_ptr, out_ptr, s_row, stride_sn, col0, stride_om, row_start,
                    row_end, k_steps, handed, handover, limit, HAS_LIMIT: gl.constexpr, BLOCK_M: gl.constexpr,
                    STAGES: gl.constexpr, WL: gl.constexpr, MMA: gl.constexpr):
        """The gate consumer: SwiGLU of its accumulator and the up consumer's (as ``common._swiglu``), stored in
        the paired K order."""
        gate = _consume(w_smem, a_smem, ready, empty, s_ptr, s_row, 0, stride_sn, k_steps, 0, 2, BLOCK_M, STAGES, WL,
                        MMA)
        mbarrier.wait(handed, 0)
        act = swiglu(gate, handover.load(MMA), limit, HAS_LIMIT)
        _store(act, out_ptr, row_start, row_end, col0, stride_om, "paired", BLOCK_M, MMA)

    @gluon.jit
    def _gemm1_narrow(w_smem, a_smem, ready, empty, s_ptr, out_ptr, s_row, up_jump, stride_sn, col0, stride_om,
                      row_start, row_end, k_steps, handed, handover, limit, HAS_LIMIT: gl.constexpr,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr, WL: gl.constexpr, MMA: gl.constexpr):
        """A narrow GEMM1 program's consumer: its box holds 32 gate rows over the 32 up rows of the same columns
        (held by warps 0-1 and 2-3), which meet through shared memory for SwiGLU."""
        acc = _consume(w_smem, a_smem, ready, empty, s_ptr, s_row, up_jump, stride_sn, k_steps, 0, 1, BLOCK_M, STAGES,
                       WL, MMA)
        _narrow_swiglu(acc, handed, handover, out_ptr, row_start, row_end, col0, stride_om, limit, HAS_LIMIT, "paired",
                       BLOCK_M)

    @gluon.jit
    def _narrow_swiglu(acc, handed, handover, out_ptr, row_start, row_end, col0, stride_om, limit,
                       HAS_LIMIT: gl.constexpr, ORDER: gl.constexpr, BLOCK_M: gl.constexpr):
        """A narrow GEMM1 consumer's epilogue: the gate rows of ``acc`` (its first 32, warps 0-1) meet the up rows of
        the same columns (its last 32, warps 2-3) through shared memory for SwiGLU, stored in ``ORDER``
        (``_store``)."""
        handover.store(acc)
        mbarrier.arrive(handed)  # after a barrier of the warp group: every warp's half is stored
        mbarrier.wait(handed, 0)
        EPI: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, 4], [0, 1])  # a thread a column, warps along rows
        half: gl.constexpr = _ROWS // 2
        act = swiglu(handover.slice(0, half).load(EPI), handover.slice(half, half).load(EPI), limit, HAS_LIMIT)
        _store(act, out_ptr, row_start, row_end, col0, stride_om, ORDER, BLOCK_M, EPI, half)

    @gluon.jit
    def _program(pid, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, N, BN: gl.constexpr):
        """The work of program ``pid`` (one plan tile times one column block): tile ``pid // (N / BN)`` of the plan,
        column block ``pid % (N / BN)``; its expert (-1: an unused tile), its first row and its expert's end."""
        col_blocks = N // BN
        tile = pid // col_blocks
        expert = gl.load(tile_expert_ptr + tile)
        row_start = gl.load(tile_row_start_ptr + tile)
        row_end = gl.load(expert_offsets_ptr + gl.maximum(expert, 0) + 1)
        return expert, pid % col_blocks, row_start, row_end

    @gluon.jit
    def _ring(w_desc, a_desc, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
        """The slots: a 64-row weight buffer per consumer (a step's packed words, or bytes), the activation rows
        (bf16, or e4m3 for W4A8), their ready and empty barriers."""
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [CONSUMERS * STAGES, _ROWS, w_desc.block_shape[1]],
                                           w_desc.layout)
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, _BK], a_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=CONSUMERS)
        return w_smem, a_smem, ready, empty

    @gluon.jit
    def _gemm1_ws_kernel(w_desc, a_desc, s_ptr, inter_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                         N, K, stride_sn, stride_im, limit, HAS_LIMIT: gl.constexpr, BLOCK_M: gl.constexpr,
                         STAGES: gl.constexpr, WL: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, NARROW: gl.constexpr):
        """intermediate[rows, paired(n)] = SwiGLU(x @ gate[e, n]^T, x @ up[e, n]^T) for 64 columns n a program (32
        ``NARROW``). N = I, K = H; ``a_desc`` reads the gathered, paired activation rows."""
        BN: gl.constexpr = _ROWS // 2 if NARROW else _ROWS
        expert, col_block, row_start, row_end = _program(gl.program_id(0), tile_expert_ptr, tile_row_start_ptr,
                                                         expert_offsets_ptr, N, BN)
        if expert >= 0:
            MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, BLOCK_M, 16])
            CONSUMERS: gl.constexpr = 1 if NARROW else 2
            w_smem, a_smem, ready, empty = _ring(w_desc, a_desc, BLOCK_M, STAGES, CONSUMERS)
            handover = gl.allocate_shared_memory(gl.float32, [_ROWS, BLOCK_M], handover_layout(BLOCK_M, NARROW))
            handed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(handed, count=1)
            gate_row = expert * 2 * N + col_block * BN  # rows of the [E·2N, K/8] words and [E·2N, K/128] scales
            k_steps = K // _BK
            if NARROW:
                gl.warp_specialize([
                    (_gemm1_narrow, (w_smem, a_smem, ready, empty, s_ptr, inter_ptr, gate_row, N - BN, stride_sn,
                                     col_block * BN, stride_im, row_start, row_end, k_steps, handed, handover, limit,
                                     HAS_LIMIT, BLOCK_M, STAGES, WL, MMA)),
                    (_produce, (w_desc, a_desc, w_smem, a_smem, ready, empty, gate_row, gate_row + N, row_start,
                                k_steps, STAGES, 2, 1)),
                ], [1], [PRODUCER_REGS])
            else:
                gl.warp_specialize([
                    (_gemm1_gate, (w_smem, a_smem, ready, empty, s_ptr, inter_ptr, gate_row, stride_sn,
                                   col_block * BN, stride_im, row_start, row_end, k_steps, handed, handover, limit,
                                   HAS_LIMIT, BLOCK_M, STAGES, WL, MMA)),
                    (_produce, (w_desc, a_desc, w_smem, a_smem, ready, empty, gate_row, gate_row + N, row_start,
                                k_steps, STAGES, 2, 2)),
                    (_gemm1_up, (w_smem, a_smem, ready, empty, s_ptr, gate_row + N, stride_sn, k_steps, handed,
                                 handover, BLOCK_M, STAGES, WL, MMA)),
                ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])

    @gluon.jit
    def _gemm2_ws_kernel(w_desc, a_desc, s_ptr, out_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                         N, K, stride_sn, stride_om, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, WL: gl.constexpr,
                         PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, NARROW: gl.constexpr):
        """out[rows, n] = intermediate[rows] @ down[e, n]^T for 128 columns n a program (64 ``NARROW``). N = H,
        K = I; the intermediate in the paired K order (GEMM1 wrote it so)."""
        CONSUMERS: gl.constexpr = 1 if NARROW else 2
        expert, col_block, row_start, row_end = _program(gl.program_id(0), tile_expert_ptr, tile_row_start_ptr,
                                                         expert_offsets_ptr, N, CONSUMERS * _ROWS)
        if expert >= 0:
            MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, BLOCK_M, 16])
            w_smem, a_smem, ready, empty = _ring(w_desc, a_desc, BLOCK_M, STAGES, CONSUMERS)
            w_row = expert * N + col_block * CONSUMERS * _ROWS
            col0 = col_block * CONSUMERS * _ROWS
            k_steps = K // _BK
            if NARROW:
                gl.warp_specialize([
                    (_gemm2_part, (w_smem, a_smem, ready, empty, s_ptr, out_ptr, w_row, stride_sn, col0, stride_om,
                                   row_start, row_end, k_steps, 0, 1, BLOCK_M, STAGES, WL, MMA)),
                    (_produce, (w_desc, a_desc, w_smem, a_smem, ready, empty, w_row, w_row, row_start, k_steps,
                                STAGES, 1, 1)),
                ], [1], [PRODUCER_REGS])
            else:
                gl.warp_specialize([
                    (_gemm2_part, (w_smem, a_smem, ready, empty, s_ptr, out_ptr, w_row, stride_sn, col0, stride_om,
                                   row_start, row_end, k_steps, 0, 2, BLOCK_M, STAGES, WL, MMA)),
                    (_produce, (w_desc, a_desc, w_smem, a_smem, ready, empty, w_row, w_row + _ROWS, row_start,
                                k_steps, STAGES, 2, 2)),
                    (_gemm2_part, (w_smem, a_smem, ready, empty, s_ptr, out_ptr, w_row, stride_sn, col0, stride_om,
                                   row_start, row_end, k_steps, 1, 2, BLOCK_M, STAGES, WL, MMA)),
                ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


def ws_eligible(hidden: torch.Tensor, gate_up: MXFP4, down: MXFP4, plan: DispatchPlan) -> bool:
    """Whether :func:`experts_mxfp4_ws` runs these experts: tiles of a height in ``LAUNCH`` on an sm_90 GPU (not the
    interpreter), H and I multiples of 128 (whole steps and column blocks: no masks), and weights whose bytes are
    contiguous (the kernels read [E·N, K/8] words and [E·N, K/128] exponent words through flat views)."""
    return (gluon is not None and hidden.is_cuda and not _runtime.interpreting()
            and _runtime.capability(hidden.device) == (9, 0) and plan.block_m in LAUNCH
            and widths_fit(gate_up.shape[2], gate_up.shape[1] // 2)
            and all(_flat(t) for w in (gate_up, down) for t in (w.values, w.scales)))


def widths_fit(hidden_size: int, width: int) -> bool:
    """Whether experts of model width H and intermediate width I are whole 128-deep steps and column blocks."""
    return width > 0 and width % BLOCK_K == 0 and hidden_size % BLOCK_K == 0


def _flat(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous() and tensor.storage_offset() % 4 == 0


def _exponent_words(scales: torch.Tensor) -> torch.Tensor:
    """Scales [E, N, K/32] (uint8 or e8m0, contiguous) as int32 words [E·N, K/128], four groups each."""
    E, N, groups = scales.shape
    return scales.view(torch.uint8).view(E * N, groups).view(torch.int32)


def narrow_grid(programs: int, block_m: int, device: torch.device) -> bool:
    """Whether a GEMM whose wide grid is ``programs`` programs of ``block_m``-row tiles runs narrow ones (module
    docstring): where the wide grid puts two programs on some SMs and one on others (more programs than SMs, at
    most twice as many), on the heights of ``NARROW_HEIGHTS``. DeepSeek-V4-Flash's experts at one token (192
    programs a GEMM): 52.3 -> 48.9 µs; Qwen3-30B-A3B's GEMM1 at two tokens (204) 15.5 -> 13.6; no faster where the
    wide grid holds one program an SM or less (Qwen3's GEMM1 at one token, 108: 9.6 against 9.9) or more than two
    (DeepSeek-V4-Flash at two tokens, 416: 46.5 against 50.1) (H100, research/mxfp4_narrow.py)."""
    sms = _runtime.sm_count(device)
    return block_m in NARROW_HEIGHTS and sms < programs <= 2 * sms


def launch_grid(programs: int, block_m: int, device: torch.device) -> tuple[tuple[int], bool]:
    """The grid of a GEMM whose wide grid is ``programs`` programs, and whether its programs are narrow
    (:func:`narrow_grid`): two narrow programs share a wide one's columns."""
    narrow = narrow_grid(programs, block_m, device)
    return (2 * programs if narrow else programs,), narrow


def _descriptors(words: torch.Tensor, rows: torch.Tensor, block_m: int, box_rows: int = ROWS) -> tuple[object, object]:
    """TMA descriptors of a weight box (``box_rows`` rows of ``words`` [E, N, K/8] seen as [E·N, K/8]) and of
    a tile's activation rows."""
    E, N, W = words.shape
    w_layout = gl.NVMMASharedLayout.get_default_for([box_rows, BLOCK_K // 8], gl.int32)
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], gl.bfloat16)
    return (TensorDescriptor.from_tensor(words.reshape(E * N, W), [box_rows, BLOCK_K // 8], w_layout),
            TensorDescriptor.from_tensor(rows, [block_m, BLOCK_K], a_layout))


def experts_mxfp4_ws(
    hidden: torch.Tensor,
    gate_up: MXFP4,
    down: MXFP4,
    plan: DispatchPlan,
    out: torch.Tensor,
    swiglu_limit: Optional[float] = None,
) -> None:
    """Gather GEMM1's rows, then GEMM1 + SwiGLU and GEMM2 with the warp-specialized kernels, into ``out``. Call
    only where :func:`ws_eligible` holds."""
    num_tiles = plan.tile_expert.numel()
    width, hidden_size = down.shape[2], hidden.shape[1]
    if num_tiles == 0:
        return
    rows = gather_rows(hidden, plan, paired=True)
    inter = torch.empty(plan.num_rows, width, dtype=hidden.dtype, device=hidden.device)
    w1, w2 = gate_up.values.view(torch.int32), down.values.view(torch.int32)  # [E, N, K/8], eight codes a word
    s1, s2 = _exponent_words(gate_up.scales), _exponent_words(down.scales)
    shape = LAUNCH[plan.block_m]
    launch = {"num_warps": 4, "maxnreg": shape.maxnreg}
    consts = {"BLOCK_M": plan.block_m, "STAGES": shape.stages, "WL": WORD_LAYOUT, "PRODUCER_REGS": PRODUCER_REGS,
              "CONSUMER_REGS": shape.consumer_regs}
    grid, narrow = launch_grid(num_tiles * (width // ROWS), plan.block_m, hidden.device)  # narrow: 32 columns, not 64
    w_desc, a_desc = _descriptors(w1, rows, plan.block_m, ROWS // 2 if narrow else ROWS)
    _gemm1_ws_kernel[grid](
        w_desc, a_desc, s1, inter, plan.tile_expert, plan.tile_row_start, plan.expert_offsets,
        width, hidden_size, s1.stride(0), inter.stride(0), 0.0 if swiglu_limit is None else float(swiglu_limit),
        HAS_LIMIT=swiglu_limit is not None, NARROW=narrow, **consts, **launch)
    grid, narrow = launch_grid(num_tiles * (hidden_size // (2 * ROWS)), plan.block_m, hidden.device)  # 64, not 128
    w_desc, a_desc = _descriptors(w2, inter, plan.block_m)
    _gemm2_ws_kernel[grid](
        w_desc, a_desc, s2, out, plan.tile_expert, plan.tile_row_start, plan.expert_offsets,
        hidden_size, width, s2.stride(0), out.stride(0), NARROW=narrow, **consts, **launch)
