"""MXFP4 experts with fp8 MMAs at prefill (W4A8, SPEC §6), in Gluon for sm_90.

At prefill the W4A16 kernels (``ws.py``) run their MMAs in bf16, at half the fp8 rate, and each consumer
unpacks its own weights between its MMAs. Here the activations are quantized to e4m3 per token and 128 columns
(SPEC §5: GEMM1's by ``fp8.quantize.quantize_rows_into``, a kernel of its own over the gathered rows; GEMM2's by
GEMM1's consumers), the weights are converted to e4m3 exactly, and a program splits the work three ways (a *box*
is the block one TMA load copies into shared memory; a *slot*, one stage of the shared-memory ring those loads
fill, with ``ready`` and ``empty`` barriers):

- a producer warp streams, per 128-deep step, the packed words of the program's 128 weight rows and the tile's
  activation rows (TMA) into the next slot;
- a transform warp group (the default partition) unpacks each step's words once into an e4m3 tile in shared memory
  (``_e4m3_asm``), with each row's step scale beside it;
- two consumer warp groups, 64 activation rows each, multiply the activation rows by that tile (wgmma, both from
  shared memory) into a fresh accumulator per step, and add it to theirs times the rows' activation scales and the
  columns' step scales: the fp32 promotion every 128 products of SPEC §5.

The unpacking is paid once per 128 tokens and its warps never wait for an MMA; GEMM1's 64 gate rows and 64 up
rows of the same columns land in one consumer's accumulator, so SwiGLU needs no hand-over. Each group of 32 K
columns reaches the wgmma in word order (``gluon_common.word_position``), the decode kernels' (``w4a8_decode.py``),
so both give a token the same sums: the transform stores each word's two e4m3 registers 16 bytes apart, and the
activations and the intermediate are written in that order.

A work *item* is one 128-row tile of the plan times 128 weight rows. The programs are persistent, one an SM: each
takes every num_programs-th item (GEMM1's in pairs, below) and the ring runs on across them, so an item's first
loads and unpacking overlap the previous item's last MMAs and its stores; each item's row scales alternate between
two buffers, and each partition derives its ring position from the items it has done. One program per item would
pay a fixed cost of about 3 µs an item, 11% of GEMM1 and 20% of GEMM2 (DeepSeek-V4-Flash at 4,096 tokens, H200,
2026-12-02).

GEMM1's items come in pairs, the two 64-column halves of a 128-column block, taken one after the other by the same
program: the first half's SwiGLU waits in shared memory (rounded to bf16), the second's consumer quantizes both and
writes the e4m3 intermediate and its scales, which GEMM2 reads as they are: bit for bit what quantizing the stored
bf16 intermediate in a kernel of its own gives, without that kernel's launch and read. The history of these
choices is in docs/PERF-NOTES.md.
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import _runtime
from ...dispatch import DispatchPlan
from ...formats import MXFP4
from ..fp8.quantize import quantize_rows_into, quantized_rows
from .ws import PRODUCER_REGS, Launch, _exponent_words, gluon, widths_fit

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..gluon_common import e4m3, row_inverse, scale_of, swiglu, tma_load, word_position
    from .ws import _program

BLOCK_K = 128  # one activation scale and one int32 of weight exponents per row and step
BLOCK_N = 128  # weight rows a program: GEMM2's output columns, or GEMM1's 64 gate and 64 up rows
FLUSH_BELOW = -5  # a group whose exponent is more than 11 under its row's largest is flushed (SPEC §6)
BLOCK_M = 128  # the plan's tile height W4A8 runs on (LAUNCH), at every token count
# Steps the transform unpacks between two fences (``_transform``'s loop is written for two): each fence (a CTA-wide
# memory barrier in SASS) and barrier of the warp group then serves two tiles, 1.3-2.2% faster than one a step at
# 2,560-8,192 tokens (H200, 2026-12-02). scripts/sass.py counts instructions per weight by it.
TRANSFORM_STEPS = 2


# As ws.LAUNCH: maxnreg is the transform's (the default partition), the producer warp takes PRODUCER_REGS.
LAUNCH = {BLOCK_M: Launch(maxnreg=128, consumer_regs=184, stages=4)}


# The e4m3 bytes of the magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6) of codes 0..3 and 4..7 (a byte permute's two
# source registers), what 2^d adds to each (8d to the exponent field of every entry but the zero), and the permute
# selectors that move the signs of codes 0..3 and 4..7 (bit 4j + 3 of a word) to bit 7 of byte j from the word
# and the word shifted left by 4.
E4M3_TABLE = (0x3C383000, 0x4C484440)
E4M3_STEP = (0x08080800, 0x08080808)
SIGN_SELECTORS = (0x1504, 0x3726)


def _e4m3_asm() -> str:
    """PTX that unpacks one word of packed codes (``$2``: weights k..k+7 of a row, weight k + j in bits 4j..4j+3)
    into e4m3 bytes scaled by 2^d (``$3``: the group's exponent less its row's base, SPEC §6), weights k..k+3 into
    ``$0`` and k+4..k+7 into ``$1``, in order.

    A byte permute looks each code's magnitude up in an eight-entry table of e4m3 bytes (``E4M3_TABLE``) times 2^d:
    for -5 <= d <= 6 every entry but the zero is a normal whose exponent field is the d = 0 entry's plus d, so one
    multiply-add per half builds the table (every byte stays within 0x08..0x7C: no carries or borrows); a lower d
    flushes the group (a zero table). A permute reads only its selector's low 16 bits, so one mask of the magnitudes
    serves both halves (the high half shifted down). Two more permutes, of the word and of the word shifted by 4,
    gather the signs (bit 3 of each code) into bit 7 of each byte (``SIGN_SELECTORS``)."""
    return f"""
{{
.reg .b32 t0, t1, q0, q1, w4, s0, s1;
.reg .pred flush;
mad.lo.s32 t0, $3, {E4M3_STEP[0]:#x}, {E4M3_TABLE[0]:#x};
mad.lo.s32 t1, $3, {E4M3_STEP[1]:#x}, {E4M3_TABLE[1]:#x};
setp.lt.s32 flush, $3, {FLUSH_BELOW};
selp.b32 t0, 0, t0, flush;
selp.b32 t1, 0, t1, flush;
and.b32 q0, $2, 0x77777777;
shr.b32 q1, q0, 16;
prmt.b32 q0, t0, t1, q0;
prmt.b32 q1, t0, t1, q1;
shl.b32 w4, $2, 4;
prmt.b32 s0, $2, w4, {SIGN_SELECTORS[0]:#x};
prmt.b32 s1, $2, w4, {SIGN_SELECTORS[1]:#x};
and.b32 s0, s0, 0x80808080;
and.b32 s1, s1, 0x80808080;
or.b32 $0, q0, s0;
or.b32 $1, q1, s1;
}}
"""


if gluon is not None:
    _E4M3: gl.constexpr = gl.constexpr(_e4m3_asm())
    _BK: gl.constexpr = gl.constexpr(BLOCK_K)
    _BN: gl.constexpr = gl.constexpr(BLOCK_N)

    # The transform's threads: one weight row each, its 64 bytes of a step in registers (a word's four bytes in
    # four consecutive ones, which the inline assembly takes packed as one register).
    ROW_LAYOUT = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32]],
        lane_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]], warp_bases=[[32, 0], [64, 0]], block_bases=[],
        shape=[BLOCK_N, BLOCK_K // 2])

    # The row-maximum pass's view of the exponent words: a thread's row, four consecutive words (one 16-byte load).
    QUAD_LAYOUT = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2]], lane_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]],
        warp_bases=[[32, 0], [64, 0]], block_bases=[], shape=[BLOCK_N, 4])

    @gluon.jit
    def _byte_max(word):
        """The largest of each int32's four bytes."""
        return gl.maximum(gl.maximum(word & 0xFF, (word >> 8) & 0xFF),
                          gl.maximum((word >> 16) & 0xFF, (word >> 24) & 0xFF))

    @gluon.jit
    def _scale_rows(rows, s_row0, s_row1):
        """The exponent rows of an item's 128 weight rows ``rows``: its first box's 64 from ``s_row0``, its
        second's from ``s_row1``."""
        return gl.where(rows < _BN // 2, s_row0 + rows, s_row1 + rows - _BN // 2)

    @gluon.jit
    def _row_top(s_ptr, s_ptrs, s_row0, s_row1, stride_sn, k_steps, QUADS: gl.constexpr):
        """Each of the item's 128 weight rows' largest exponent, in ``ROW_LAYOUT``'s rows (``s_ptrs``: their first
        words): with ``QUADS`` (k_steps a multiple of 4) four words a load, a row's 16 contiguous bytes, so a warp's
        load takes 32 sectors for 128 words instead of 32 words."""
        if QUADS:
            QL: gl.constexpr = QUAD_LAYOUT
            s_rows = _scale_rows(gl.arange(0, _BN, layout=gl.SliceLayout(1, QL)), s_row0, s_row1)
            ptrs = (gl.expand_dims(s_ptr + s_rows.to(gl.int64) * stride_sn, 1)
                    + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, QL)), 0))
            top4 = gl.zeros([_BN, 4], gl.int32, QL)
            for i in range(0, k_steps, 4):
                top4 = gl.maximum(top4, _byte_max(gl.load(ptrs + i)))
            return gl.convert_layout(gl.max(top4, axis=1), gl.SliceLayout(1, ROW_LAYOUT))
        else:
            top = gl.zeros([_BN], gl.int32, gl.SliceLayout(1, ROW_LAYOUT))
            for i in range(k_steps):
                top = gl.maximum(top, _byte_max(gl.load(s_ptrs + i)))
            return top

    @gluon.jit
    def _item_count(items, G: gl.constexpr):
        """How many of the ``items`` this program takes: groups of G consecutive items (G divides ``items``), groups
        ``program_id, program_id + num_programs, ...``."""
        groups = gl.cdiv(items // G - gl.program_id(0), gl.num_programs(0))
        return G * gl.maximum(groups, 0)

    @gluon.jit
    def _nth_item(n, G: gl.constexpr):
        """The program's ``n``-th item (see ``_item_count``)."""
        return (gl.program_id(0) + (n // G) * gl.num_programs(0)) * G + n % G

    @gluon.jit
    def _item(item, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, N, GEMM1: gl.constexpr,
              G: gl.constexpr):
        """Work item ``item``: its expert (-1: an unused tile, nothing to do), the first weight rows of its two
        64-row boxes, its first activation row, its expert's end and its first output column. A group of G items
        covers 128 output columns."""
        cols: gl.constexpr = _BN // G
        expert, col_block, row_start, row_end = _program(item, tile_expert_ptr, tile_row_start_ptr,
                                                         expert_offsets_ptr, N, cols)
        if GEMM1:
            w_row0 = expert * 2 * N + col_block * cols  # gate rows; the up rows are N further
            w_row1 = w_row0 + N
        else:
            w_row0 = expert * N + col_block * cols
            w_row1 = w_row0 + _BN // 2
        return expert, w_row0, w_row1, row_start, row_end, col_block * cols

    @gluon.jit
    def _produce(w_desc, a_desc, w_smem, a_smem, ready, empty, tile_expert_ptr, tile_row_start_ptr,
                 expert_offsets_ptr, N, items, k_steps, GEMM1: gl.constexpr, G: gl.constexpr, STAGES: gl.constexpr):
        """Per step of each of the program's items: the item's weight rows (two boxes of 64) and its tile's
        activation rows into the next slot of the ring (``step``: the program's steps so far)."""
        half: gl.constexpr = _BN // 2
        done = 0
        for n in range(_item_count(items, G)):
            expert, w_row0, w_row1, a_row, _, _ = _item(_nth_item(n, G), tile_expert_ptr, tile_row_start_ptr,
                                                         expert_offsets_ptr, N, GEMM1, G)
            if expert >= 0:
                for i in range(k_steps):
                    step = done * k_steps + i
                    s = step % STAGES
                    mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)  # the first lap finds them free
                    mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes + a_desc.block_type.nbytes)
                    tma_load(w_desc, [w_row0, i * (_BK // 2)], ready.index(s), w_smem.index(s).slice(0, half))
                    tma_load(w_desc, [w_row1, i * (_BK // 2)], ready.index(s), w_smem.index(s).slice(half, half))
                    tma_load(a_desc, [a_row, i * _BK], ready.index(s), a_smem.index(s))
                done += 1

    @gluon.jit
    def _unpack(w_smem, u_smem, ready, s, phase, d):
        """Slot ``s``'s words, once its loads have landed (``phase``), unpacked into its e4m3 tile (``d``: each
        byte's group exponent less its row's base)."""
        mbarrier.wait(ready.index(s), phase)
        codes = w_smem.index(s).load(ROW_LAYOUT)
        lo, hi = gl.inline_asm_elementwise(_E4M3, "=r,=r,r,r,r,r,r", [codes, d],
                                           dtype=(gl.float8e4nv,) * 2, is_pure=True, pack=4)
        # Byte i of word w = 4g + t is weight 8w + i (lo) or 8w + 4 + i (hi), at K position 32g + 4t + i (lo) or
        # 32g + 16 + 4t + i (hi): word order (``gluon_common.word_position``), as the activations are laid out.
        # A thread's row stays 128 contiguous bytes: whole registers move, no bytes.
        w = gl.join(lo, hi).reshape(_BN, _BK // 32, 4, 4, 2).permute(0, 1, 4, 2, 3).reshape(_BN, _BK)
        u_smem.index(s).store(w)

    @gluon.jit
    def _offsets(word, shift, base):
        """Each byte's group exponent, of a row's exponent ``word`` for one step, less the row's ``base``."""
        return ((gl.expand_dims(word, 1) >> shift) & 0xFF) - base

    @gluon.jit
    def _transform(w_smem, u_smem, f_smem, f_free, ready, unpacked, s_ptr, stride_sn, tile_expert_ptr,
                   tile_row_start_ptr, expert_offsets_ptr, N, items, k_steps, GEMM1: gl.constexpr,
                   G: gl.constexpr, STAGES: gl.constexpr, QUADS: gl.constexpr):
        """Per step: the words of the step's slot unpacked into its e4m3 tile ``u_smem`` [128 rows, 128] (K in
        order). A row's groups are scaled by 2^(e - base), base = max(the row's largest exponent - 6, 1), which
        puts its largest at 2^6 (e4m3 up to 384); 2^(base - 127), the row's scale, goes to ``f_smem`` once an
        item, alternating between two buffers (``f_free``: both consumers have read the item two before's)."""
        RL: gl.constexpr = ROW_LAYOUT
        rows = gl.arange(0, _BN, layout=gl.SliceLayout(1, RL))
        byte = gl.arange(0, _BK // 2, layout=gl.SliceLayout(0, RL))
        shift = gl.expand_dims((byte // 16) * 8, 0)  # byte c of a row's step is in group c / 16
        done = 0  # the program's items so far
        for n in range(_item_count(items, G)):
            expert, s_row0, s_row1, _, _, _ = _item(_nth_item(n, G), tile_expert_ptr, tile_row_start_ptr,
                                                    expert_offsets_ptr, N, GEMM1, G)
            if expert >= 0:
                s_ptrs = s_ptr + _scale_rows(rows, s_row0, s_row1).to(gl.int64) * stride_sn
                top = _row_top(s_ptr, s_ptrs, s_row0, s_row1, stride_sn, k_steps, QUADS)  # over all the row's groups
                base = gl.expand_dims(gl.maximum(top - 6, 1), 1)
                mbarrier.wait(f_free.index(done % 2), ((done // 2) & 1) ^ 1)
                f_smem.index(done % 2).store((gl.maximum(top - 6, 1) << 23).to(gl.float32, bitcast=True))
                # TRANSFORM_STEPS steps an iteration, one fence for both; an odd last step alone.
                first = done * k_steps
                exponents = gl.load(s_ptrs)
                later = gl.load(s_ptrs + gl.minimum(1, k_steps - 1))
                for j in range(k_steps // 2):
                    d0 = _offsets(exponents, shift, base)
                    d1 = _offsets(later, shift, base)
                    exponents = gl.load(s_ptrs + gl.minimum(2 * j + 2, k_steps - 1))
                    later = gl.load(s_ptrs + gl.minimum(2 * j + 3, k_steps - 1))
                    s0 = (first + 2 * j) % STAGES
                    s1 = (first + 2 * j + 1) % STAGES
                    _unpack(w_smem, u_smem, ready, s0, ((first + 2 * j) // STAGES) & 1, d0)
                    _unpack(w_smem, u_smem, ready, s1, ((first + 2 * j + 1) // STAGES) & 1, d1)
                    fence_async_shared()  # the wgmmas read the tiles through the async proxy
                    # The slots' words were read before these arrivals, and the consumers free them only after.
                    mbarrier.arrive(unpacked.index(s0))
                    mbarrier.arrive(unpacked.index(s1))
                if k_steps % 2:
                    step = first + k_steps - 1
                    _unpack(w_smem, u_smem, ready, step % STAGES, (step // STAGES) & 1,
                            _offsets(exponents, shift, base))
                    fence_async_shared()
                    mbarrier.arrive(unpacked.index(step % STAGES))
                done += 1

    @gluon.jit
    def _consume(a_smem, u_smem, ready, unpacked, empty, as_ptr, stride_am, stride_ag, row0, num_rows, k_steps,
                 first, PART: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr):
        """Consumer ``PART``'s 64 activation rows (from ``row0``) times the item's 128 weight rows: ``acc``
        [64, 128], each step's product (a fresh accumulator) added times the rows' activation scales of the step.
        ``first``: the program's steps before this item (each partition derives its ring position from the items it
        has done, so no count is carried through the item loop)."""
        m = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        as_ptrs = as_ptr + gl.minimum(m, num_rows - 1).to(gl.int64) * stride_am  # rows past the plan: never stored
        part_rows: gl.constexpr = 64
        acc = gl.zeros([part_rows, _BN], gl.float32, MMA)
        next_scale = gl.load(as_ptrs)
        for i in range(k_steps):
            step = first + i
            s = step % STAGES
            a_scale = next_scale
            next_scale = gl.load(as_ptrs + gl.minimum(i + 1, k_steps - 1) * stride_ag)
            mbarrier.wait(ready.index(s), (step // STAGES) & 1)
            mbarrier.wait(unpacked.index(s), (step // STAGES) & 1)
            a = a_smem.index(s).slice(PART * part_rows, part_rows)  # this consumer's half of the tile
            part = warpgroup_mma(a, u_smem.index(s).permute((1, 0)), acc, use_acc=False, is_async=True)
            part = warpgroup_mma_wait(0, deps=[part])
            mbarrier.arrive(empty.index(s))
            acc += part * gl.expand_dims(a_scale, 1)
        return acc

    @gluon.jit
    def _store(values, out_ptr, row0, row_end, col0, stride_om, WORDS: gl.constexpr = False):
        """``out[row0 + i, col0 + j] = values[i, j]`` for the rows before ``row_end`` (the expert's); with
        ``WORDS`` column col0 + j at its word position (``gluon_common.word_position``: GEMM2's K order)."""
        if WORDS:
            # A thread holds columns 2c and 2c + 1, which word order keeps side by side: one 2-byte store a pair
            # (through permuted addresses the compiler would store each byte on its own).
            lo, hi = values.to(gl.int8, bitcast=True).reshape(values.shape[0], values.shape[1] // 2, 2).split()
            pairs = (hi.to(gl.int16) << 8) | (lo.to(gl.int16) & 0xFF)
            m = row0 + gl.arange(0, pairs.shape[0], layout=gl.SliceLayout(1, pairs.type.layout))
            n = word_position(col0 + 2 * gl.arange(0, pairs.shape[1], layout=gl.SliceLayout(0, pairs.type.layout)))
            ptrs = (out_ptr.to(gl.pointer_type(gl.int16), bitcast=True)
                    + gl.expand_dims(m.to(gl.int64) * (stride_om // 2), 1) + gl.expand_dims(n // 2, 0))
            gl.store(ptrs, pairs, mask=gl.expand_dims(m < row_end, 1) & gl.expand_dims(n >= 0, 0))
        else:
            m = row0 + gl.arange(0, values.shape[0], layout=gl.SliceLayout(1, values.type.layout))
            n = col0 + gl.arange(0, values.shape[1], layout=gl.SliceLayout(0, values.type.layout))
            ptrs = out_ptr + gl.expand_dims(m.to(gl.int64) * stride_om, 1) + gl.expand_dims(n, 0)
            gl.store(ptrs, values, mask=gl.expand_dims(m < row_end, 1) & gl.expand_dims(n >= 0, 0))

    @gluon.jit
    def _store_quantized(left, right, q_ptr, qs_ptr, row0, row_end, col0, stride_qm, stride_qg):
        """GEMM1's intermediate columns ``col0 ..`` + 128 of rows ``row0 ..`` (``left`` and ``right``: 64 columns
        each, bf16) quantized as ``fp8.quantize._quantize`` quantizes stored rows (SPEC §5, same bits):
        the values into ``q_ptr`` (e4m3, in word order: GEMM2's K order), each row's scale into ``qs_ptr`` at group
        ``col0 / 128`` (step-major: a group's rows contiguous, ``stride_qg`` apart)."""
        layout: gl.constexpr = left.type.layout
        left, right = left.to(gl.float32), right.to(gl.float32)
        inverse, amax = row_inverse(left, right, 1)
        _store(e4m3(left * inverse), q_ptr, row0, row_end, col0, stride_qm, True)
        _store(e4m3(right * inverse), q_ptr, row0, row_end, col0 + 64, stride_qm, True)
        m = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        scale = scale_of(amax)
        gl.store(qs_ptr + m.to(gl.int64) + (col0 // 128) * stride_qg, scale, mask=m < row_end)

    @gluon.jit
    def _consumer(a_smem, u_smem, f_smem, f_free, ready, unpacked, empty, halves, as_ptr, out_ptr, os_ptr,
                  stride_am, stride_ag, stride_om, stride_og, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                  N, items, num_rows, k_steps, limit, GEMM1: gl.constexpr, G: gl.constexpr,
                  HAS_LIMIT: gl.constexpr, PART: gl.constexpr, STAGES: gl.constexpr, MMA: gl.constexpr):
        """Consumer ``PART``, per item: its 64 rows of GEMM2's output (bf16), or of GEMM1's intermediate, SwiGLU of
        the accumulator's gate half (columns 0..63) and up half (64..127) as ``common._swiglu``, rounded to bf16 and
        quantized per 128 columns into ``out_ptr`` (e4m3) and ``os_ptr`` (scales): the first of an item pair's two
        64-column halves waits in ``halves`` for the second."""
        done = 0
        for n in range(_item_count(items, G)):
            expert, _, _, row_start, row_end, col0 = _item(_nth_item(n, G), tile_expert_ptr, tile_row_start_ptr,
                                                           expert_offsets_ptr, N, GEMM1, G)
            if expert >= 0:
                row0 = row_start + PART * 64
                acc = _consume(a_smem, u_smem, ready, unpacked, empty, as_ptr, stride_am, stride_ag, row0,
                               num_rows, k_steps, done * k_steps, PART, STAGES, MMA)
                # The weight rows' scales, written before the item's first tile was unpacked.
                f = f_smem.index(done % 2).load(gl.SliceLayout(0, MMA))
                mbarrier.arrive(f_free.index(done % 2))
                acc = acc * gl.expand_dims(f, 0)
                if GEMM1:
                    gate, up = acc.reshape(64, 2, _BN // 2).permute(0, 2, 1).split()
                    act = swiglu(gate, up, limit, HAS_LIMIT).to(gl.bfloat16)
                    # Each thread reads back what it wrote, where it wrote it: no barrier.
                    if n % G == 0:
                        halves.index(PART).store(act)
                    else:
                        _store_quantized(halves.index(PART).load(act.type.layout), act, out_ptr, os_ptr, row0,
                                         row_end, col0 - 64, stride_om, stride_og)
                else:
                    _store(acc.to(gl.bfloat16), out_ptr, row0, row_end, col0, stride_om)
                done += 1

    @gluon.jit(do_not_specialize=["items", "num_rows"])  # they vary with the token count: one variant for all
    def _w4a8_kernel(w_desc, a_desc, s_ptr, as_ptr, out_ptr, os_ptr, tile_expert_ptr, tile_row_start_ptr,
                     expert_offsets_ptr, N, K, items, num_rows, stride_sn, stride_am, stride_ag, stride_om, stride_og,
                     limit,
                     GEMM1: gl.constexpr, G: gl.constexpr, HAS_LIMIT: gl.constexpr, STAGES: gl.constexpr,
                     PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, QUADS: gl.constexpr):
        """GEMM1 (``GEMM1``: out = the intermediate [rows, N] quantized, e4m3 values and ``os_ptr`` [rows, N/128]
        step-major scales, of SwiGLU of the gate rows n and up rows N + n, 64 columns an item; K = H) or GEMM2
        (out [rows, N] in bf16, 128 columns an item; K = I), on the quantized activation rows (``a_desc``, scales
        ``as_ptr`` [rows, K/128], step-major) of 128-row tiles. Persistent: the program takes the ``items`` (tiles
        x column blocks) in groups of G consecutive ones (``item_group``), groups ``program_id, program_id +
        num_programs, ...`` (``_item_count``, ``_nth_item``), and its ring runs on across them, so one item's first
        loads and unpacking overlap the previous item's last MMAs and stores."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, _BN, 32])
        w_smem = gl.allocate_shared_memory(gl.int8, [STAGES, _BN, _BK // 2], w_desc.layout)
        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, _BK], a_desc.layout)
        u_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BN, _BK], gl.float8e4nv)
        u_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, _BN, _BK], u_layout)
        f_smem = gl.allocate_shared_memory(gl.float32, [2, _BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        unpacked = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        f_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        # Each consumer's first half of GEMM1's item pairs (GEMM2 never touches it: the compiler drops it there).
        # Written and read with stmatrix / ldmatrix (8 rows' 16 bytes a matrix): rows 128 bytes apart share their
        # banks unless each row's 16-byte units are XORed with the row (8 wavefronts a matrix to 1).
        halves = gl.allocate_shared_memory(gl.bfloat16, [2, 64, _BN // 2], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(unpacked.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # both consumers, once their wgmmas have read the slot
        for s in gl.static_range(2):
            mbarrier.init(f_free.index(s), count=2)  # both consumers, once they have read the scales
        k_steps = K // _BK
        gl.warp_specialize([
            (_transform, (w_smem, u_smem, f_smem, f_free, ready, unpacked, s_ptr, stride_sn, tile_expert_ptr,
                          tile_row_start_ptr, expert_offsets_ptr, N, items, k_steps, GEMM1, G, STAGES, QUADS)),
            (_produce, (w_desc, a_desc, w_smem, a_smem, ready, empty, tile_expert_ptr, tile_row_start_ptr,
                        expert_offsets_ptr, N, items, k_steps, GEMM1, G, STAGES)),
            (_consumer, (a_smem, u_smem, f_smem, f_free, ready, unpacked, empty, halves, as_ptr, out_ptr, os_ptr,
                         stride_am, stride_ag, stride_om, stride_og, tile_expert_ptr, tile_row_start_ptr,
                         expert_offsets_ptr, N, items, num_rows, k_steps, limit, GEMM1, G, HAS_LIMIT, 0, STAGES, MMA)),
            (_consumer, (a_smem, u_smem, f_smem, f_free, ready, unpacked, empty, halves, as_ptr, out_ptr, os_ptr,
                         stride_am, stride_ag, stride_om, stride_og, tile_expert_ptr, tile_row_start_ptr,
                         expert_offsets_ptr, N, items, num_rows, k_steps, limit, GEMM1, G, HAS_LIMIT, 1, STAGES, MMA)),
        ], [1, 4, 4], [PRODUCER_REGS, CONSUMER_REGS, CONSUMER_REGS])


def item_group(gemm1: bool) -> int:
    """How many consecutive work items a program takes together: GEMM1's come in pairs (the two 64-column halves
    of a 128-column block of the intermediate, which the second quantizes whole), GEMM2's one by one."""
    return 2 if gemm1 else 1


def fits(block_m: int, hidden_size: int, width: int) -> bool:
    """Whether the W4A8 kernels take experts of these shapes (on Hopper, where ``ws.ws_eligible`` holds,
    which they need too): tiles of a height in ``LAUNCH``, H and I multiples of 128. They run where the caller asks
    for fp8 activations (``moe_experts(activation_quant="fp8")``), at every token count: never chosen by size, so
    a token's numerics do not depend on its batch."""
    return block_m in LAUNCH and widths_fit(hidden_size, width)


def experts_mxfp4_w4a8(
    hidden: torch.Tensor,
    gate_up: MXFP4,
    down: MXFP4,
    plan: DispatchPlan,
    out: torch.Tensor,
    swiglu_limit: Optional[float] = None,
) -> None:
    """Quantize GEMM1's rows, GEMM1 + SwiGLU (which quantizes the intermediate), GEMM2, into ``out``. Call only
    where :func:`fits` and ``ws.ws_eligible`` hold."""
    num_tiles = plan.tile_expert.numel()
    width, hidden_size = down.shape[2], hidden.shape[1]
    if num_tiles == 0:
        return
    shape = LAUNCH[plan.block_m]
    consts = {"STAGES": shape.stages, "PRODUCER_REGS": PRODUCER_REGS, "CONSUMER_REGS": shape.consumer_regs,
              "num_warps": 4, "maxnreg": shape.maxnreg}
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N // 2, BLOCK_K // 2], gl.int8)
    a_layout = gl.NVMMASharedLayout.get_default_for([plan.block_m, BLOCK_K], gl.float8e4nv)
    # Scales step-major: a consumer reads one step's scales for its 64 rows, contiguous so (16 rows a warp in 2
    # sectors, where a row-major layout took a sector a row: 35 M of GEMM1's 105 M global sectors at 4,096 tokens)
    rows, row_scales = quantized_rows(plan, hidden_size, hidden.device, step_major=True)
    quantize_rows_into(hidden, rows, row_scales, plan, gather=True, word_order=True)
    inter, inter_scales = quantized_rows(plan, width, hidden.device, step_major=True)  # GEMM1 writes both
    programs = _runtime.sm_count(hidden.device)  # one an SM (shared memory)
    for gemm1, weight, (source, source_scales), dest, dest_scales, n, k in (
            (True, gate_up, (rows, row_scales), inter, inter_scales, width, hidden_size),
            (False, down, (inter, inter_scales), out, out, hidden_size, width)):
        E, N, half_k = weight.values.shape
        w_desc = TensorDescriptor.from_tensor(weight.values.view(torch.int8).reshape(E * N, half_k),
                                              [BLOCK_N // 2, BLOCK_K // 2], w_layout)
        a_desc = TensorDescriptor.from_tensor(source, [plan.block_m, BLOCK_K], a_layout)
        exponents = _exponent_words(weight.scales)  # one word a row and step
        group = item_group(gemm1)
        items = num_tiles * (n // BLOCK_N) * group
        _w4a8_kernel[(min(items // group, programs),)](
            w_desc, a_desc, exponents, source_scales, dest, dest_scales, plan.tile_expert, plan.tile_row_start,
            plan.expert_offsets, n, k, items, plan.num_rows, exponents.stride(0), source_scales.stride(0),
            source_scales.stride(1), dest.stride(0), dest_scales.stride(1),
            0.0 if swiglu_limit is None else float(swiglu_limit), GEMM1=gemm1, G=group,
            HAS_LIMIT=swiglu_limit is not None, QUADS=k // BLOCK_K % 4 == 0, **consts)
