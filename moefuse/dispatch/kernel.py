"""Triton dispatch: sort (token, slot) pairs by expert and build the GEMM tile schedule, with no host sync (a
token's slot k is its k-th routed choice, ``topk_ids[t, k]``).

Contract (same results as :func:`moefuse.dispatch.reference.moe_dispatch_torch`, bit for bit):

- Inputs: ``topk_ids`` [M, K] int32/int64 (contiguous), ``num_experts`` E, ``block_m``.
- Outputs (int32, allocated by the caller): ``expert_offsets`` [E+1], ``permuted_to_expanded`` [N],
  ``expanded_to_permuted`` [N], ``tile_expert`` [T_max], ``tile_row_start`` [T_max], with N = M·K.

Every pair gets a bin: its expert, or the overflow bin E for ids outside [0, E). The permuted order is a
stable counting sort by bin, so the overflow bin comes last and its rows are exactly the unused tail
``[n_valid, N)`` (written -1). Nothing is sorted: within a block of pairs, a pair's position in the block's
stable order is the number of pairs whose key ``bin * BLOCK + index`` is smaller (a [BLOCK, BLOCK]
comparison, ``_block_positions``); across blocks, per-bin counts place each block's pairs.

Two launch plans, chosen from N alone (never from device values):

- N <= ``ONE_PROGRAM_MAX`` (decode and small prefill): ``_dispatch_one_program``, one launch. The positions
  in the single block are the permuted rows; a histogram gives the offsets and the tile schedule.
- Larger N: NC = cdiv(N, CHUNK) chunks, three launches, none of them looping over chunks or experts serially.
  1. ``_count_chunks`` (grid NC): histogram of each chunk's bins, ``hist[c, :]``.
  2. ``_scan_chunks`` (grid BLOCK_E / SCAN_E): per bin, an exclusive scan over the chunks,
     ``prefix[c, b]`` = pairs of bin b in chunks before c, and ``prefix[NC, b]`` = all pairs of bin b.
  3. ``_scatter_chunks`` (grid NC): a pair at position p of its chunk's stable order lands on row
     ``offsets[b] + prefix[c, b] + p - (pairs of chunk c in bins < b)``; writes both maps, and each chunk
     writes its share of the tile schedule (chunk 0 also the offsets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import max_tiles

# A block of n pairs costs n * n key comparisons on one SM (about 0.7 us at n = 256 with 4 warps): one
# program is worth it up to a few hundred pairs; beyond, small chunks keep that cost low and the grid wide
# (M = 4096 at top-8 is 256 chunks, two per SM). Untuned; the GPU benchmark times dispatch on its own.
ONE_PROGRAM_MAX = 256  # largest N done by one program in one launch
CHUNK = 128  # pairs per program in the multi-program path
BLOCK_J = 32  # keys compared per step: each thread holds this many keys of the other pairs
SCAN_E = 16  # bins per program of the scan over chunks
SCAN_C = 256  # chunks per step of that scan: N <= SCAN_C * CHUNK is a single step


@triton.jit
def _bins(ids_ptr, start, num_rows, num_experts, BLOCK: tl.constexpr):
    """Load ids ``[start, start + BLOCK)``; return (index [BLOCK], in-range mask [BLOCK], bin int32 [BLOCK]).

    Lanes past N get the overflow bin E; they follow every real pair of the block, so they never move one.
    """
    offs = start + tl.arange(0, BLOCK)  # [BLOCK]
    in_range = offs < num_rows
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    bins = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(tl.int32)
    return offs, in_range, bins


@triton.jit
def _block_positions(bins, BLOCK: tl.constexpr, BLOCK_J: tl.constexpr):
    """Position of each of a block's pairs in the block's stable order by bin: [BLOCK] from ``bins`` [BLOCK].

    Keys ``bin * BLOCK + local index`` are distinct and ordered as the stable sort wants, so a pair's position
    is the number of smaller keys. The keys are compared BLOCK_J at a time (``tl.gather`` reads them back
    from shared memory as broadcasts): a thread holds its own pairs and BLOCK_J keys, and counts in registers.
    """
    keys = bins * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    positions = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, BLOCK, BLOCK_J):
        keys_j = tl.gather(keys, j0 + tl.arange(0, BLOCK_J), 0)  # [BLOCK_J]
        positions += tl.sum((keys_j[:, None] < keys[None, :]).to(tl.int32), axis=0)  # [BLOCK_J, BLOCK] -> [BLOCK]
    return positions


@triton.jit
def _tile_schedule(
    counts, offsets, num_experts, block_m, tile_lo, tile_hi, tile_expert_ptr, tile_row_start_ptr,
    BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Write tiles ``[tile_lo, tile_hi)`` (at most BLOCK_T of them) of the schedule from ``counts`` [BLOCK_E]
    (rows per bin; bins >= E are ignored) and the experts' first rows ``offsets`` [BLOCK_E].

    Tile t belongs to the expert ``owner(t)`` = number of experts whose tiles end at or before t (searchsorted).
    Over the block of tiles that is the ends before the block plus a running count of the ends inside it:
    a histogram and a cumsum, no search. Bins >= E end at the total, so tiles past it get owner >= E: unused.
    Every chunk of the multi-program path calls this for its share of the tiles; it costs a few [BLOCK_E] scans.
    """
    experts = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    counts = tl.where(experts < num_experts, counts, 0)
    tiles = (counts + block_m - 1) // block_m
    tiles_end = tl.cumsum(tiles, 0)  # [BLOCK_E] non-decreasing
    # the owner's first row plus block_m per earlier tile of the owner: row_base[owner] + t * block_m
    row_base = offsets - (tiles_end - tiles) * block_m  # [BLOCK_E]
    inside = (tiles_end >= tile_lo) & (tiles_end < tile_lo + BLOCK_T)
    ends = tl.histogram(tiles_end - tile_lo, BLOCK_T, mask=inside)  # [BLOCK_T]
    owner = tl.sum((tiles_end < tile_lo).to(tl.int32), 0) + tl.cumsum(ends, 0)  # [BLOCK_T]
    t = tile_lo + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    row_start = tl.gather(row_base, tl.minimum(owner, BLOCK_E - 1), 0) + t * block_m
    used = owner < num_experts
    tl.store(tile_expert_ptr + t, tl.where(used, owner, -1), mask=t < tile_hi)
    tl.store(tile_row_start_ptr + t, tl.where(used, row_start, -1), mask=t < tile_hi)


