"""Triton dispatch: sort (token, slot) pairs by expert and build the GEMM tile schedule, with no host sync.

Contract (same results as :func:`moefuse.dispatch.reference.moe_dispatch_torch`, bit for bit):

- Inputs: ``topk_ids`` [M, K] int32/int64 (contiguous), ``num_experts`` E, ``block_m``.
- Outputs (int32, allocated by the caller): ``expert_offsets`` [E+1], ``permuted_to_expanded`` [N],
  ``expanded_to_permuted`` [N], ``tile_expert`` [T_max], ``tile_row_start`` [T_max], with N = M·K.

Every pair gets a bin: its expert, or the overflow bin E for ids outside [0, E). Sorting the key
``bin * CHUNK + index`` sorts by bin and, within a bin, by expanded index: the stable order. The overflow bin
sorts last, so its rows are exactly the unused tail ``[n_valid, N)`` of the permuted order (written -1).

Two launch plans, chosen from N alone (never from device values):

- N <= ``ONE_PROGRAM_MAX`` (decode and small prefill): one program does it all, ``_dispatch_one_program``:
  histogram, prefix sum, in-register sort of all N keys, both scatters, tile schedule. One launch.
- Larger N: NC = cdiv(N, CHUNK) chunks, three launches.
  1. ``_count_chunks`` (grid NC): histogram of each chunk's bins into ``scratch[c, :]``.
  2. ``_scan_chunks`` (grid 1): expert offsets from the column totals; per chunk and bin, the permuted row
     of the chunk's first pair in that bin minus that pair's position in the sorted chunk (so a pair's row
     is base + its position in the sorted chunk), written over ``scratch[c, :]``; the tile schedule.
  3. ``_scatter_chunks`` (grid NC): sort each chunk's keys and write both maps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Sizes of the in-register bitonic sorts (O(n log^2 n) compare-exchanges): small enough for one program to
# sort quickly, large enough that big batches need only a few dozen chunks. Untuned; the GPU benchmark
# times dispatch on its own.
ONE_PROGRAM_MAX = 1024  # largest N done by one program in one launch
CHUNK = 1024  # pairs per program in the multi-program path


@triton.jit
def _bins(ids_ptr, start, num_rows, num_experts, BLOCK: tl.constexpr):
    """Load ids ``[start, start + BLOCK)``; return (index [BLOCK], in-range mask [BLOCK], bin int32 [BLOCK])."""
    offs = start + tl.arange(0, BLOCK)  # [BLOCK]
    in_range = offs < num_rows
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    bins = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(tl.int32)
    return offs, in_range, bins


@triton.jit
def _sorted_rows(bins, in_range, local, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Sort a block's pairs stably by bin: returns (bin [BLOCK], local index [BLOCK]) of sorted position i.

    Out-of-range lanes get key ``BLOCK_E * BLOCK`` (above every real key, and bins are < BLOCK_E), so they
    sort last.
    """
    key = tl.where(in_range, bins * BLOCK + local, BLOCK_E * BLOCK)  # [BLOCK]
    key = tl.sort(key)
    return key // BLOCK, key % BLOCK


