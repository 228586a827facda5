"""Persistent, warp-specialized grouped GEMMs for prefill on Hopper, in Gluon (sm_90 only; the ``tl`` kernels run
elsewhere and below ``BLOCK_M``-row tiles). The fp8 ones run by default where they are faster: where the GPU's tile
table gives fp8 experts 128-row plans (without a table, from ``FP8_MIN_TOKENS``); the 16-bit ones are opt-in
(``persistent="all"``, ``MOEFUSE_PERSISTENT=1``; ``_runtime.persistent_enabled``).

Same contract and numerics as ``bf16.py``'s GEMM1 + SwiGLU and GEMM2 (SPEC §3-4: fp32 sums of 16-bit products,
SwiGLU in fp32, the intermediate rounded to the activations' dtype), and on fp8 block-scale weights as
``fp8/kernels.py``'s (SPEC §5: 128-deep steps, each box's product promoted into fp32 times the rows' activation
scales and its weight-block scale; GEMM1 quantizes the intermediate per row and 128 columns, from fp32). What
differs is the structure, which keeps every SM busy under ragged routing. Words used below: a work *item* is one
plan tile (``BLOCK_M`` rows of one expert) times one column block; a *box* is the block one TMA load copies into
shared memory (64 activation rows or 128 weight rows of one K step); a *slot* is one stage of the shared-memory
ring the loads fill, with a ``ready`` barrier (its bytes have landed) and an ``empty`` one (both consumers are done
with it).

- one program per SM, claiming items from a counter as it frees up (``dynamic``: ragged routing makes items'
  costs uneven, and taking every grid-th item left programs idle at the end). Items go tile by tile, so the
  programs running at once share a few tiles' activation rows and, where an expert has several tiles, its weight
  boxes through L2. ``launch`` also takes the static schedule and one item a program, for comparison;
- a producer warp that streams each step of the item's activation rows (two 64-row boxes) and its two 128-row
  weight boxes through TMA into the next slot, running ahead across items (it fills the next item's steps while
  the consumers finish the last one's epilogue);
- two 4-warp consumers (one warp group each), one per 64-row half of the tile, each against both weight boxes: per
  step they wait for the slot, issue their wgmmas (A and B from shared memory), keep that step in flight while
  waiting for the one before, and free its slot. A half that lies wholly past its expert's end (a tile's remainder
  of at most 64 rows) issues no wgmma: ragged routing leaves about one such remainder per expert, and on
  full-height MMAs they cost more tensor-core time than the weights' stream leaves to spare.

GEMM1's boxes are the gate and the up rows of the item's 128 intermediate columns, so SwiGLU is elementwise on a
pair of accumulators; GEMM2's are its 256 output columns, two 128-column halves. The 16-bit consumers multiply a
whole box at once (GEMM1: 64 x 128 wgmmas, gate and up; GEMM2: 64 x 256 over both boxes); the fp8 ones a 64-row
half of a box at a time, each promoted on its own (a 64 x 128 product promoted a box at a time is slower, and a
larger one does not fit their registers beside the accumulators). GEMM1 reads the plan's rows of ``hidden``
gathered into plan order first (TMA reads contiguous rows; Hopper's TMA has no row gather). The measurements
behind these choices are in docs/PERF-NOTES.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import _runtime
from .._runtime import GPU
from ..dispatch import DispatchPlan
from ..formats import BlockFP8
from .common import gather_rows
from .fp8.quantize import quantize_rows_into, quantized_rows

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon_common import e4m3, row_inverse, scale_of, swiglu, tma_load
except ImportError:  # pragma: no cover - every supported Triton has it
    gluon = None

BLOCK_M = 128  # rows per item: the plan's tile height at prefill
BLOCK_K = 64  # 128 bytes of 16-bit values: one swizzled box row
FP8_BLOCK_K = 128  # fp8 steps: one activation scale and one weight-block scale a row and step (SPEC §5)
BOX = 128  # weight rows per TMA box: GEMM1's gate or up rows of an item, half of GEMM2's output columns
STAGES = 4  # ring slots: 48 KB each (two 8 KB activation boxes, two 16 KB weight boxes)
MAXNREG = 168  # registers a thread at launch: 12 warps in an SM's 64K
PRODUCER_REGS = 40  # after the hand-over (setmaxnreg): at 24 Triton 3.6 spills GEMM2's box addresses (8 bytes)
CONSUMER_REGS = 232  # a [64, 256] fp32 accumulator (128 registers) and the epilogue
# fp8: a step's fresh [64, 64] product (32 more registers) beside the four accumulators. Both consumers are workers
# there (the producer takes the default partition): at 232 the consumers spilled 48 bytes (Triton 3.9), at 256 the
# partitions no longer fit an SM's registers (592 bytes of stack), at 240 nothing spills.
FP8_CONSUMER_REGS = 240
# On a GPU without a tile table, fp8 experts take 128-row plans from this many tokens (plan_block_m): on an H200 the
# persistent kernels beat the tl kernels' 64-row plans there (whole stage 0.91x at 2,048 tokens, 0.94x at 4,096 and
# 8,192 on the static schedule), at 1,024 they lose (1.03x; `moefuse bench prefill`, H200, 2026-12-04).
FP8_MIN_TOKENS = 2048
# The dynamic schedule's claims a program keeps: the producer runs at most STAGES items ahead (an item has at least
# one step), so a claim is read before it is written over.
CLAIMS = 2 * STAGES
GEMM1_COLS = BOX  # intermediate columns an item of GEMM1 computes (both consumers)
GEMM2_COLS = 2 * BOX  # output columns an item of GEMM2 computes

if gluon is not None:
    _BK: gl.constexpr = gl.constexpr(BLOCK_K)
    _BOX: gl.constexpr = gl.constexpr(BOX)
    _HALF: gl.constexpr = gl.constexpr(BLOCK_M // 2)  # a consumer's rows: one wgmma M
    _BK8: gl.constexpr = gl.constexpr(FP8_BLOCK_K)
    _CLAIMS: gl.constexpr = gl.constexpr(CLAIMS)

    @gluon.jit
    def _item(item, col_blocks, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr):
        """Work item ``item`` (tile-major: tile ``item // col_blocks``, column block ``item % col_blocks``): its
        expert (-1: an unused tile), column block, first row and its expert's end."""
        tile = item // col_blocks
        block = item % col_blocks
        expert = gl.load(tile_expert_ptr + tile)
        row_start = gl.load(tile_row_start_ptr + tile)
        row_end = gl.load(expert_offsets_ptr + gl.maximum(expert, 0) + 1)
        return expert, block, row_start, row_end

    @gluon.jit
    def _produce_item(a_desc, w_desc, a_smem, w_smem, ready, empty, i, w_row, row_start, box_stride, k_steps,
                      claim_ptr, item, BK: gl.constexpr, STAGES: gl.constexpr, DYNAMIC: gl.constexpr):
        """One item's steps into the ring from position ``i`` (returned past them). ``DYNAMIC``: the item's number
        goes to ``claim_ptr`` once its first slot is free, before that slot's barrier is armed (the arrive
        releases it to the consumers, whose wait acquires it)."""
        for k in range(k_steps):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # the first lap finds every slot free
            if DYNAMIC:
                if k == 0:
                    gl.store(claim_ptr, item)
            mbarrier.expect(ready.index(s), 2 * a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes)
            for h in gl.static_range(2):
                tma_load(a_desc, [row_start + h * _HALF, k * BK], ready.index(s), a_smem.index(2 * s + h))
            for b in gl.static_range(2):
                tma_load(w_desc, [w_row + b * box_stride, k * BK], ready.index(s),
                          w_smem.index(s).slice(b * _BOX, _BOX))
            i += 1
        return i

    @gluon.jit
    def _produce(a_desc, w_desc, a_smem, w_smem, ready, empty, tile_expert_ptr, tile_row_start_ptr,
                 expert_offsets_ptr, num_items, col_blocks, rows_per_expert, item_cols, box_stride, k_steps,
                 claims_ptr, counter_ptr, BK: gl.constexpr, STAGES: gl.constexpr, DYNAMIC: gl.constexpr):
        """The producer warp: for every ``BK``-deep step of every item of this program, the tile's two activation
        boxes and the two weight boxes (box b at rows ``item_cols * block + b * box_stride`` of the expert's) into
        slot ``i % STAGES``. Static: items ``pid, pid + grid, ...``. ``DYNAMIC``: each next item claimed from
        ``counter_ptr`` when the last one is issued (as the hardware hands blocks to free SMs), its number passed
        to the consumers through this program's ring of ``CLAIMS`` claims, and past the last item a slot armed with
        no bytes whose claim is ``num_items``: the consumers' end."""
        i = 0
        if DYNAMIC:
            claims = claims_ptr + gl.program_id(0) * _CLAIMS
            j = 0
            item = gl.atomic_add(counter_ptr, 1)
            while item < num_items:
                expert, block, row_start, row_end = _item(item, col_blocks, tile_expert_ptr, tile_row_start_ptr,
                                                          expert_offsets_ptr)
                if expert >= 0:
                    i = _produce_item(a_desc, w_desc, a_smem, w_smem, ready, empty, i,
                                      expert * rows_per_expert + block * item_cols, row_start, box_stride, k_steps,
                                      claims + j % _CLAIMS, item, BK, STAGES, DYNAMIC)
                    j += 1
                item = gl.atomic_add(counter_ptr, 1)
            _end_claim(claims, empty, ready, i, j, num_items, STAGES, _CLAIMS)
        else:
            for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
                expert, block, row_start, row_end = _item(item, col_blocks, tile_expert_ptr, tile_row_start_ptr,
                                                          expert_offsets_ptr)
                if expert >= 0:
                    i = _produce_item(a_desc, w_desc, a_smem, w_smem, ready, empty, i,
                                      expert * rows_per_expert + block * item_cols, row_start, box_stride, k_steps,
                                      claims_ptr, item, BK, STAGES, DYNAMIC)

    @gluon.jit
    def _end_claim(claims, empty, ready, i, j, num_items, STAGES: gl.constexpr, CLAIMS: gl.constexpr):
        """The dynamic schedule's end, past a producer's last item: its ``j``-th claim is ``num_items``, on slot
        ``i % STAGES`` armed with no bytes once it is free (``claims``: this program's ``CLAIMS`` of them)."""
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        gl.store(claims + j % CLAIMS, num_items)
        mbarrier.arrive(ready.index(s))

    @gluon.jit
    def _claimed(claims_ptr, ready, i, j, STAGES: gl.constexpr, CLAIMS: gl.constexpr):
        """A consumer's next item under the dynamic schedule: the claim the producer wrote before arming slot
        ``i % STAGES`` (its ``j``-th of this program's ``CLAIMS``), read once that slot's barrier completes
        (``num_items``: no more)."""
        mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
        return gl.load(claims_ptr + gl.program_id(0) * CLAIMS + j % CLAIMS, volatile=True)

    @gluon.jit
    def _store(acc, out_ptr, row0, row_end, col0, stride_om):
        """``out[row0 + m, col0 + n] = acc[m, n]`` in ``out``'s dtype, for the rows of the expert (``col0`` a
        multiple of 64). Through shared memory into a layout where a thread stores 16 bytes of a row and a warp
        whole 128-byte lines: straight from the MMA layout a thread stores two values at a time and a warp
        instruction 16-byte pieces of 8 rows, 8x the store instructions, each sector written in two halves (fp8
        experts 4-7% slower at 4,096-8,192 tokens, bf16 2-3%; H200, 2026-12-04)."""
        COLS: gl.constexpr = acc.shape[1]
        VEC: gl.constexpr = 128 // out_ptr.dtype.element_ty.primitive_bitwidth  # values in 16 bytes
        ACROSS: gl.constexpr = 64 // VEC  # threads across 64 columns of a row
        OUT: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[32 // ACROSS, ACROSS],
                                             warps_per_cta=[4, 1], order=[1, 0])
        vals = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), OUT)
        m = row0 + gl.arange(0, _HALF, layout=gl.SliceLayout(1, OUT))
        n = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, OUT))
        n = gl.max_contiguous(gl.multiple_of(n, 64), 64)  # col0 is a multiple of 64 whatever the launch knows
        ptrs = out_ptr + gl.expand_dims(m.to(gl.int64) * stride_om, 1) + gl.expand_dims(n, 0)
        gl.store(ptrs, vals, mask=gl.expand_dims(m < row_end, 1))

    @gluon.jit
    def _pass_over(ready, empty, i, k_steps, STAGES: gl.constexpr):
        """An item whose rows for this consumer all lie past the expert's end: wait for each of its steps' slots
        and free them (the other consumer needs them), issuing nothing. Returns the ring position after it."""
        for _k in range(k_steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            mbarrier.arrive(empty.index(s))
            i += 1
        return i

    @gluon.jit
    def _ring(a_desc, w_desc, BK: gl.constexpr, STAGES: gl.constexpr):
        """The slots (the tile's two 64-row activation boxes, and its two 128-row weight boxes side by side, ``BK``
        deep) and their barriers: ``ready`` completes with a slot's bytes, ``empty`` when both consumers have freed
        it."""
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, _HALF, BK], a_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 2 * _BOX, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        return a_smem, w_smem, ready, empty

    @gluon.jit
    def _consume_item(a_smem, w_smem, ready, empty, out_ptr, i, expert, block, row_start, row_end, item_cols,
                      k_steps, stride_om, limit, C: gl.constexpr, GEMM1: gl.constexpr, HAS_LIMIT: gl.constexpr,
                      STAGES: gl.constexpr):
        """Consumer ``C``'s part of one item, its steps from ring position ``i`` (returned past them). GEMM1: the
        gate and the up box each one 64 x 128 wgmma a 16-deep piece; GEMM2: both boxes one 64 x 256 wgmma (four
        64 x 64 ones, one a 64-row half box, were up to 3% slower; H200, 2026-12-04)."""
        row0 = row_start + C * _HALF
        if expert >= 0:
            if row0 < row_end:
                col0 = block * item_cols
                if GEMM1:
                    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                  instr_shape=[16, _BOX, 16])
                    gate = gl.zeros([_HALF, _BOX], gl.float32, MMA)
                    up = gl.zeros([_HALF, _BOX], gl.float32, MMA)
                    for k in range(k_steps):
                        s = i % STAGES
                        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                        a = a_smem.index(2 * s + C)
                        w = w_smem.index(s)
                        gate = warpgroup_mma(a, w.slice(0, _BOX).permute((1, 0)), gate, is_async=True)
                        up = warpgroup_mma(a, w.slice(_BOX, _BOX).permute((1, 0)), up, is_async=True)
                        # This step's wgmmas stay in flight; the step before is done, so its slot is free.
                        gate, up = warpgroup_mma_wait(2, deps=[gate, up])
                        if k > 0:
                            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
                        i += 1
                    gate, up = warpgroup_mma_wait(0, deps=[gate, up])
                    mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
                    _store(swiglu(gate, up, limit, HAS_LIMIT), out_ptr, row0, row_end, col0, stride_om)
                else:
                    WIDE: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                   instr_shape=[16, 2 * _BOX, 16])
                    acc = gl.zeros([_HALF, 2 * _BOX], gl.float32, WIDE)
                    for k in range(k_steps):
                        s = i % STAGES
                        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                        a = a_smem.index(2 * s + C)
                        acc = warpgroup_mma(a, w_smem.index(s).permute((1, 0)), acc, is_async=True)
                        acc = warpgroup_mma_wait(1, deps=[acc])
                        if k > 0:
                            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
                        i += 1
                    acc = warpgroup_mma_wait(0, deps=[acc])
                    mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
                    _store(acc, out_ptr, row0, row_end, col0, stride_om)
            else:
                i = _pass_over(ready, empty, i, k_steps, STAGES)
        return i

    @gluon.jit
    def _consume(a_smem, w_smem, ready, empty, out_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                 num_items, col_blocks, item_cols, k_steps, stride_om, limit, claims_ptr, C: gl.constexpr,
                 GEMM1: gl.constexpr, HAS_LIMIT: gl.constexpr, STAGES: gl.constexpr,
                 DYNAMIC: gl.constexpr):
        """Consumer ``C``: rows ``64 C ..`` of every item against its two weight boxes, in fp32. A consumer whose
        rows all lie past the expert's end (a tile's remainder of at most 64 rows) issues no wgmma for the item:
        it only frees the slots. GEMM1 stores SwiGLU(gate box, up box) at the item's columns; GEMM2 both boxes
        side by side. The items: as the producer takes them."""
        i = 0
        if DYNAMIC:
            j = 0
            item = _claimed(claims_ptr, ready, i, j, STAGES, _CLAIMS)
            while item < num_items:
                expert, block, row_start, row_end = _item(item, col_blocks, tile_expert_ptr, tile_row_start_ptr,
                                                          expert_offsets_ptr)
                i = _consume_item(a_smem, w_smem, ready, empty, out_ptr, i, expert, block, row_start, row_end,
                                  item_cols, k_steps, stride_om, limit, C, GEMM1, HAS_LIMIT, STAGES)
                j += 1
                item = _claimed(claims_ptr, ready, i, j, STAGES, _CLAIMS)
        else:
            for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
                expert, block, row_start, row_end = _item(item, col_blocks, tile_expert_ptr, tile_row_start_ptr,
                                                          expert_offsets_ptr)
                i = _consume_item(a_smem, w_smem, ready, empty, out_ptr, i, expert, block, row_start, row_end,
                                  item_cols, k_steps, stride_om, limit, C, GEMM1, HAS_LIMIT, STAGES)

    # num_items and num_rows follow the token count: left specialized (1, multiples of 16), a token count could need
    # a variant warm-up did not compile
    @gluon.jit(do_not_specialize=["num_items"])
    def _persistent_kernel(a_desc, w_desc, out_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                           num_items, col_blocks, rows_per_expert, item_cols, box_stride, K, stride_om, limit,
                           claims_ptr, counter_ptr, GEMM1: gl.constexpr, HAS_LIMIT: gl.constexpr,
                           STAGES: gl.constexpr, DYNAMIC: gl.constexpr,
                           PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        """GEMM1 + SwiGLU (``GEMM1``: out = intermediate [rows, I], W = gate_up [E·2I, H]) or GEMM2 (out [rows, H],
        W = down [E·H, I]) over the plan's items, this program's share of them."""
        a_smem, w_smem, ready, empty = _ring(a_desc, w_desc, _BK, STAGES)
        k_steps = gl.cdiv(K, _BK)
        gl.warp_specialize([
            (_consume, (a_smem, w_smem, ready, empty, out_ptr, tile_expert_ptr, tile_row_start_ptr,
                        expert_offsets_ptr, num_items, col_blocks, item_cols, k_steps, stride_om, limit, claims_ptr,
                        0, GEMM1, HAS_LIMIT, STAGES, DYNAMIC)),
            (_produce, (a_desc, w_desc, a_smem, w_smem, ready, empty, tile_expert_ptr, tile_row_start_ptr,
                        expert_offsets_ptr, num_items, col_blocks, rows_per_expert, item_cols, box_stride, k_steps,
                        claims_ptr, counter_ptr, _BK, STAGES, DYNAMIC)),
            (_consume, (a_smem, w_smem, ready, empty, out_ptr, tile_expert_ptr, tile_row_start_ptr,
                        expert_offsets_ptr, num_items, col_blocks, item_cols, k_steps, stride_om, limit, claims_ptr,
                        1, GEMM1, HAS_LIMIT, STAGES, DYNAMIC)),
        ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


    @gluon.jit
    def _promote(acc, a, w, scale):
        """``acc + (a @ w^T) · scale[row]``: one 128-deep step of fp8 products into a fresh accumulator, added in
        fp32 times the rows' activation scales and the box's weight-block scale (SPEC §5's promotion)."""
        part = warpgroup_mma(a, w.permute((1, 0)), acc, use_acc=False, is_async=True)
        part = warpgroup_mma_wait(0, deps=[part])
        return acc + part * gl.expand_dims(scale, 1)

    @gluon.jit
    def _consume_fp8_item(a_smem, w_smem, ready, empty, as_ptr, ws_ptr, out_ptr, os_ptr, i, expert, block,
                          row_start, row_end, num_rows, item_cols, box_stride, k_steps, stride_am, stride_ag,
                          stride_se, stride_sn, stride_sk, stride_om, stride_os, limit, C: gl.constexpr,
                          GEMM1: gl.constexpr, HAS_LIMIT: gl.constexpr, STAGES: gl.constexpr):
        """Consumer ``C``'s part of one fp8 item, its steps from ring position ``i`` (returned past them): each
        64-row half of a weight box one 64 x 64 wgmma a 32-deep piece, promoted on its own. (One 64 x 128 wgmma a
        box, promoted a box at a time, made the fp8 experts 4-8% slower at 4,096-8,192 tokens; H200, 2026-12-04.)"""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, _HALF, 32])
        row0 = row_start + C * _HALF
        if expert >= 0:
            if row0 < row_end:
                m = row0 + gl.arange(0, _HALF, layout=gl.SliceLayout(1, MMA))
                as_ptrs = as_ptr + gl.minimum(m, num_rows - 1).to(gl.int64) * stride_am  # past the plan: unstored
                w_row = block * item_cols  # the item's first weight row within the expert's
                # each 64-row half's weight-block scale through a pointer of its own, although both halves of a
                # box lie in one block: with one pointer a box (each half loading the box's scale from it) the
                # consumers spill 8-192 bytes (Triton 3.9)
                ws_expert = ws_ptr + expert.to(gl.int64) * stride_se
                ws0 = ws_expert + (w_row // 128) * stride_sn
                ws1 = ws_expert + ((w_row + _HALF) // 128) * stride_sn
                ws2 = ws_expert + ((w_row + box_stride) // 128) * stride_sn
                ws3 = ws_expert + ((w_row + box_stride + _HALF) // 128) * stride_sn
                # box 0's halves, then box 1's: GEMM1's gate and up rows of columns 0-63 are acc0 and acc2
                acc0 = gl.zeros([_HALF, _HALF], gl.float32, MMA)
                acc1 = gl.zeros([_HALF, _HALF], gl.float32, MMA)
                acc2 = gl.zeros([_HALF, _HALF], gl.float32, MMA)
                acc3 = gl.zeros([_HALF, _HALF], gl.float32, MMA)
                for k in range(k_steps):
                    s = i % STAGES
                    a_scale = gl.load(as_ptrs + k * stride_ag)
                    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                    a = a_smem.index(2 * s + C)
                    w = w_smem.index(s)
                    acc0 = _promote(acc0, a, w.slice(0, _HALF), a_scale * gl.load(ws0 + k * stride_sk))
                    acc1 = _promote(acc1, a, w.slice(_HALF, _HALF), a_scale * gl.load(ws1 + k * stride_sk))
                    acc2 = _promote(acc2, a, w.slice(_BOX, _HALF), a_scale * gl.load(ws2 + k * stride_sk))
                    acc3 = _promote(acc3, a, w.slice(_BOX + _HALF, _HALF), a_scale * gl.load(ws3 + k * stride_sk))
                    mbarrier.arrive(empty.index(s))
                    i += 1
                col0 = block * item_cols
                if GEMM1:
                    act0 = swiglu(acc0, acc2, limit, HAS_LIMIT)
                    act1 = swiglu(acc1, acc3, limit, HAS_LIMIT)
                    inverse, amax = row_inverse(act0, act1, 1)
                    _store(e4m3(act0 * inverse), out_ptr, row0, row_end, col0, stride_om)
                    _store(e4m3(act1 * inverse), out_ptr, row0, row_end, col0 + _HALF, stride_om)
                    gl.store(os_ptr + m.to(gl.int64) * stride_os + block, scale_of(amax), mask=m < row_end)
                else:
                    _store(acc0, out_ptr, row0, row_end, col0, stride_om)
                    _store(acc1, out_ptr, row0, row_end, col0 + _HALF, stride_om)
                    _store(acc2, out_ptr, row0, row_end, col0 + _BOX, stride_om)
                    _store(acc3, out_ptr, row0, row_end, col0 + _BOX + _HALF, stride_om)
            else:
                i = _pass_over(ready, empty, i, k_steps, STAGES)
        return i

    @gluon.jit
    def _consume_fp8(a_smem, w_smem, ready, empty, as_ptr, ws_ptr, out_ptr, os_ptr, tile_expert_ptr,
                     tile_row_start_ptr, expert_offsets_ptr, num_items, col_blocks, num_rows, item_cols, box_stride,
                     k_steps, stride_am, stride_ag, stride_se, stride_sn, stride_sk, stride_om, stride_os, limit,
                     claims_ptr, C: gl.constexpr, GEMM1: gl.constexpr, HAS_LIMIT: gl.constexpr,
                     STAGES: gl.constexpr, DYNAMIC: gl.constexpr):
        """Consumer ``C`` of the fp8 GEMMs (SPEC §5): as :func:`_consume`, with 128-deep steps promoted a 64-row half
        box at a time (:func:`_promote`; each box's 128 rows are one weight block, I and H being multiples of 128).
        GEMM1 quantizes its 128 SwiGLU columns per row from fp32 (as ``fp8.quantize._quantize``) into ``out_ptr``
        (e4m3) and ``os_ptr`` (the scales, group ``block``); GEMM2 stores ``out_ptr``'s dtype."""
        i = 0
        if DYNAMIC:
            j = 0
            item = _claimed(claims_ptr, ready, i, j, STAGES, _CLAIMS)
            while item < num_items:
                expert, block, row_start, row_end = _item(item, col_blocks, tile_expert_ptr, tile_row_start_ptr,
                                                          expert_offsets_ptr)
                i = _consume_fp8_item(a_smem, w_smem, ready, empty, as_ptr, ws_ptr, out_ptr, os_ptr, i, expert,
                                      block, row_start, row_end, num_rows, item_cols, box_stride, k_steps,
                                      stride_am, stride_ag, stride_se, stride_sn, stride_sk, stride_om, stride_os,
                                      limit, C, GEMM1, HAS_LIMIT, STAGES)
                j += 1
                item = _claimed(claims_ptr, ready, i, j, STAGES, _CLAIMS)
        else:
            for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
                expert, block, row_start, row_end = _item(item, col_blocks, tile_expert_ptr, tile_row_start_ptr,
                                                          expert_offsets_ptr)
                i = _consume_fp8_item(a_smem, w_smem, ready, empty, as_ptr, ws_ptr, out_ptr, os_ptr, i, expert,
                                      block, row_start, row_end, num_rows, item_cols, box_stride, k_steps,
                                      stride_am, stride_ag, stride_se, stride_sn, stride_sk, stride_om, stride_os,
                                      limit, C, GEMM1, HAS_LIMIT, STAGES)

    @gluon.jit(do_not_specialize=["num_items", "num_rows"])
    def _persistent_fp8_kernel(a_desc, w_desc, as_ptr, ws_ptr, out_ptr, os_ptr, tile_expert_ptr, tile_row_start_ptr,
                               expert_offsets_ptr, num_items, col_blocks, num_rows, rows_per_expert, item_cols,
                               box_stride, K, stride_am, stride_ag, stride_se, stride_sn, stride_sk, stride_om,
                               stride_os, limit, claims_ptr, counter_ptr, GEMM1: gl.constexpr,
                               HAS_LIMIT: gl.constexpr, STAGES: gl.constexpr,
                               DYNAMIC: gl.constexpr, FP8_CONSUMER_REGS: gl.constexpr):
        """:func:`_persistent_kernel` on fp8 block-scale operands (SPEC §5): e4m3 activation rows with fp32 scales
        per 128 columns (``as_ptr``), e4m3 weights with fp32 scales per 128 x 128 block (``ws_ptr``); GEMM1 writes
        the intermediate quantized (``out_ptr`` e4m3, ``os_ptr`` scales), GEMM2 ``out_ptr`` in the activations'
        dtype."""
        a_smem, w_smem, ready, empty = _ring(a_desc, w_desc, _BK8, STAGES)
        k_steps = gl.cdiv(K, _BK8)
        # The producer is the default partition here (4 warps, one thread issuing), so that both consumers are
        # workers with FP8_CONSUMER_REGS (see there).
        gl.warp_specialize([
            (_produce, (a_desc, w_desc, a_smem, w_smem, ready, empty, tile_expert_ptr, tile_row_start_ptr,
                        expert_offsets_ptr, num_items, col_blocks, rows_per_expert, item_cols, box_stride, k_steps,
                        claims_ptr, counter_ptr, _BK8, STAGES, DYNAMIC)),
            (_consume_fp8, (a_smem, w_smem, ready, empty, as_ptr, ws_ptr, out_ptr, os_ptr, tile_expert_ptr,
                            tile_row_start_ptr, expert_offsets_ptr, num_items, col_blocks, num_rows, item_cols,
                            box_stride, k_steps, stride_am, stride_ag, stride_se, stride_sn, stride_sk,
                            stride_om, stride_os, limit, claims_ptr, 0, GEMM1, HAS_LIMIT, STAGES, DYNAMIC)),
            (_consume_fp8, (a_smem, w_smem, ready, empty, as_ptr, ws_ptr, out_ptr, os_ptr, tile_expert_ptr,
                            tile_row_start_ptr, expert_offsets_ptr, num_items, col_blocks, num_rows, item_cols,
                            box_stride, k_steps, stride_am, stride_ag, stride_se, stride_sn, stride_sk,
                            stride_om, stride_os, limit, claims_ptr, 1, GEMM1, HAS_LIMIT, STAGES, DYNAMIC)),
        ], [4, 4], [FP8_CONSUMER_REGS, FP8_CONSUMER_REGS])

def eligible(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, plan: DispatchPlan,
             out: torch.Tensor) -> bool:
    """Whether :func:`experts_persistent` runs these experts: 16-bit weights and activations of one dtype on an sm_90
    GPU (not the interpreter), the plan's tiles ``BLOCK_M`` rows, I a multiple of 128 and H of 256 (whole items: no
    column masks), K steps whole (H and I multiples of 64 follow), weights TMA can read as [E·N, K] rows, and an
    ``out`` with unit column stride (the epilogue's stores)."""
    return (_runs_here(hidden, gate_up.shape, plan, out) and gate_up.dtype == down.dtype == hidden.dtype
            and gate_up.is_contiguous() and down.is_contiguous())


def _runs_here(hidden: torch.Tensor, gate_up_shape: torch.Size, plan: DispatchPlan, out: torch.Tensor) -> bool:
    """What both weight types need: bf16 or fp16 activations on an sm_90 GPU (not the interpreter), the plan's
    tiles ``BLOCK_M`` rows, whole items of both GEMMs, an ``out`` with unit column stride."""
    return (gluon is not None and hidden.is_cuda and not _runtime.interpreting()
            and hidden.dtype in (torch.bfloat16, torch.float16) and _runtime.capability(hidden.device) == (9, 0)
            and plan.block_m == BLOCK_M and widths_fit(gate_up_shape[2], gate_up_shape[1] // 2)
            and out.stride(1) == 1)


def runs_fp8(hidden_size: int, width: int, gpu: Optional[GPU], persistent: Optional[str] = None) -> bool:
    """Whether fp8 block-scale experts of these widths get the persistent kernels on a ``BLOCK_M``-row plan: on an
    sm_90 ``gpu`` (None: no GPU), their widths whole items, unless ``persistent`` (None: the process default) turns
    them off."""
    return (gluon is not None and _runtime.persistent_enabled(True, persistent) and gpu is not None
            and gpu.capability == (9, 0) and widths_fit(hidden_size, width))


def widths_fit(hidden_size: int, width: int) -> bool:
    """Whether experts of model width H and intermediate width I are whole items of both GEMMs."""
    return width > 0 and width % GEMM1_COLS == 0 and hidden_size % GEMM2_COLS == 0


def _gl_dtype(dtype: torch.dtype):  # noqa: ANN202 (a Gluon dtype)
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


def _descriptors(rows: torch.Tensor, weight: torch.Tensor, block_k: int, dtype: object) -> tuple[object, object]:
    """TMA descriptors of a 64-row half of an item's activation rows ([BLOCK_M / 2, block_k] of ``rows``) and of a
    weight box ([BOX, block_k] of ``weight`` [E, N, K] seen as [E·N, K]), ``dtype`` the Gluon type of both."""
    E, N, K = weight.shape
    layout = gl.NVMMASharedLayout.get_default_for([BOX, block_k], dtype)  # 128-byte rows: one layout for both
    return (TensorDescriptor.from_tensor(rows, [BLOCK_M // 2, block_k], layout),
            TensorDescriptor.from_tensor(weight.view(E * N, K), [BOX, block_k], layout))


@dataclass(frozen=True)
class _Items:
    """One GEMM's work items over a plan and where an item's two weight boxes lie: box b at rows ``cols * block +
    b * box_stride`` of its expert's. GEMM1: the gate and the up rows of the item's 128 intermediate columns (I
    apart); GEMM2: the item's output columns 0-127 and 128-255."""

    cols: int  # output columns an item computes
    col_blocks: int
    count: int
    box_stride: int
    grid: int

    @classmethod
    def of(cls, gemm1: bool, weight_rows: int, plan: DispatchPlan, device: torch.device,
           programs: Optional[int]) -> _Items:
        """``weight_rows``: N of the weight [E, N, K] (2I for GEMM1); ``programs``: as :func:`launch` takes it."""
        width = weight_rows // 2 if gemm1 else weight_rows
        cols = GEMM1_COLS if gemm1 else GEMM2_COLS
        col_blocks = width // cols
        count = plan.tile_expert.numel() * col_blocks
        sms = _runtime.sm_count(device) if count else 1
        grid = max(1, min(count, sms if programs is None else programs))
        return cls(cols, col_blocks, count, width if gemm1 else BOX, grid)


def _schedule(items: _Items, dynamic: bool, plan: DispatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The dynamic schedule's per-program claims and its item counter (zeroed: a memset node under a CUDA graph);
    statically scheduled kernels never touch them (the plan's tile list stands in)."""
    if not dynamic:
        return plan.tile_expert, plan.tile_expert
    device = plan.tile_expert.device
    return (torch.empty(items.grid * CLAIMS, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


def launch(gemm1: bool, rows: torch.Tensor, weight: torch.Tensor, plan: DispatchPlan, out: torch.Tensor,
           swiglu_limit: Optional[float] = None, *, programs: Optional[int] = None, dynamic: bool = True) -> None:
    """One persistent GEMM over the plan's items: GEMM1 + SwiGLU (``rows`` [R, H] in plan order, ``weight``
    gate_up [E, 2I, H], ``out`` the intermediate [R, I]) or GEMM2 (``rows`` the intermediate, ``weight`` down
    [E, H, I], ``out`` [R, H]). ``programs``: the grid (default one program per SM; the item count gives one item a
    program, the non-persistent launch); ``dynamic``: each program claims its next item from a counter when it has
    issued the last one, instead of taking every grid-th (``False``: the static schedule). The defaults are the
    fastest: the dynamic schedule is 2-17% faster than the static one on DeepSeek-V3 experts with random and Zipf
    routing at 2,048-8,192 tokens, up to 2.4% slower only on exactly balanced routing and at 1,024 tokens (H200,
    2026-12-04; docs/PERF-NOTES.md has the table)."""
    E, N, K = weight.shape
    items = _Items.of(gemm1, N, plan, rows.device, programs)
    if items.count == 0:
        return
    a_desc, w_desc = _descriptors(rows, weight, BLOCK_K, _gl_dtype(rows.dtype))
    claims, counter = _schedule(items, dynamic, plan)
    _persistent_kernel[(items.grid,)](
        a_desc, w_desc, out, plan.tile_expert, plan.tile_row_start, plan.expert_offsets,
        items.count, items.col_blocks, N, items.cols, items.box_stride, K, out.stride(0),
        0.0 if swiglu_limit is None else float(swiglu_limit), claims, counter, GEMM1=gemm1,
        HAS_LIMIT=swiglu_limit is not None, STAGES=STAGES, DYNAMIC=dynamic,
        PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAXNREG)


def experts_persistent(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    plan: DispatchPlan,
    out: torch.Tensor,
    swiglu_limit: Optional[float] = None,
    *,
    programs: Optional[int] = None,
    dynamic: bool = True,
) -> None:
    """Gather GEMM1's rows, then GEMM1 + SwiGLU and GEMM2 with the persistent kernels, into ``out`` [rows, H].
    Call only where :func:`eligible` holds. ``programs``, ``dynamic``: as :func:`launch` takes them."""
    if plan.tile_expert.numel() == 0:
        return
    rows = gather_rows(hidden, plan)
    inter = torch.empty(plan.num_rows, down.shape[2], dtype=hidden.dtype, device=hidden.device)
    launch(True, rows, gate_up, plan, inter, swiglu_limit, programs=programs, dynamic=dynamic)
    launch(False, inter, down, plan, out, programs=programs, dynamic=dynamic)


def eligible_fp8(hidden: torch.Tensor, gate_up: BlockFP8, down: BlockFP8, plan: DispatchPlan,
                 out: torch.Tensor) -> bool:
    """Whether :func:`experts_persistent_fp8` runs these fp8 block-scale experts: as :func:`eligible` (bf16 or fp16
    activations), with values and scales contiguous (TMA reads [E·N, K] values; the scales are indexed by strides,
    one block a box since I and H are multiples of 128)."""
    return (_runs_here(hidden, gate_up.shape, plan, out)
            and all(w.values.is_contiguous() for w in (gate_up, down)))


def launch_fp8(gemm1: bool, rows: torch.Tensor, row_scales: torch.Tensor, weight: BlockFP8, plan: DispatchPlan,
               out: torch.Tensor, out_scales: Optional[torch.Tensor], swiglu_limit: Optional[float] = None, *,
               programs: Optional[int] = None, dynamic: bool = True) -> None:
    """:func:`launch` on fp8 block-scale operands: ``rows`` e4m3 [R, K] with ``row_scales`` [R, K/128]; GEMM1 writes
    ``out`` e4m3 [R, I] and ``out_scales`` [R, I/128], GEMM2 ``out`` [R, H] in the activations' dtype."""
    E, N, K = weight.shape
    items = _Items.of(gemm1, N, plan, rows.device, programs)
    if items.count == 0:
        return
    a_desc, w_desc = _descriptors(rows, weight.values, FP8_BLOCK_K, gl.float8e4nv)
    scales = out if out_scales is None else out_scales  # GEMM2 has none: the kernel never touches it
    claims, counter = _schedule(items, dynamic, plan)
    _persistent_fp8_kernel[(items.grid,)](
        a_desc, w_desc, row_scales, weight.scales, out, scales, plan.tile_expert, plan.tile_row_start,
        plan.expert_offsets, items.count, items.col_blocks, plan.num_rows, N, items.cols, items.box_stride, K,
        row_scales.stride(0), row_scales.stride(1), *weight.scales.stride(), out.stride(0), scales.stride(0),
        0.0 if swiglu_limit is None else float(swiglu_limit), claims, counter, GEMM1=gemm1,
        HAS_LIMIT=swiglu_limit is not None, STAGES=STAGES, DYNAMIC=dynamic,
        FP8_CONSUMER_REGS=FP8_CONSUMER_REGS, num_warps=4, maxnreg=MAXNREG)


def experts_persistent_fp8(
    hidden: torch.Tensor,
    gate_up: BlockFP8,
    down: BlockFP8,
    plan: DispatchPlan,
    out: torch.Tensor,
    swiglu_limit: Optional[float] = None,
    *,
    programs: Optional[int] = None,
    dynamic: bool = True,
) -> None:
    """The fp8 block-scale experts (SPEC §5) with the persistent kernels: one pass quantizes the plan's rows of
    ``hidden`` (``fp8.quantize``, gathering them), GEMM1 + SwiGLU writes the intermediate quantized, GEMM2 ``out``.
    Call only where :func:`eligible_fp8` holds."""
    if plan.tile_expert.numel() == 0:
        return
    hidden_size, width = gate_up.shape[2], down.shape[2]
    rows, row_scales = quantized_rows(plan, hidden_size, hidden.device)
    quantize_rows_into(hidden, rows, row_scales, plan, gather=True)
    inter, inter_scales = quantized_rows(plan, width, hidden.device)
    launch_fp8(True, rows, row_scales, gate_up, plan, inter, inter_scales, swiglu_limit, programs=programs,
               dynamic=dynamic)
    launch_fp8(False, inter, inter_scales, down, plan, out, None, programs=programs, dynamic=dynamic)