@triton.jit
def _write_maps(bins, src, row, valid, num_experts, p2e_ptr, e2p_ptr):
    """Pair ``src`` goes to row ``row``: write both maps, -1 for pairs in the overflow bin (no row)."""
    real = bins < num_experts
    tl.store(p2e_ptr + row, tl.where(real, src, -1), mask=valid)
    tl.store(e2p_ptr + src, tl.where(real, row, -1), mask=valid)


# Integers that vary with the token count are not specialised: no new variant per batch size (moefuse.warmup).
@triton.jit(do_not_specialize=["num_rows", "num_tiles"])
def _dispatch_one_program(
    ids_ptr, offsets_ptr, p2e_ptr, e2p_ptr, tile_expert_ptr, tile_row_start_ptr,
    num_rows, num_experts, block_m, num_tiles,
    BLOCK: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (1,): the whole dispatch of N <= BLOCK pairs; the block's stable order is the permuted order.

    Only the experts' counts are needed (the order already puts the overflow bin last), so BLOCK_E >= E.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the ids come from the router kernel
        tl.extra.cuda.gdc_launch_dependents()
    offs, in_range, bins = _bins(ids_ptr, 0, num_rows, num_experts, BLOCK)
    rows = _block_positions(bins, BLOCK, BLOCK_J)
    _write_maps(bins, offs, rows, in_range, num_experts, p2e_ptr, e2p_ptr)
    # rows per expert; expert e ends at offsets[e + 1] (offsets[E] = n_valid)
    counts = tl.histogram(bins, BLOCK_E, mask=in_range & (bins < num_experts))  # [BLOCK_E]
    experts = tl.arange(0, BLOCK_E)
    rows_end = tl.cumsum(counts, 0)  # [BLOCK_E]
    tl.store(offsets_ptr + 1 + experts, rows_end, mask=experts < num_experts)
    tl.store(offsets_ptr, 0)
    _tile_schedule(
        counts, rows_end - counts, num_experts, block_m, 0, num_tiles, tile_expert_ptr, tile_row_start_ptr,
        BLOCK_E, BLOCK_T,
    )


# Integers that vary with the token count are not specialised: no new variant per batch size (moefuse.warmup).
@triton.jit(do_not_specialize=["num_rows"])
def _count_chunks(
    ids_ptr, hist_ptr, num_rows, num_experts,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid (NC,): ``hist[c, b]`` = pairs of chunk c in bin b."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    chunk = tl.program_id(0)
    _, in_range, bins = _bins(ids_ptr, chunk * CHUNK, num_rows, num_experts, CHUNK)
    counts = tl.histogram(bins, BLOCK_E, mask=in_range)  # [BLOCK_E]
    tl.store(hist_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), counts)


# Integers that vary with the token count are not specialised: no new variant per batch size (moefuse.warmup).
@triton.jit(do_not_specialize=["num_chunks"])
def _scan_chunks(
    hist_ptr, prefix_ptr, num_chunks,
    BLOCK_E: tl.constexpr, SCAN_E: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid (BLOCK_E / SCAN_E,): for SCAN_E bins, ``prefix[c, b]`` = sum of ``hist[:c, b]``; ``prefix[NC, b]`` the
    total. The chunks go BLOCK_C at a time ([BLOCK_C, SCAN_E] tiles), so NC <= BLOCK_C is a single step."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bins = tl.program_id(0) * SCAN_E + tl.arange(0, SCAN_E)  # [SCAN_E]
    carry = tl.zeros([SCAN_E], dtype=tl.int32)  # pairs of each bin in the chunks done so far
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)  # [BLOCK_C]
        index = chunks[:, None] * BLOCK_E + bins[None, :]  # [BLOCK_C, SCAN_E]
        mask = chunks[:, None] < num_chunks
        counts = tl.load(hist_ptr + index, mask=mask, other=0)
        tl.store(prefix_ptr + index, carry[None, :] + tl.cumsum(counts, 0) - counts, mask=mask)
        carry += tl.sum(counts, 0)
    tl.store(prefix_ptr + num_chunks * BLOCK_E + bins, carry)


# Integers that vary with the token count are not specialised: no new variant per batch size (moefuse.warmup).
@triton.jit(do_not_specialize=["num_rows", "num_chunks", "num_tiles", "tiles_per_chunk"])
def _scatter_chunks(
    ids_ptr, hist_ptr, prefix_ptr, offsets_ptr, p2e_ptr, e2p_ptr, tile_expert_ptr, tile_row_start_ptr,
    num_rows, num_chunks, num_experts, block_m, num_tiles, tiles_per_chunk,
    CHUNK: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (NC,): both maps for chunk c's pairs, and tiles ``[c, c + 1) * tiles_per_chunk`` of the schedule."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    chunk = tl.program_id(0)
    start = chunk * CHUNK
    offs, in_range, bins = _bins(ids_ptr, start, num_rows, num_experts, CHUNK)
    positions = _block_positions(bins, CHUNK, BLOCK_J)
    experts = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    totals = tl.load(prefix_ptr + num_chunks * BLOCK_E + experts)
    counts = tl.load(hist_ptr + chunk * BLOCK_E + experts)
    # row of the chunk's first pair of bin b, minus that pair's position in the chunk's order:
    # offsets[b] + prefix[c, b] - (pairs of chunk c in bins < b), both sums as one exclusive cumsum
    before = totals - counts
    base = tl.load(prefix_ptr + chunk * BLOCK_E + experts) + tl.cumsum(before, 0) - before  # [BLOCK_E]
    rows = tl.gather(base, bins, 0) + positions  # [CHUNK]
    _write_maps(bins, offs, rows, in_range, num_experts, p2e_ptr, e2p_ptr)
    offsets = tl.cumsum(totals, 0) - totals  # [BLOCK_E]; offsets[E] = n_valid
    if chunk == 0:
        tl.store(offsets_ptr + experts, offsets, mask=experts <= num_experts)
    tile_lo = chunk * tiles_per_chunk
    tile_hi = tl.minimum(tile_lo + tiles_per_chunk, num_tiles)
    _tile_schedule(
        totals, offsets, num_experts, block_m, tile_lo, tile_hi, tile_expert_ptr, tile_row_start_ptr,
        BLOCK_E, BLOCK_T,
    )


def _block_t(tiles: int) -> int:
    """BLOCK_T for a program that schedules ``tiles`` tiles. Small by construction: T_max <= cdiv(N, 16) + N, so
    the one program has at most 272 tiles (N <= 256) and a chunk's share is about chunk * 17 / 16."""
    return max(16, triton.next_power_of_2(tiles))


def _launch_args(use_pdl: bool) -> dict:
    return {"launch_pdl": True} if use_pdl else {}


def _one_program_shape(num_rows: int, num_experts: int, num_tiles: int) -> dict[str, int]:
    block = max(16, triton.next_power_of_2(num_rows))
    return {"BLOCK": block, "BLOCK_J": min(block, BLOCK_J), "BLOCK_E": max(16, triton.next_power_of_2(num_experts)),
            "BLOCK_T": _block_t(num_tiles)}


def _chunked_shape(num_rows: int, num_experts: int, num_tiles: int, chunk: int) -> dict[str, int]:
    num_chunks = triton.cdiv(num_rows, chunk)
    return {"CHUNK": chunk, "BLOCK_J": min(chunk, BLOCK_J),
            "BLOCK_E": max(16, triton.next_power_of_2(num_experts + 1)),  # bins 0..E, E = overflow
            "BLOCK_C": min(SCAN_C, triton.next_power_of_2(num_chunks)),
            "BLOCK_T": _block_t(triton.cdiv(num_tiles, num_chunks))}


def launch_shape(num_rows: int, num_experts: int, block_m: int) -> tuple:
    """What dispatch compiles for N = ``num_rows`` pairs (default path): a new value is a new kernel variant.
    ``moefuse.warmup`` enumerates these; the launcher below takes its constexprs from the same functions."""
    num_tiles = max_tiles(num_rows, num_experts, block_m)
    if num_rows <= ONE_PROGRAM_MAX:
        return ("one program", *_one_program_shape(num_rows, num_experts, num_tiles).values())
    return ("chunks", *_chunked_shape(num_rows, num_experts, num_tiles, CHUNK).values())


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

    ``chunk`` (a power of two >= 16) forces the multi-program path with that chunk size when N > chunk; tests
    use it to cover several chunks at small N. Default: one program up to ``ONE_PROGRAM_MAX`` pairs, else
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
    kw = _launch_args(use_pdl)
    if chunk is None and num_rows <= ONE_PROGRAM_MAX:
        _dispatch_one_program[(1,)](
            ids, expert_offsets, permuted_to_expanded, expanded_to_permuted, tile_expert, tile_row_start,
            num_rows, num_experts, block_m, num_tiles, **_one_program_shape(num_rows, num_experts, num_tiles),
            USE_PDL=use_pdl, num_warps=4, **kw,
        )
        return
    shape = _chunked_shape(num_rows, num_experts, num_tiles, CHUNK if chunk is None else chunk)
    chunk, block_e = shape["CHUNK"], shape["BLOCK_E"]
    num_chunks = triton.cdiv(num_rows, chunk)
    scratch = torch.empty(2 * num_chunks + 1, block_e, dtype=torch.int32, device=ids.device)
    hist, prefix = scratch[:num_chunks], scratch[num_chunks:]  # [NC, BLOCK_E], [NC + 1, BLOCK_E]
    _count_chunks[(num_chunks,)](
        ids, hist, num_rows, num_experts, CHUNK=chunk, BLOCK_E=block_e, USE_PDL=use_pdl, num_warps=4, **kw
    )
    _scan_chunks[(block_e // SCAN_E,)](
        hist, prefix, num_chunks, BLOCK_E=block_e, SCAN_E=SCAN_E, BLOCK_C=shape["BLOCK_C"], USE_PDL=use_pdl,
        num_warps=4, **kw,
    )
    _scatter_chunks[(num_chunks,)](
        ids, hist, prefix, expert_offsets, permuted_to_expanded, expanded_to_permuted, tile_expert,
        tile_row_start, num_rows, num_chunks, num_experts, block_m, num_tiles, triton.cdiv(num_tiles, num_chunks),
        CHUNK=chunk, BLOCK_J=shape["BLOCK_J"], BLOCK_E=block_e, BLOCK_T=shape["BLOCK_T"], USE_PDL=use_pdl,
        num_warps=4, **kw,
    )