@triton.jit
def _tile_schedule(
    counts, num_experts, block_m, num_tiles, tile_expert_ptr, tile_row_start_ptr,
    BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Write the tile schedule from ``counts`` [BLOCK_E] (rows per expert; entries >= E are ignored).

    Tile t belongs to the first expert e with tiles_end[e] > t. With ``before[e] = tiles_end[e] <= t`` (true
    exactly for e < owner), the owner is the number of such e, its first tile is the largest tiles_end among
    them and its first row is the sum of their counts: no gather from a register tensor is needed.
    """
    experts = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    real = experts < num_experts
    counts = tl.where(real, counts, 0)
    tiles_end = tl.cumsum((counts + block_m - 1) // block_m, 0)  # [BLOCK_E]
    for t0 in range(0, num_tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)  # [BLOCK_T]
        before = (tiles_end[None, :] <= t[:, None]) & real[None, :]  # [BLOCK_T, BLOCK_E]
        owner = tl.sum(before.to(tl.int32), axis=1)  # [BLOCK_T]
        first_tile = tl.max(tl.where(before, tiles_end[None, :], 0), axis=1)
        first_row = tl.sum(tl.where(before, counts[None, :], 0), axis=1)
        row_start = first_row + (t - first_tile) * block_m
        used = owner < num_experts
        tl.store(tile_expert_ptr + t, tl.where(used, owner, -1), mask=t < num_tiles)
        tl.store(tile_row_start_ptr + t, tl.where(used, row_start, -1), mask=t < num_tiles)


@triton.jit
def _write_maps(sorted_bin, src, row, valid, num_experts, p2e_ptr, e2p_ptr):
    """Row ``row`` holds pair ``src``: write both maps, -1 for pairs in the overflow bin (no row)."""
    real = sorted_bin < num_experts
    tl.store(p2e_ptr + row, tl.where(real, src, -1), mask=valid)
    tl.store(e2p_ptr + src, tl.where(real, row, -1), mask=valid)


@triton.jit
def _dispatch_one_program(
    ids_ptr, offsets_ptr, p2e_ptr, e2p_ptr, tile_expert_ptr, tile_row_start_ptr,
    num_rows, num_experts, block_m, num_tiles,
    BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid (1,): the whole dispatch of N <= BLOCK pairs in registers."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the ids come from the router kernel
        tl.extra.cuda.gdc_launch_dependents()
    offs, in_range, bins = _bins(ids_ptr, 0, num_rows, num_experts, BLOCK)
    # 1. counts per bin (bin E = overflow) and their exclusive prefix: offsets[E] = n_valid
    counts = tl.histogram(bins, BLOCK_E, mask=in_range)  # [BLOCK_E]
    experts = tl.arange(0, BLOCK_E)
    tl.store(offsets_ptr + experts, tl.cumsum(counts, 0) - counts, mask=experts <= num_experts)
    # 2. sorted position i is permuted row i
    sorted_bin, src = _sorted_rows(bins, in_range, offs, BLOCK, BLOCK_E)
    _write_maps(sorted_bin, src, offs, in_range, num_experts, p2e_ptr, e2p_ptr)
    # 3. tiles
    _tile_schedule(counts, num_experts, block_m, num_tiles, tile_expert_ptr, tile_row_start_ptr, BLOCK_E, BLOCK_T)


@triton.jit
def _count_chunks(
    ids_ptr, scratch_ptr, num_rows, num_experts,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid (NC,): ``scratch[c, b]`` = pairs of chunk c in bin b."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    chunk = tl.program_id(0)
    _, in_range, bins = _bins(ids_ptr, chunk * CHUNK, num_rows, num_experts, CHUNK)
    counts = tl.histogram(bins, BLOCK_E, mask=in_range)  # [BLOCK_E]
    tl.store(scratch_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit
def _scan_chunks(
    scratch_ptr, offsets_ptr, tile_expert_ptr, tile_row_start_ptr,
    num_chunks, num_experts, block_m, num_tiles,
    BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid (1,): offsets, per-chunk bases (in place over the counts) and the tile schedule."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    experts = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c in range(num_chunks):
        totals += tl.load(scratch_ptr + c * BLOCK_E + experts)
    offsets = tl.cumsum(totals, 0) - totals  # [BLOCK_E] exclusive: first permuted row of each bin
    tl.store(offsets_ptr + experts, offsets, mask=experts <= num_experts)
    # A pair at sorted position i of chunk c in bin b lands on row offsets[b] + (pairs of bin b in earlier
    # chunks) + (i - pairs of chunk c in bins < b): store everything but i as the chunk's base for bin b.
    running = offsets
    for c in range(num_chunks):
        counts = tl.load(scratch_ptr + c * BLOCK_E + experts)  # [BLOCK_E]
        tl.store(scratch_ptr + c * BLOCK_E + experts, running - (tl.cumsum(counts, 0) - counts))
        running += counts
    _tile_schedule(totals, num_experts, block_m, num_tiles, tile_expert_ptr, tile_row_start_ptr, BLOCK_E, BLOCK_T)


@triton.jit
def _scatter_chunks(
    ids_ptr, scratch_ptr, p2e_ptr, e2p_ptr, num_rows, num_experts,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid (NC,): sort chunk c and write each pair's row from the chunk's per-bin base."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    chunk = tl.program_id(0)
    start = chunk * CHUNK
    offs, in_range, bins = _bins(ids_ptr, start, num_rows, num_experts, CHUNK)
    sorted_bin, local = _sorted_rows(bins, in_range, offs - start, CHUNK, BLOCK_E)
    position = tl.arange(0, CHUNK)  # [CHUNK] position in the sorted chunk
    valid = position < num_rows - start
    base = tl.load(scratch_ptr + chunk * BLOCK_E + sorted_bin, mask=valid, other=0)
    _write_maps(sorted_bin, start + local, base + position, valid, num_experts, p2e_ptr, e2p_ptr)


def _launch_args(use_pdl: bool) -> dict:
    return {"launch_pdl": True} if use_pdl else {}


def dispatch_triton(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    expert_offsets: torch.Tensor,
    permuted_to_expanded: torch.Tensor,
    expanded_to_permuted: torch.Tensor,
    tile_expert: torch.Tensor,
    tile_row_start: torch.Tensor,
    *,
    use_pdl: bool = False,
    chunk: int | None = None,
) -> None:
    """Launch the dispatch kernels into the given outputs (arguments already validated).

    ``chunk`` (a power of two) forces the multi-program path with that chunk size when N > chunk; tests use
    it to cover several chunks at small N. Default: one program up to ``ONE_PROGRAM_MAX`` pairs, else
    chunks of ``CHUNK``.
    """
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_rows = ids.numel()
    if num_rows == 0:  # no pairs: offsets are all 0 and the other outputs are empty
        expert_offsets.zero_()
        return
    num_tiles = tile_expert.numel()
    block_e = triton.next_power_of_2(num_experts + 1)  # bins 0..E, E = overflow
    block_t = max(16, 8192 // block_e)  # keeps the [BLOCK_T, BLOCK_E] compare in the registers
    kw = _launch_args(use_pdl)
    if chunk is None and num_rows <= ONE_PROGRAM_MAX:
        block = max(16, triton.next_power_of_2(num_rows))
        _dispatch_one_program[(1,)](
            ids, expert_offsets, permuted_to_expanded, expanded_to_permuted, tile_expert, tile_row_start,
            num_rows, num_experts, block_m, num_tiles,
            BLOCK=block, BLOCK_E=block_e, BLOCK_T=block_t, USE_PDL=use_pdl,
            num_warps=4, **kw,
        )
        return
    chunk = CHUNK if chunk is None else chunk
    num_chunks = triton.cdiv(num_rows, chunk)
    scratch = torch.empty(num_chunks, block_e, dtype=torch.int32, device=ids.device)
    _count_chunks[(num_chunks,)](
        ids, scratch, num_rows, num_experts, CHUNK=chunk, BLOCK_E=block_e, USE_PDL=use_pdl, num_warps=4, **kw
    )
    _scan_chunks[(1,)](
        scratch, expert_offsets, tile_expert, tile_row_start, num_chunks, num_experts, block_m, num_tiles,
        BLOCK_E=block_e, BLOCK_T=block_t, USE_PDL=use_pdl, num_warps=4, **kw,
    )
    _scatter_chunks[(num_chunks,)](
        ids, scratch, permuted_to_expanded, expanded_to_permuted, num_rows, num_experts,
        CHUNK=chunk, BLOCK_E=block_e, USE_PDL=use_pdl, num_warps=4, **kw,
    )
