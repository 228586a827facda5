"""fp8 block-scale experts at decode as one persistent kernel over both GEMMs (a candidate, measured and dropped).

``experts_fp8`` launches GEMM1 (split along K at a token or two) and then GEMM2: at one token each GEMM is
one wave of programs that each stream a large piece of the weights, so each has its own ramp and its own tail
(the slowest program), and GEMM2's weights start streaming only as GEMM1's programs end. Here one launch of a
few programs per SM takes small work items from one counter, in one order:

- a **GEMM1 item** is one tile's 128 intermediate columns (gate and up weight rows) over one of ``SPLIT`` runs of
  128-deep steps along H; it stores its fp32 partial sums, and the last of a column block's runs to arrive adds
  them in run order and runs the epilogue (SwiGLU, the intermediate's quantization), as ``_gemm1_fp8_kernel``
  split along K does; then it counts the column block as done for its tile;
- a **GEMM2 item** is one tile's ``BLOCK_N2`` output columns over all of I; it first waits until its tile's
  column blocks are all done, then runs as ``_gemm2_fp8_kernel`` (swapped operands under 64 rows);
- with ``prequant``, a **quantization item** per tile and run: the tile's rows gathered and quantized over the
  run's steps (SPEC §5, as ``_quantize_rows_kernel`` does at prefill), ahead of every GEMM item; a GEMM1 item then
  waits for its tile and run's, and loads e4m3 rows instead of quantizing in its loop (once per column block).

The order: GEMM1's items of tiles 0 .. lag-1, then per tile t >= lag GEMM1's items of t followed by GEMM2's of
t - lag, then GEMM2's last lag tiles (``lag`` >= the tile count: all of GEMM1 first). A GEMM2 item waits only for
items taken before it, whose programs are running, so the order cannot deadlock whatever the occupancy; a program
takes its next item as it starts one, so the counter's latency overlaps the work.

Numerics are ``experts_fp8``'s with ``split_k=SPLIT`` (SPEC §5): the same steps, promotions, run order and
roundings, so the outputs are the same bits on the same tiles. A probe, not a library kernel:
``fp8_decode_probe --fused`` times it against the op; on an H200 (2026-12-05) its best launch took 1.03-1.56x the
op's time on every preset at 1, 2 and 16 tokens (``research/README.md``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from moefuse import _runtime
from moefuse.dispatch import DispatchPlan
from moefuse.experts.common import _round, _swiglu, _tile_span, weight_descriptor
from moefuse.experts.fp8.kernels import WGMMA_MIN_ROWS, _add_scaled, _split_range
from moefuse.experts.fp8.quantize import _quantize, quantized_rows
from moefuse.formats import BLOCK, BlockFP8
from research.l2_prefetch import _prefetch_l2


@triton.jit
def _item_at(item, num_tiles, lag, g1n, g2n):
    """(GEMM1?, tile, index within the tile's items of that GEMM) of work item ``item`` in the order above."""
    lag = tl.minimum(num_tiles, lag)
    head = lag * g1n
    both = g1n + g2n
    mid_end = head + (num_tiles - lag) * both
    in_head = item < head
    in_mid = (item >= head) & (item < mid_end)
    j = tl.maximum(item - head, 0)
    seg = j // both
    r = j - seg * both
    k = tl.maximum(item - mid_end, 0)
    gemm1 = in_head | (in_mid & (r < g1n))
    tile = tl.where(in_head, item // g1n, tl.where(in_mid, tl.where(r < g1n, lag + seg, seg),
                                                   num_tiles - lag + k // g2n))
    sub = tl.where(in_head, item % g1n, tl.where(in_mid, tl.where(r < g1n, r, r - g1n), k % g2n))
    return gemm1, tile, sub


PREFETCH_STEPS = tl.constexpr(2)  # the steps a 3-stage pipeline's prologue loads at once


@triton.jit
def _prefetch_item(item, first, total, num_tiles, lag, g1n, g2n, w1_ptr, w2_ptr, tile_expert_ptr, I, H,
                   stride_w1n, stride_w2n, BLOCK_N2: tl.constexpr, SPLIT: tl.constexpr):
    """The weight rows of the first ``PREFETCH_STEPS`` steps of work item ``item`` (GEMM1: its gate and up rows;
    GEMM2: its output columns' rows), asked of the L2 while this program works on the item before: a ``tl`` program
    issues an item's first loads only once the item before has ended, so each item would start on a DRAM latency."""
    if (item >= first) & (item < total):
        gemm1, tile, sub = _item_at(item - first, num_tiles, lag, g1n, g2n)
        expert = tl.load(tile_expert_ptr + tile)
        if expert >= 0:
            steps = tl.arange(0, PREFETCH_STEPS) * 128
            if gemm1:
                r = tl.arange(0, 256)  # 128 gate rows, then their 128 up rows
                k_begin, k_end = _split_range(H, sub % SPLIT, 128, SPLIT)
                k = tl.where(k_begin + steps < k_end, k_begin + steps, 0)  # past the run: a line of the row
                gate_up_rows = expert * 2 * I + (sub // SPLIT) * 128 + r % 128 + (r // 128) * I
                _prefetch_l2(w1_ptr + gate_up_rows.to(tl.int64)[:, None] * stride_w1n + k[None, :], True)
            else:  # (names of their own: a name bound in both branches must have one shape)
                down_rows = expert * H + sub * BLOCK_N2 + tl.arange(0, BLOCK_N2)
                k = tl.where(steps < I, steps, 0)
                _prefetch_l2(w2_ptr + down_rows.to(tl.int64)[:, None] * stride_w2n + k[None, :], True)


MAX_TRIES = tl.constexpr(1 << 18)  # a wait's loads of its counter before it gives up: about 0.3 s


@triton.jit
def _wait(counter_ptr, target, gave_up_ptr, COMPILED: tl.constexpr):
    """Spin until ``*counter_ptr`` reaches ``target`` (plain loads, not read-modify-writes, so that waiting programs
    do not queue at the L2's atomic units), then acquire: loads after it see what the counted items stored.
    ``COMPILED``: each retry after a ``nanosleep``, so that a waiting program leaves its SM's issue slots to the
    program it may be waiting for (the interpreter, which cannot run PTX, never waits: its programs run in turn).
    A wait that is not over after ``MAX_TRIES`` loads (an order or count that is wrong: the waits of a right one take
    microseconds) sets ``*gave_up_ptr`` and goes on, so that such a bug fails a test instead of hanging the GPU."""
    seen = tl.load(counter_ptr, volatile=True)
    tries = 0
    while (seen < target) & (tries < MAX_TRIES):
        if COMPILED:
            tl.inline_asm_elementwise("nanosleep.u32 64;\n\tmov.u32 $0, 0;", "=r,r", [seen], dtype=tl.int32,
                                      is_pure=False, pack=1)
        seen = tl.load(counter_ptr, volatile=True)
        tries += 1
    if seen < target:
        # a plain store: a scalar atomic compiles with a barrier around it (its result is broadcast), and a thread
        # that saw the count on its last load would not reach it, so the give-up itself would hang
        tl.store(gave_up_ptr, 1)
    tl.atomic_add(counter_ptr, 0, sem="acquire")


@triton.jit
def _quantize_item(tile, run, hidden_ptr, aq_ptr, as_ptr, quantized_ptr, tile_expert_ptr, tile_row_start_ptr,
                   expert_offsets_ptr, p2e_ptr, H, top_k, stride_hm, stride_hk, stride_aqm, stride_asm,
                   EMULATE_RTNE: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr):
    """``PREQUANT``'s first items: the valid rows of ``tile`` gathered from ``hidden`` and quantized (SPEC §5) over
    GEMM1's run ``run`` of steps, into ``aq_ptr`` / ``as_ptr`` in the plan's row order; then the run is counted."""
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= 0:
        rows = tl.load(tile_row_start_ptr + tile) + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(expert_offsets_ptr + expert + 1)
        tokens = (tl.load(p2e_ptr + rows, mask=row_ok, other=0) // top_k).to(tl.int64)
        ks = tl.arange(0, 128)
        k_begin, k_end = _split_range(H, run, 128, SPLIT)
        for k0 in range(k_begin, k_end, 128):
            x = tl.load(hidden_ptr + tokens[:, None] * stride_hm + (k0 + ks)[None, :] * stride_hk,
                        mask=row_ok[:, None], other=0.0)
            q, scale = _quantize(x.to(tl.float32), EMULATE_RTNE)
            tl.store(aq_ptr + rows.to(tl.int64)[:, None] * stride_aqm + (k0 + ks)[None, :], q, mask=row_ok[:, None])
            tl.store(as_ptr + rows.to(tl.int64) * stride_asm + k0 // 128, scale, mask=row_ok)
        tl.debug_barrier()  # every thread's rows stored before the release below
        tl.atomic_add(quantized_ptr + tile * SPLIT + run, 1, sem="release")


@triton.jit
def _gemm1_item(tile, sub, hidden_ptr, aq_ptr, as_ptr, quantized_ptr, gave_up_ptr, w1_desc, w1s_ptr, inter_ptr,
                is_ptr, part_ptr, arrivals_ptr, done_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                p2e_ptr, I, H, top_k, limit, num_rows, stride_hm, stride_hk, stride_aqm, stride_asm, stride_se,
                stride_sn, stride_sk, stride_im, stride_ism, HAS_LIMIT: tl.constexpr, EMULATE_RTNE: tl.constexpr,
                BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, PREQUANT: tl.constexpr, SWAP1: tl.constexpr,
                COMPILED: tl.constexpr):
    """Column block ``sub // SPLIT`` of ``tile``, run ``sub % SPLIT`` of its 128-deep steps along H. ``PREQUANT``:
    the run's activations come quantized by a ``_quantize_item`` (waited for), else they are quantized here.
    ``SWAP1``: each step on wgmma with the weights as its M (as GEMM2 under 64 rows), whose fp8 sums keep fewer bits
    than mma.sync's fp32 ones: not SPEC §5's numerics, measured against them (H200, 2026-12-04: DeepSeek-V3's
    GEMM1 1.7 µs faster split, the error 4.6-8.4e-3 against 2.7-3.1e-3)."""
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= 0:
        col_block = sub // SPLIT
        run = sub % SPLIT
        row_start, rows, row_ok, a_rows, cols, col_ok, wrapped = _tile_span(
            tile, col_block, expert, I, tile_row_start_ptr, expert_offsets_ptr, BLOCK_M, 128)
        tokens = (tl.load(p2e_ptr + a_rows) // top_k).to(tl.int64)
        ks = tl.arange(0, 128)
        k_begin, k_end = _split_range(H, run, 128, SPLIT)  # the op's runs, so the same sums
        gate_row = expert * 2 * I + col_block * 128
        s_expert = w1s_ptr + expert.to(tl.int64) * stride_se
        gate_scale_ptrs = s_expert + col_block * stride_sn
        up_scale_ptrs = s_expert + (I // 128 + col_block) * stride_sn  # I is a multiple of 128 (the launcher's check)
        if SWAP1:  # transposed: the weights are the MMA's M, the rows its N
            acc_gate = tl.zeros([128, BLOCK_M], dtype=tl.float32)
            acc_up = tl.zeros([128, BLOCK_M], dtype=tl.float32)
        else:
            acc_gate = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
        if PREQUANT:
            _wait(quantized_ptr + tile * SPLIT + run, 1, gave_up_ptr, COMPILED)
        for k0 in range(k_begin, k_end, 128):
            if PREQUANT:  # past L1 (.cg): another program wrote these rows during this launch
                a = tl.load(aq_ptr + a_rows[:, None] * stride_aqm + (k0 + ks)[None, :], cache_modifier=".cg")
                a_scale = tl.load(as_ptr + a_rows * stride_asm + k0 // 128, cache_modifier=".cg")
            else:
                x = tl.load(hidden_ptr + tokens[:, None] * stride_hm + (k0 + ks)[None, :] * stride_hk)
                a, a_scale = _quantize(x.to(tl.float32), EMULATE_RTNE)
            gate_w = w1_desc.load([gate_row, k0]).T
            up_w = w1_desc.load([gate_row + I, k0]).T
            step = k0 // 128 * stride_sk
            acc_gate = _add_scaled(acc_gate, a, gate_w, a_scale, tl.load(gate_scale_ptrs + step), True, SWAP1)
            acc_up = _add_scaled(acc_up, a, up_w, a_scale, tl.load(up_scale_ptrs + step), True, SWAP1)
        if SWAP1:
            acc_gate = acc_gate.T
            acc_up = acc_up.T
        last = True
        if SPLIT > 1:
            done = row_ok[:, None] & col_ok[None, :]
            part = part_ptr + rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
            split_stride = num_rows.to(tl.int64) * (2 * I)
            tl.store(part + run * split_stride, acc_gate, mask=done)
            tl.store(part + run * split_stride + I, acc_up, mask=done)
            tl.debug_barrier()  # every thread's partial sums stored before the release below
            # acq_rel: this run's sums are visible to the last arriver, and the last sees every run's
            last = tl.atomic_add(arrivals_ptr + tile * (I // 128) + col_block, 1, sem="acq_rel") == SPLIT - 1
            if last:
                acc_gate = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
                # in run order, not arrival order; a loop, not unrolled: unrolled, each run's loads were issued
                # together and the program spilled at 14 runs
                for s in tl.range(0, SPLIT, num_stages=1):
                    acc_gate += tl.load(part + s * split_stride, mask=done, other=0.0, cache_modifier=".cg")
                    acc_up += tl.load(part + s * split_stride + I, mask=done, other=0.0, cache_modifier=".cg")
        if last:
            act = _swiglu(acc_gate, acc_up, limit, HAS_LIMIT)
            q, scale = _quantize(act, EMULATE_RTNE)
            tl.store(inter_ptr + rows.to(tl.int64)[:, None] * stride_im + cols[None, :], q, mask=row_ok[:, None])
            tl.store(is_ptr + rows.to(tl.int64) * stride_ism + col_block, scale, mask=row_ok)
            tl.debug_barrier()  # the whole block's rows stored before it is counted done
            tl.atomic_add(done_ptr + tile, 1, sem="release")


@triton.jit
def _gemm2_item(tile, sub, inter_ptr, is_ptr, w2_desc, w2s_ptr, out_ptr, done_ptr, gave_up_ptr,
                tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, I, H,
                stride_im, stride_ism, stride_se, stride_sn, stride_sk, stride_om, stride_on,
                OUT_RTNE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N2: tl.constexpr, SWAP: tl.constexpr,
                COMPILED: tl.constexpr):
    """Output columns ``sub · BLOCK_N2 ..`` of ``tile``, once GEMM1 has done all of the tile's column blocks."""
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= 0:
        _wait(done_ptr + tile, I // 128, gave_up_ptr, COMPILED)
        row_start, rows, row_ok, a_rows, cols, col_ok, wrapped = _tile_span(
            tile, sub, expert, H, tile_row_start_ptr, expert_offsets_ptr, BLOCK_M, BLOCK_N2)
        ks = tl.arange(0, 128)
        w_row = expert * H + sub * BLOCK_N2
        w_scale_ptrs = w2s_ptr + expert.to(tl.int64) * stride_se + (sub * BLOCK_N2 // 128) * stride_sn
        if SWAP:
            acc = tl.zeros([BLOCK_N2, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N2], dtype=tl.float32)
        for k0 in range(0, I, 128):
            # past L1 (.cg): other programs wrote these rows during this launch
            a = tl.load(inter_ptr + a_rows[:, None] * stride_im + (k0 + ks)[None, :], cache_modifier=".cg")
            a_scale = tl.load(is_ptr + a_rows * stride_ism + k0 // 128, cache_modifier=".cg")
            w = w2_desc.load([w_row, k0]).T
            acc = _add_scaled(acc, a, w, a_scale, tl.load(w_scale_ptrs + k0 // 128 * stride_sk), True, SWAP)
        if SWAP:
            acc = acc.T
        out = _round(acc, out_ptr.dtype.element_ty, OUT_RTNE)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on, out,
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_tiles", "num_rows", "lag"])
def _fused_decode_kernel(
    hidden_ptr, aq_ptr, as_ptr, w1_ptr, w1_desc, w1s_ptr, w2_ptr, w2_desc, w2s_ptr, inter_ptr, is_ptr, out_ptr,
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, p2e_ptr, part_ptr, counters_ptr,
    num_tiles, I, H, top_k, limit, num_rows, lag,
    stride_hm, stride_hk, stride_aqm, stride_asm, stride_w1n, stride_s1e, stride_s1n, stride_s1k, stride_w2n,
    stride_s2e, stride_s2n, stride_s2k, stride_im, stride_ism, stride_om, stride_on,
    HAS_LIMIT: tl.constexpr, EMULATE_RTNE: tl.constexpr, OUT_RTNE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N2: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr, PREQUANT: tl.constexpr,
    SWAP1: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr, COMPILED: tl.constexpr,
):
    """Both GEMMs of ``experts_fp8`` over the plan's tiles, items taken from ``counters_ptr[0]``. ``counters_ptr``
    (int32, zeroed per launch): [0] the next item, then per tile and GEMM1 column block the runs arrived, per tile
    the column blocks done, per tile and run the activations quantized (``PREQUANT``: those items come first), and
    last whether a wait gave up (``_wait``)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the plan comes from dispatch
        tl.extra.cuda.gdc_launch_dependents()
    g1n = (I // 128) * SPLIT
    g2n = tl.cdiv(H, BLOCK_N2)
    arrivals_ptr = counters_ptr + 1
    done_ptr = arrivals_ptr + num_tiles * (I // 128)
    quantized_ptr = done_ptr + num_tiles
    gave_up_ptr = quantized_ptr + num_tiles * SPLIT
    first = num_tiles * SPLIT if PREQUANT else 0  # the quantization items
    total = first + num_tiles * (g1n + g2n)
    item = tl.atomic_add(counters_ptr, 1)
    while item < total:
        ahead = tl.atomic_add(counters_ptr, 1)  # the next item, taken now so that its latency overlaps this one
        if PREFETCH:
            _prefetch_item(ahead, first, total, num_tiles, lag, g1n, g2n, w1_ptr, w2_ptr, tile_expert_ptr, I, H,
                           stride_w1n, stride_w2n, BLOCK_N2, SPLIT)
        if item < first:
            _quantize_item(item // SPLIT, item % SPLIT, hidden_ptr, aq_ptr, as_ptr, quantized_ptr, tile_expert_ptr,
                           tile_row_start_ptr, expert_offsets_ptr, p2e_ptr, H, top_k, stride_hm, stride_hk,
                           stride_aqm, stride_asm, EMULATE_RTNE, BLOCK_M, SPLIT)
        else:
            gemm1, tile, sub = _item_at(item - first, num_tiles, lag, g1n, g2n)
            if gemm1:
                _gemm1_item(tile, sub, hidden_ptr, aq_ptr, as_ptr, quantized_ptr, gave_up_ptr, w1_desc, w1s_ptr,
                            inter_ptr, is_ptr, part_ptr, arrivals_ptr, done_ptr, tile_expert_ptr, tile_row_start_ptr,
                            expert_offsets_ptr, p2e_ptr, I, H, top_k, limit, num_rows, stride_hm, stride_hk,
                            stride_aqm, stride_asm, stride_s1e, stride_s1n, stride_s1k, stride_im, stride_ism,
                            HAS_LIMIT, EMULATE_RTNE, BLOCK_M, SPLIT, PREQUANT, SWAP1, COMPILED)
            else:
                _gemm2_item(tile, sub, inter_ptr, is_ptr, w2_desc, w2s_ptr, out_ptr, done_ptr, gave_up_ptr,
                            tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, I, H, stride_im, stride_ism,
                            stride_s2e, stride_s2n, stride_s2k, stride_om, stride_on, OUT_RTNE, BLOCK_M, BLOCK_N2,
                            SWAP, COMPILED)
        item = ahead


def fused_experts_fp8(hidden: torch.Tensor, gate_up: BlockFP8, down: BlockFP8, plan: DispatchPlan,
                      out: torch.Tensor, *, split: int, lag: int, programs: int, block_n2: int = 128,
                      num_warps: int = 4, num_stages: int = 3, maxnreg: Optional[int] = None,
                      prequant: bool = False, prefetch: bool = False, swap1: bool = False,
                      swiglu_limit: Optional[float] = None, use_pdl: bool = False) -> Optional[torch.Tensor]:
    """``experts_fp8(hidden, gate_up, down, plan, out, ..., split_k=split)`` as one launch of ``programs``
    programs (the order and items above). Widths: H and I multiples of 128 (every preset's), contiguous weights.
    ``maxnreg``: a register cap per thread (8 warps at 128 registers fit two programs an SM; left to Triton, about
    200 compiled for sm_90). ``prequant``: the activations quantized once per tile and run by items of their own
    ahead of GEMM1's, which then wait for them, instead of in each GEMM1 item's loop (once per column block).
    ``prefetch``: each program asks the L2 for its next item's first weight lines as it starts an item (inline PTX:
    compiled kernels only). ``swap1``: GEMM1 on wgmma with swapped operands (``_gemm1_item``'s ``SWAP1``; other
    numerics, so not the split op's bits).

    Returns a one-element int32 tensor, set (after the launch) where a wait gave up: an order or count that is wrong,
    and an output that is then wrong too (None where the plan has no tiles)."""
    I, H = down.shape[2], hidden.shape[1]
    if I % BLOCK or H % BLOCK:
        raise ValueError(f"the fused decode kernel takes H and I multiples of 128, got H={H}, I={I}")
    if prefetch and _runtime.interpreting():
        raise ValueError("prefetch is inline PTX: the interpreter cannot run it")
    if block_n2 not in (64, 128):
        raise ValueError(f"block_n2 must be 64 or 128, got {block_n2}")
    for name, value in (("split", split), ("lag", lag), ("programs", programs)):
        if not isinstance(value, int) or value < (0 if name == "lag" else 1):
            raise ValueError(f"{name} must be a {'non-negative' if name == 'lag' else 'positive'} int, got {value!r}")
    num_tiles = plan.tile_expert.numel()
    if num_tiles == 0:
        return None
    device = hidden.device
    desc1 = weight_descriptor(gate_up.values, BLOCK, BLOCK)
    desc2 = weight_descriptor(down.values, block_n2, BLOCK)
    if desc1 is None or desc2 is None:
        raise ValueError("the fused decode kernel reads the weights through TMA: contiguous fp8 weights on sm_90+")
    inter, inter_scales = quantized_rows(plan, I, device)
    part = torch.empty(split if split > 1 else 0, plan.num_rows, 2 * I, dtype=torch.float32, device=device)
    aq, a_scales = quantized_rows(plan, H, device) if prequant else (inter, inter_scales)  # else not read
    counters = torch.zeros(1 + num_tiles * (I // BLOCK) + num_tiles + num_tiles * split + 1, dtype=torch.int32,
                           device=device)
    launch: dict = {"launch_pdl": True} if use_pdl else {}
    if maxnreg is not None:
        launch["maxnreg"] = maxnreg
    emulate = _runtime.interpreting()  # the interpreter's casts round wrongly: rounded on the bits first
    _fused_decode_kernel[(programs,)](
        hidden, aq, a_scales, gate_up.values, desc1, gate_up.scales, down.values, desc2, down.scales, inter,
        inter_scales, out,
        plan.tile_expert, plan.tile_row_start, plan.expert_offsets, plan.permuted_to_expanded, part, counters,
        num_tiles, I, H, plan.top_k, 0.0 if swiglu_limit is None else float(swiglu_limit), plan.num_rows, lag,
        hidden.stride(0), hidden.stride(1), aq.stride(0), a_scales.stride(0), gate_up.values.stride(1),
        *gate_up.scales.stride(), down.values.stride(1), *down.scales.stride(), inter.stride(0),
        inter_scales.stride(0), *out.stride(),
        HAS_LIMIT=swiglu_limit is not None, EMULATE_RTNE=emulate, OUT_RTNE=emulate and out.dtype == torch.bfloat16,
        BLOCK_M=plan.block_m, BLOCK_N2=block_n2, SPLIT=split, SWAP=plan.block_m < WGMMA_MIN_ROWS, PREQUANT=prequant,
        SWAP1=swap1,
        PREFETCH=prefetch, USE_PDL=use_pdl, COMPILED=not emulate,
        num_warps=num_warps, num_stages=num_stages, **launch,
    )
    return counters[-1:]
