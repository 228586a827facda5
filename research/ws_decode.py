"""fp8 block-scale experts at decode as one persistent, warp-specialized Gluon kernel over both GEMMs (sm_90 only;
a candidate, measured and dropped).

``fused_decode.py`` runs both GEMMs in one launch of ``tl`` programs that take small items from a counter. A ``tl``
program issues an item's first weight loads only once the item before has ended, so every item boundary costs a
DRAM latency and the arrival atomics, and GEMM1's 16-row tiles convert each fp8 weight for mma.sync (sm_90 has no
fp8 mma.sync). Here the same items, in the same order (``fused_decode._item_at``), run on two partitions:

- a **producer warp** claims items from the counter and streams their weight boxes (128 rows x 128 bytes of
  ``gate_up`` or ``down``, 16 KB each) through TMA into a ring of ``stages`` slots. It never waits for anything but
  a free slot: GEMM2's weights do not depend on GEMM1, so they stream while a consumer waits for its tile;
- a **consumer warp group** takes the items in the producer's order (each item's number rides with its first
  slot, as in ``experts/persistent.py``), and per 128-deep step puts the tile's activations in shared memory and
  issues wgmmas with the weights as M and the tile's 16 rows as N:
  - a **GEMM1 item** (a tile's 128 intermediate columns, one of ``runs`` runs of H's steps): per step, the gate
    and the up box; the activations gathered from ``hidden`` a step ahead and quantized here (SPEC §5, as
    ``fp8.quantize._quantize``); split, its fp32 sums go to ``part`` and the last of a column block's runs to
    arrive adds them in run order and runs the epilogue (SwiGLU, the intermediate's quantization), then counts the
    column block done for its tile;
  - a **GEMM2 item** (a tile's 128 output columns over all of I): waits until its tile's column blocks are done,
    then reads the intermediate a step ahead.

Each step's product is one fresh accumulator promoted into fp32 times the rows' activation scales and the box's
weight-block scale (SPEC §5). GEMM2 is the op's own numerics at decode tiles (its 16-row tiles already swap their
operands); GEMM1 on wgmma sums fp8 products as the 64-row tiles do, not in fp32 as the op's 16-row mma.sync does:
the ``swap1`` numerics of ``fused_decode.py`` (H200, 2026-12-04: 4.6-8.4e-3 from float64 at one token, against
2.7-3.1e-3). A probe, not a library kernel: ``fp8_decode_probe --ws`` times it against the op (``--fused`` times
the ``tl`` kernel the same way); on an H200 (2026-12-05) its best launch took 1.03-1.44x the op's time on every
preset (``research/README.md``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moefuse import _runtime
from moefuse.dispatch import DispatchPlan
from moefuse.experts.fp8.quantize import quantized_rows
from moefuse.formats import BLOCK, BlockFP8
from research.fused_decode import MAX_TRIES, _item_at

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from moefuse.experts.gluon_common import e4m3 as _e4m3
    from moefuse.experts.gluon_common import full_448 as _full_448
    from moefuse.experts.gluon_common import max_keeping_nan as _max_keeping_nan
    from moefuse.experts.gluon_common import row_inverse as _row_inverse
    from moefuse.experts.gluon_common import scale_of as _scale_of
    from moefuse.experts.gluon_common import swiglu as _swiglu
    from moefuse.experts.persistent import _claimed, _end_claim  # the claims protocol of the persistent kernels
except ImportError:  # pragma: no cover - every supported Triton has it
    gluon = None

BOX = 128  # weight rows a TMA box (and K bytes): GEMM1's gate or up rows of an item's columns, GEMM2's item
STAGES = 8  # ring slots of 16 KB
# Registers a thread at launch. The CTA is 8 warps (Triton pads the partitions to whole warp groups; the padding
# warps idle at 24): at 168 the consumer gets 256 and one program fits an SM, at 128 it gets 216 and two fit.
MAXNREG = 168
PRODUCER_REGS = 40  # the producer warp after the hand-over (setmaxnreg), as persistent.py's
BLOCK_M = 16  # tile rows (the wgmma's N): decode plans' tiles, the shortest moe_dispatch makes

if gluon is not None:
    # Triton 3.6 names the TMA load async_copy_global_to_shared and the CTA barrier thread_barrier; 3.9 async_load
    # and barrier.
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    _barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    _BOX: gl.constexpr = gl.constexpr(BOX)
    _HALF: gl.constexpr = gl.constexpr(BOX // 2)  # one wgmma's M
    _MAX_TRIES: gl.constexpr = gl.constexpr(MAX_TRIES.value)

    @gluon.jit
    def _decode(code):
        """An item's table entry (``item_table``): (GEMM1?, tile, index among the tile's items of that GEMM)."""
        return (code & 1) != 0, (code >> 1) & 0x7FFF, code >> 16

    @gluon.jit
    def _box(desc, row, k, w_smem, ready, empty, i, claim_ptr, item, CLAIM: gl.constexpr, STAGES: gl.constexpr):
        """Box [row.., k·128..] of ``desc`` into slot ``i % STAGES`` once it is free; ``CLAIM``: the item's number
        first goes to ``claim_ptr``, before the slot's barrier is armed (its completion releases it to the
        consumer). Returns the next ring position."""
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # the first pass finds every slot free
        if CLAIM:
            gl.store(claim_ptr, item)
        mbarrier.expect(ready.index(s), desc.block_type.nbytes)
        _tma_load(desc, [row, k * _BOX], ready.index(s), w_smem.index(s))
        return i + 1

    @gluon.jit
    def _produce(w1_desc, w2_desc, w_smem, ready, empty, table_ptr, tile_expert_ptr, claims_ptr, counter_ptr,
                 num_items, I, H, runs, per, STAGES: gl.constexpr, CLAIMS: gl.constexpr):
        """The producer warp: items claimed from ``counter_ptr`` one at a time, each one's boxes in step order
        (GEMM1: the gate box, then the up box, of each step of its run; GEMM2: its output columns' box of each of
        I's steps), each item's number passed to the consumer through this program's ``CLAIMS`` claims; past the
        last item, a slot armed with no bytes whose claim is ``num_items``: the consumer's end. Items of unused
        tiles (expert -1) are skipped here, so the consumer never sees them."""
        claims = claims_ptr + gl.program_id(0) * CLAIMS
        i = 0
        j = 0
        item = gl.atomic_add(counter_ptr, 1)
        while item < num_items:
            gemm1, tile, sub = _decode(gl.load(table_ptr + item))
            expert = gl.load(tile_expert_ptr + tile)
            if expert >= 0:
                claim = claims + j % CLAIMS
                if gemm1:
                    col_block = sub // runs
                    k0 = (sub % runs) * per
                    gate_row = expert * 2 * I + col_block * _BOX
                    i = _box(w1_desc, gate_row, k0, w_smem, ready, empty, i, claim, item, True, STAGES)
                    i = _box(w1_desc, gate_row + I, k0, w_smem, ready, empty, i, claim, item, False, STAGES)
                    for k in range(k0 + 1, gl.minimum(k0 + per, H // _BOX)):
                        i = _box(w1_desc, gate_row, k, w_smem, ready, empty, i, claim, item, False, STAGES)
                        i = _box(w1_desc, gate_row + I, k, w_smem, ready, empty, i, claim, item, False, STAGES)
                else:
                    w_row = expert * H + sub * _BOX
                    i = _box(w2_desc, w_row, 0, w_smem, ready, empty, i, claim, item, True, STAGES)
                    for k in range(1, I // _BOX):
                        i = _box(w2_desc, w_row, k, w_smem, ready, empty, i, claim, item, False, STAGES)
                j += 1
            item = gl.atomic_add(counter_ptr, 1)
        _end_claim(claims, empty, ready, i, j, num_items, STAGES, CLAIMS)

    @gluon.jit
    def _wait(counter_ptr, target, gave_up_ptr):
        """Spin until ``*counter_ptr`` reaches ``target`` (plain loads, a 64 ns sleep between them, so that the
        wait leaves the SM's issue slots to the programs it waits for), then acquire. A wait not over after
        ``MAX_TRIES`` loads sets ``*gave_up_ptr`` and goes on: a wrong order or count fails a test instead of
        hanging the GPU (``fused_decode._wait``)."""
        seen = gl.load(counter_ptr, volatile=True)
        tries = 0
        while (seen < target) & (tries < _MAX_TRIES):
            gl.inline_asm_elementwise("nanosleep.u32 64;\n\tmov.u32 $0, 0;", "=r,r", [seen], dtype=gl.int32,
                                      is_pure=False, pack=1)
            seen = gl.load(counter_ptr, volatile=True)
            tries += 1
        if seen < target:  # a plain store: an atomic would synchronize the warps, which may not all be here
            gl.store(gave_up_ptr, 1)
        gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")

    @gluon.jit
    def _load_hidden(hidden_ptr, tokens, row_ok, k, stride_hm, XL: gl.constexpr):
        """The tile's rows of ``hidden`` at step ``k`` (zeros for rows past the expert's), [BLOCK_M, 128] in fp32."""
        ks = gl.arange(0, _BOX, layout=gl.SliceLayout(0, XL))
        ptrs = hidden_ptr + gl.expand_dims(tokens, 1) + gl.expand_dims(k * _BOX + ks, 0)
        return gl.load(ptrs, mask=gl.expand_dims(row_ok, 1), other=0.0).to(gl.float32)

    @gluon.jit
    def _quantize_into(x, a_smem, MMA: gl.constexpr):
        """Rows of fp32 ``x`` [BLOCK_M, 128] quantized as ``fp8.quantize._quantize`` does (SPEC §5): the e4m3
        values into ``a_smem`` for the wgmmas (fenced and synchronized), each row's scale returned in the
        accumulators' column layout."""
        amax = gl.reduce(gl.abs(x), 1, _max_keeping_nan)
        inv = gl.where(amax > 0, gl.div_rn(_full_448(amax), amax), 0.0)
        a_smem.store(_e4m3(x * gl.expand_dims(inv, 1)))
        fence_async_shared()  # the wgmmas read the tile through the async proxy
        _barrier()  # every warp's rows stored before any warp's wgmma
        return gl.convert_layout(_scale_of(amax), gl.SliceLayout(0, MMA))

    @gluon.jit
    def _product(box, half, a, acc):
        """One 128-deep step of 64-row half ``half`` of a weight box times the tile's activations (``a``, [BLOCK_M,
        128] e4m3), into a fresh accumulator (``acc`` gives its shape and layout), issued, not waited for."""
        return warpgroup_mma(box.slice(half * _HALF, _HALF), a.permute((1, 0)), acc, use_acc=False, is_async=True)

    @gluon.jit
    def _promote(acc, part, scale):
        """``acc + part · scale[column]``: a step's product promoted into fp32 (the rows' activation scales times
        the box's weight-block scale, one multiply a column, as ``fp8.kernels._add_scaled`` swapped)."""
        return acc + part * gl.expand_dims(scale, 0)

    @gluon.jit
    def _ready_box(w_smem, ready, i, STAGES: gl.constexpr):
        """Ring position ``i``'s weight box, once its bytes have landed."""
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        return w_smem.index(s)

    @gluon.jit
    def _store_t(acc, ptr, m, row_ok, n0, stride_m):
        """``ptr[m, n0 + r] = acc[r, m]`` for the rows ``m`` of the tile that are the expert's (acc [64, BLOCK_M])."""
        r = n0 + gl.arange(0, _HALF, layout=gl.SliceLayout(1, acc.type.layout))
        ptrs = ptr + gl.expand_dims(m.to(gl.int64) * stride_m, 0) + gl.expand_dims(r, 1)
        gl.store(ptrs, acc, mask=gl.expand_dims(row_ok, 0) & gl.expand_dims(r >= 0, 1))

    @gluon.jit
    def _load_t(ptr, m, row_ok, n0, stride_m, MMA: gl.constexpr):
        """``ptr[m, n0 + r]`` as [64, BLOCK_M] (transposed, the accumulators' layout), past L1: other programs
        stored it during this launch."""
        r = n0 + gl.arange(0, _HALF, layout=gl.SliceLayout(1, MMA))
        ptrs = ptr + gl.expand_dims(m.to(gl.int64) * stride_m, 0) + gl.expand_dims(r, 1)
        return gl.load(ptrs, mask=gl.expand_dims(row_ok, 0) & gl.expand_dims(r >= 0, 1), other=0.0,
                       cache_modifier=".cg")

    @gluon.jit
    def _gate_up_zeros(BLOCK_M: gl.constexpr, MMA: gl.constexpr):
        """A GEMM1 item's four fp32 accumulators (gate and up, each box's two 64-row halves), [64, BLOCK_M]."""
        zeros = gl.zeros([_HALF, BLOCK_M], gl.float32, MMA)
        return zeros, zeros, zeros, zeros

    @gluon.jit
    def _gemm1_item(w_smem, a_smem, ready, empty, i, tile, sub, expert, row_start, row_end, hidden_ptr, p2e_ptr,
                    w1s_ptr, inter_ptr, is_ptr, part_ptr, arrivals_ptr, done_ptr, I, H, top_k, runs, per, num_rows,
                    limit, stride_hm, stride_se, stride_sn, stride_sk, stride_im, stride_ism, HAS_LIMIT: gl.constexpr,
                    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, XL: gl.constexpr, MMA: gl.constexpr):
        """Column block ``sub // runs`` of ``tile``, run ``sub % runs`` of H's steps, from ring position ``i``
        (returned past its boxes)."""
        col_block = sub // runs
        run = sub % runs
        k0 = run * per
        k1 = gl.minimum(k0 + per, H // _BOX)
        x_rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
        x_ok = x_rows < row_end
        tokens = (gl.load(p2e_ptr + x_rows, mask=x_ok, other=0) // top_k).to(gl.int64) * stride_hm
        s_expert = w1s_ptr + expert.to(gl.int64) * stride_se
        gate_scales = s_expert + col_block * stride_sn
        up_scales = s_expert + (I // _BOX + col_block) * stride_sn  # I a multiple of 128: the up box starts a block
        gate0, gate1, up0, up1 = _gate_up_zeros(BLOCK_M, MMA)
        x = _load_hidden(hidden_ptr, tokens, x_ok, k0, stride_hm, XL)
        for k in range(k0, k1):
            a = a_smem.index(k % 2)
            a_scale = _quantize_into(x, a, MMA)
            x = _load_hidden(hidden_ptr, tokens, x_ok, gl.minimum(k + 1, k1 - 1), stride_hm, XL)  # the next step's
            gate_scale = a_scale * gl.load(gate_scales + k * stride_sk)
            up_scale = a_scale * gl.load(up_scales + k * stride_sk)
            # the step's four wgmmas in flight together, the up box's issued as it lands
            gate = _ready_box(w_smem, ready, i, STAGES)
            g0 = _product(gate, 0, a, gate0)
            g1 = _product(gate, 1, a, gate1)
            up = _ready_box(w_smem, ready, i + 1, STAGES)
            u0 = _product(up, 0, a, up0)
            u1 = _product(up, 1, a, up1)
            g0, g1, u0, u1 = warpgroup_mma_wait(0, deps=[g0, g1, u0, u1])
            mbarrier.arrive(empty.index(i % STAGES))
            mbarrier.arrive(empty.index((i + 1) % STAGES))
            gate0 = _promote(gate0, g0, gate_scale)
            gate1 = _promote(gate1, g1, gate_scale)
            up0 = _promote(up0, u0, up_scale)
            up1 = _promote(up1, u1, up_scale)
            i += 2
        m = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
        row_ok = m < row_end
        col0 = col_block * _BOX
        last = True
        if runs > 1:
            part = part_ptr + run * num_rows.to(gl.int64) * (2 * I)
            _store_t(gate0, part, m, row_ok, col0, 2 * I)
            _store_t(gate1, part, m, row_ok, col0 + _HALF, 2 * I)
            _store_t(up0, part, m, row_ok, I + col0, 2 * I)
            _store_t(up1, part, m, row_ok, I + col0 + _HALF, 2 * I)
            _barrier()  # every thread's sums stored before the release below
            # acq_rel: this run's sums are visible to the last arriver, and the last sees every run's
            last = gl.atomic_add(arrivals_ptr + tile * (I // _BOX) + col_block, 1, sem="acq_rel",
                                 scope="gpu") == runs - 1
            if last:  # in run order, not arrival order: the same bits whichever run arrives last
                gate0, gate1, up0, up1 = _gate_up_zeros(BLOCK_M, MMA)
                for r in range(runs):
                    part = part_ptr + r * num_rows.to(gl.int64) * (2 * I)
                    gate0 += _load_t(part, m, row_ok, col0, 2 * I, MMA)
                    gate1 += _load_t(part, m, row_ok, col0 + _HALF, 2 * I, MMA)
                    up0 += _load_t(part, m, row_ok, I + col0, 2 * I, MMA)
                    up1 += _load_t(part, m, row_ok, I + col0 + _HALF, 2 * I, MMA)
        if last:  # the tile's rows are the columns here: each quantized over axis 0
            act0 = _swiglu(gate0, up0, limit, HAS_LIMIT)
            act1 = _swiglu(gate1, up1, limit, HAS_LIMIT)
            inverse, amax = _row_inverse(act0, act1, 0)
            _store_t(_e4m3(act0 * inverse), inter_ptr, m, row_ok, col0, stride_im)
            _store_t(_e4m3(act1 * inverse), inter_ptr, m, row_ok, col0 + _HALF, stride_im)
            gl.store(is_ptr + m.to(gl.int64) * stride_ism + col_block, _scale_of(amax), mask=row_ok)
            _barrier()  # the whole column block stored before it is counted done
            gl.atomic_add(done_ptr + tile, 1, sem="release", scope="gpu")
        return i

    @gluon.jit
    def _load_inter(inter_ptr, is_ptr, x_rows, x_ok, k, stride_im, stride_ism, XL: gl.constexpr):
        """The tile's e4m3 intermediate at step ``k`` and its rows' scales, past L1 (GEMM1's last arrivers stored
        them during this launch)."""
        ks = gl.arange(0, _BOX, layout=gl.SliceLayout(0, XL))
        rows = x_rows.to(gl.int64)
        a = gl.load(inter_ptr + gl.expand_dims(rows * stride_im, 1) + gl.expand_dims(k * _BOX + ks, 0),
                    mask=gl.expand_dims(x_ok, 1), other=0.0, cache_modifier=".cg")
        return a, gl.load(is_ptr + rows * stride_ism + k, mask=x_ok, other=0.0, cache_modifier=".cg")

    @gluon.jit
    def _gemm2_item(w_smem, a_smem, ready, empty, i, tile, sub, expert, row_start, row_end, inter_ptr, is_ptr,
                    w2s_ptr, out_ptr, done_ptr, gave_up_ptr, I, stride_im, stride_ism, stride_se, stride_sn,
                    stride_sk, stride_om, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, XL: gl.constexpr,
                    MMA: gl.constexpr):
        """Output columns ``sub · 128 ..`` of ``tile`` over all of I, once GEMM1 has done the tile's column blocks,
        from ring position ``i`` (returned past its boxes). Its boxes may have landed long before: only this
        consumer waits."""
        _wait(done_ptr + tile, I // _BOX, gave_up_ptr)
        x_rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
        x_ok = x_rows < row_end
        w_scales = w2s_ptr + expert.to(gl.int64) * stride_se + sub * stride_sn
        acc0 = gl.zeros([_HALF, BLOCK_M], gl.float32, MMA)
        acc1 = gl.zeros([_HALF, BLOCK_M], gl.float32, MMA)
        q, q_scale = _load_inter(inter_ptr, is_ptr, x_rows, x_ok, 0, stride_im, stride_ism, XL)
        for k in range(I // _BOX):
            a = a_smem.index(k % 2)
            a.store(q)
            fence_async_shared()
            _barrier()
            scale = gl.convert_layout(q_scale, gl.SliceLayout(0, MMA)) * gl.load(w_scales + k * stride_sk)
            q, q_scale = _load_inter(inter_ptr, is_ptr, x_rows, x_ok, gl.minimum(k + 1, I // _BOX - 1), stride_im,
                                     stride_ism, XL)
            w = _ready_box(w_smem, ready, i, STAGES)
            d0 = _product(w, 0, a, acc0)
            d1 = _product(w, 1, a, acc1)
            d0, d1 = warpgroup_mma_wait(0, deps=[d0, d1])
            mbarrier.arrive(empty.index(i % STAGES))
            acc0 = _promote(acc0, d0, scale)
            acc1 = _promote(acc1, d1, scale)
            i += 1
        m = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
        row_ok = m < row_end
        _store_t(acc0.to(out_ptr.dtype.element_ty), out_ptr, m, row_ok, sub * _BOX, stride_om)
        _store_t(acc1.to(out_ptr.dtype.element_ty), out_ptr, m, row_ok, sub * _BOX + _HALF, stride_om)
        return i

    @gluon.jit
    def _consume(w_smem, ready, empty, hidden_ptr, p2e_ptr, w1s_ptr, w2s_ptr, inter_ptr, is_ptr, out_ptr, part_ptr,
                 table_ptr, claims_ptr, arrivals_ptr, done_ptr, gave_up_ptr, tile_expert_ptr, tile_row_start_ptr,
                 expert_offsets_ptr, num_items, num_rows, I, H, top_k, runs, per, limit, stride_hm, stride_s1e,
                 stride_s1n, stride_s1k, stride_s2e, stride_s2n, stride_s2k, stride_im, stride_ism, stride_om,
                 HAS_LIMIT: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CLAIMS: gl.constexpr):
        """The consumer warp group: the producer's items in its order, until the claim that says none is left."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_M, 32])
        # a tile step [BLOCK_M, 128] of activations: 8 consecutive values a thread, a warp two or more whole rows
        XL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4, 1],
                                            order=[1, 0])
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, _BOX], gl.float8e4nv)
        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, _BOX], a_layout)  # a step and the next
        i = 0
        j = 0
        item = _claimed(claims_ptr, ready, i, j, STAGES, CLAIMS)
        while item < num_items:
            gemm1, tile, sub = _decode(gl.load(table_ptr + item))
            expert = gl.load(tile_expert_ptr + tile)  # >= 0: the producer passes no item of an unused tile
            row_start = gl.load(tile_row_start_ptr + tile)
            row_end = gl.load(expert_offsets_ptr + expert + 1)
            if gemm1:
                i = _gemm1_item(w_smem, a_smem, ready, empty, i, tile, sub, expert, row_start, row_end, hidden_ptr,
                                p2e_ptr, w1s_ptr, inter_ptr, is_ptr, part_ptr, arrivals_ptr, done_ptr, I, H, top_k,
                                runs, per, num_rows, limit, stride_hm, stride_s1e, stride_s1n, stride_s1k, stride_im,
                                stride_ism, HAS_LIMIT, BLOCK_M, STAGES, XL, MMA)
            else:
                i = _gemm2_item(w_smem, a_smem, ready, empty, i, tile, sub, expert, row_start, row_end, inter_ptr,
                                is_ptr, w2s_ptr, out_ptr, done_ptr, gave_up_ptr, I, stride_im, stride_ism,
                                stride_s2e, stride_s2n, stride_s2k, stride_om, BLOCK_M, STAGES, XL, MMA)
            j += 1
            item = _claimed(claims_ptr, ready, i, j, STAGES, CLAIMS)

    @gluon.jit(do_not_specialize=["num_items", "num_rows", "runs", "per"])
    def _ws_decode_kernel(w1_desc, w2_desc, hidden_ptr, p2e_ptr, w1s_ptr, w2s_ptr, inter_ptr, is_ptr, out_ptr,
                          part_ptr, table_ptr, claims_ptr, counters_ptr, tile_expert_ptr, tile_row_start_ptr,
                          expert_offsets_ptr, num_items, num_tiles, num_rows, I, H, top_k, runs, per, limit,
                          stride_hm, stride_s1e, stride_s1n, stride_s1k, stride_s2e, stride_s2n, stride_s2k,
                          stride_im, stride_ism, stride_om,
                          HAS_LIMIT: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                          CLAIMS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """Both GEMMs of the fp8 experts over the plan's tiles, the items of ``table_ptr`` taken from
        ``counters_ptr[0]``. ``counters_ptr`` (int32, zeroed per launch): [0] the next item, then per tile and GEMM1
        column block the runs arrived, per tile the column blocks done, and last whether a wait gave up."""
        w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, _BOX, _BOX], w1_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        arrivals_ptr = counters_ptr + 1
        done_ptr = arrivals_ptr + num_tiles * (I // _BOX)
        gave_up_ptr = done_ptr + num_tiles
        gl.warp_specialize([
            (_consume, (w_smem, ready, empty, hidden_ptr, p2e_ptr, w1s_ptr, w2s_ptr, inter_ptr, is_ptr, out_ptr,
                        part_ptr, table_ptr, claims_ptr, arrivals_ptr, done_ptr, gave_up_ptr, tile_expert_ptr,
                        tile_row_start_ptr, expert_offsets_ptr, num_items, num_rows, I, H, top_k, runs, per, limit,
                        stride_hm, stride_s1e, stride_s1n, stride_s1k, stride_s2e, stride_s2n, stride_s2k,
                        stride_im, stride_ism, stride_om, HAS_LIMIT, BLOCK_M, STAGES, CLAIMS)),
            (_produce, (w1_desc, w2_desc, w_smem, ready, empty, table_ptr, tile_expert_ptr, claims_ptr,
                        counters_ptr, num_items, I, H, runs, per, STAGES, CLAIMS)),
        ], [1], [PRODUCER_REGS])


@triton.jit
def _table_kernel(table_ptr, total, num_tiles, lag, g1n, g2n, BLOCK: tl.constexpr):
    """``table[n]`` = work item n of ``fused_decode._item_at``'s order, as (index << 16) | (tile << 1) | GEMM1."""
    items = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    gemm1, tile, sub = _item_at(items, num_tiles, lag, g1n, g2n)
    tl.store(table_ptr + items, (sub << 16) | (tile << 1) | gemm1.to(tl.int32), mask=items < total)


def item_table(num_tiles: int, lag: int, g1n: int, g2n: int, device: torch.device) -> torch.Tensor:
    """The items of ``num_tiles`` tiles (``g1n`` GEMM1 and ``g2n`` GEMM2 items a tile) in ``fused_decode``'s order
    with ``lag``, one int32 each (see ``_table_kernel``). It depends on shapes only: build it once, outside a
    timed or captured call."""
    if num_tiles >= 1 << 15 or max(g1n, g2n) >= 1 << 15:
        raise ValueError(f"item_table packs a tile and an index in 15 bits each, got {num_tiles} tiles, "
                         f"{g1n} and {g2n} items a tile")
    total = num_tiles * (g1n + g2n)
    table = torch.empty(total, dtype=torch.int32, device=device)
    if total:
        _table_kernel[(triton.cdiv(total, 256),)](table, total, num_tiles, lag, g1n, g2n, BLOCK=256)
    return table


def runs_of(hidden_size: int, split: int) -> tuple[int, int]:
    """(runs, steps a run) of GEMM1's K split ``split`` ways as ``fp8.kernels._split_range`` splits it, empty runs
    dropped (the op's boundaries; an empty run adds nothing to the sums)."""
    steps = hidden_size // BLOCK
    per = triton.cdiv(steps, split)
    return triton.cdiv(steps, per), per


def ws_experts_fp8(hidden: torch.Tensor, gate_up: BlockFP8, down: BlockFP8, plan: DispatchPlan, out: torch.Tensor,
                   table: torch.Tensor, *, split: int, programs: int, stages: int = STAGES, maxnreg: int = MAXNREG,
                   swiglu_limit: Optional[float] = None) -> Optional[torch.Tensor]:
    """The fp8 experts (SPEC §5, GEMM1 on wgmma) as one launch of ``programs`` warp-specialized programs over the
    items of ``table`` (``item_table(num_tiles, lag, (I/128)·runs, H/128)``, ``runs`` from :func:`runs_of`).
    Needs an sm_90 GPU, bf16 or fp16 ``hidden``, H and I multiples of 128, contiguous fp8 weights and a plan of
    ``BLOCK_M`` rows a tile; everything is checked before the launch.

    Returns a one-element int32 tensor, set (after the launch) where a wait gave up: an order or count that is wrong,
    and an output that is then wrong too (None where the plan has no tiles)."""
    I, H = down.shape[2], hidden.shape[1]
    if I % BLOCK or H % BLOCK:
        raise ValueError(f"the warp-specialized decode kernel takes H and I multiples of 128, got H={H}, I={I}")
    if plan.block_m != BLOCK_M:
        raise ValueError(f"plan.block_m must be {BLOCK_M} (the wgmma's N), got {plan.block_m}")
    for name, value in (("split", split), ("programs", programs), ("stages", stages), ("maxnreg", maxnreg)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if hidden.dtype not in (torch.bfloat16, torch.float16) or out.dtype != hidden.dtype or out.stride(1) != 1:
        raise TypeError("hidden must be bf16 or fp16, and out of its dtype with unit column stride")
    if hidden.stride(1) != 1:
        raise ValueError("hidden must have unit column stride (the kernel reads a step's 128 columns as one row)")
    if not (gate_up.values.is_contiguous() and down.values.is_contiguous()):
        raise ValueError("the warp-specialized decode kernel reads the weights through TMA: contiguous fp8 values")
    runs, per = runs_of(H, split)
    num_tiles = plan.tile_expert.numel()
    want = num_tiles * ((I // BLOCK) * runs + H // BLOCK)
    if table.dtype != torch.int32 or table.numel() != want:
        raise ValueError(f"table must be item_table's {want} int32 items for this plan and split, got "
                         f"{table.numel()} {table.dtype}")
    if gluon is None or not hidden.is_cuda or _runtime.interpreting() or _runtime.capability(hidden.device) != (9, 0):
        raise ValueError("the warp-specialized decode kernel is Gluon for sm_90: it needs an H100/H200 GPU and no "
                         "interpreter")
    if num_tiles == 0:
        return None
    device = hidden.device
    inter, inter_scales = quantized_rows(plan, I, device)
    part = torch.empty(runs if runs > 1 else 0, plan.num_rows, 2 * I, dtype=torch.float32, device=device)
    counters = torch.zeros(1 + num_tiles * (I // BLOCK) + num_tiles + 1, dtype=torch.int32, device=device)
    claims = torch.empty(programs * 2 * stages, dtype=torch.int32, device=device)
    layout = gl.NVMMASharedLayout.get_default_for([BOX, BOX], gl.float8e4nv)
    w1_desc, w2_desc = (TensorDescriptor.from_tensor(w.values.view(-1, w.shape[2]), [BOX, BOX], layout)
                        for w in (gate_up, down))
    _ws_decode_kernel[(programs,)](
        w1_desc, w2_desc, hidden, plan.permuted_to_expanded, gate_up.scales, down.scales, inter, inter_scales, out,
        part, table, claims, counters, plan.tile_expert, plan.tile_row_start, plan.expert_offsets,
        table.numel(), num_tiles, plan.num_rows, I, H, plan.top_k, runs, per,
        0.0 if swiglu_limit is None else float(swiglu_limit),
        hidden.stride(0), *gate_up.scales.stride(), *down.scales.stride(), inter.stride(0), inter_scales.stride(0),
        out.stride(0),
        HAS_LIMIT=swiglu_limit is not None, BLOCK_M=plan.block_m, STAGES=stages, CLAIMS=2 * stages,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=maxnreg)
    return counters[-1:]
