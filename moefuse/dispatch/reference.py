"""Readable PyTorch version of the dispatch stage: the plan that sorts (token, slot) pairs by expert (a token's
slot k is its k-th routed choice, ``topk_ids[t, k]``).

The experts stage runs one grouped GEMM over rows sorted by expert. Dispatch turns the router's ids [M, K]
into that order and into the GEMM's tile schedule, on the device and without a host sync, so a CUDA graph
can capture it. :class:`DispatchPlan` is the stage's output contract; :func:`moe_dispatch_torch` is the spec
you can run, the CPU path and the test oracle of the Triton kernel (which must match it exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Static upper bound T_max on the GEMM tiles of ``num_rows`` (token, slot) rows spread over experts.

    Each expert with ``c > 0`` rows needs ``cdiv(c, block_m) <= c // block_m + 1`` tiles; summed over at
    most ``min(E, rows)`` non-empty experts that is at most ``cdiv(rows, block_m) + min(E, rows)``.
    Grids are sized from this bound, never from device values.
    """
    return -(-num_rows // block_m) + min(num_experts, num_rows)


@dataclass(frozen=True)
class DispatchPlan:
    """Where each (token, slot) pair goes in expert-sorted ("permuted") order, and the GEMM tiles over it.

    Rows are the M·K expanded pairs ``t * K + k``. Pairs whose id lies in [0, E) are sorted by expert,
    stably (within an expert, by expanded index), into rows ``0 .. n_valid - 1`` of the permuted order;
    other ids (-1 for padded tokens, experts on another rank, fused shared slots) get no row. All tensors
    are int32 on the ids' device; the plan is built without a host sync, so ``n_valid`` stays on the device
    as ``expert_offsets[E]``.

    Example, E = 3, K = 2, block_m = 2, ids = [[2, 0], [0, -1], [2, 0]] (expanded pairs 0..5):

    - expert_offsets        = [0, 3, 3, 5]           expert 0 has rows 0..2, expert 1 none, expert 2 rows 3..4
    - permuted_to_expanded  = [1, 2, 5, 0, 4, -1]    row 0 is pair 1 (token 0, slot 1), ...; row 5 is unused
    - expanded_to_permuted  = [3, 0, 1, -1, 4, 2]    pair 3 (token 1, slot 1, id -1) has no row
    - tile_expert           = [0, 0, 2, -1, -1, -1]  T_max = cdiv(6, 2) + min(3, 6) = 6
    - tile_row_start        = [0, 2, 3, -1, -1, -1]  tile 1 covers row 2 only (row 3 belongs to expert 2)
    """

    num_experts: int  # E: experts of this rank; ids outside [0, E) get no row
    top_k: int  # K: slots per token; expanded index = token * K + slot
    block_m: int  # rows per GEMM tile, the experts' BLOCK_M
    expert_offsets: torch.Tensor  # int32 [E+1]: expert e owns permuted rows [off[e], off[e+1]); off[E] = n_valid
    permuted_to_expanded: torch.Tensor  # int32 [M*K]: expanded index of permuted row p; -1 for p >= n_valid
    expanded_to_permuted: torch.Tensor  # int32 [M*K]: permuted row of expanded index i; -1 when it has none
    tile_expert: torch.Tensor  # int32 [T_max]: expert of GEMM tile j; -1 for unused tiles (programs exit)
    tile_row_start: torch.Tensor  # int32 [T_max]: first permuted row of tile j; -1 for unused tiles

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "block_m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DispatchPlan.{name} must be a positive int, got {value!r}")
        rows = self.permuted_to_expanded.shape[0] if self.permuted_to_expanded.dim() == 1 else -1
        shapes = {
            "expert_offsets": (self.num_experts + 1,),
            "permuted_to_expanded": (rows,),
            "expanded_to_permuted": (rows,),
            "tile_expert": (max_tiles(max(rows, 0), self.num_experts, self.block_m),),
            "tile_row_start": (max_tiles(max(rows, 0), self.num_experts, self.block_m),),
        }
        device = self.expert_offsets.device
        for name, shape in shapes.items():
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"DispatchPlan.{name} must be a torch.Tensor, got {type(value).__name__}")
            if value.dtype != torch.int32:
                raise TypeError(f"DispatchPlan.{name} must be int32, got {value.dtype}")
            if tuple(value.shape) != shape:
                raise ValueError(f"DispatchPlan.{name} must have shape {shape}, got {tuple(value.shape)}")
            if value.device != device:
                raise ValueError(f"DispatchPlan.{name} is on {value.device}, expected {device}")
        if rows % self.top_k:
            raise ValueError(f"DispatchPlan has {rows} expanded rows, not a multiple of top_k = {self.top_k}")

    @property
    def num_rows(self) -> int:
        """M·K, the number of expanded (token, slot) pairs (an upper bound on the real rows)."""
        return self.permuted_to_expanded.shape[0]

    @property
    def num_tokens(self) -> int:
        """M."""
        return self.num_rows // self.top_k


def moe_dispatch_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> DispatchPlan:
    """Sort the (token, slot) pairs of ``topk_ids`` by expert and lay the GEMM tiles over the result.

    Args:
        topk_ids: [M, K] int32 or int64, any device. Ids outside [0, num_experts) produce no row.
        num_experts: E >= 1.
        block_m: rows per GEMM tile, >= 1.

    Returns:
        A :class:`DispatchPlan` on the ids' device. No host sync (no ``.item()``, no data-dependent shapes).

    Algorithm:
        1. Bin each pair: its expert when the id is in [0, E), else the overflow bin E.
        2. Stable-sort the bins: the order lists expanded indices expert by expert, overflow last.
        3. Count each bin (scatter_add) and take the exclusive prefix sum: the experts' segment offsets.
        4. Permuted row p < n_valid holds pair order[p]; the inverse map scatters p back to order[p].
        5. Tiles: expert e needs cdiv(count_e, block_m) tiles; tile j belongs to the first expert whose
           cumulative tile count exceeds j (searchsorted), and starts block_m rows per earlier tile of its
           expert past the expert's offset. Tiles past the total are unused (-1).
    """
    device = topk_ids.device
    num_rows = topk_ids.numel()
    ids = topk_ids.reshape(-1).long()
    # 1. bins
    bins = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    # 2. stable sort
    order = torch.sort(bins, stable=True).indices
    # 3. counts and offsets
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bins, torch.ones_like(bins))
    counts = counts[:num_experts]
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    # 4. both maps; `order` is a permutation, so the scatter writes every entry exactly once
    rows = torch.arange(num_rows, device=device)
    real = rows < offsets[num_experts]
    permuted_to_expanded = torch.where(real, order, -1)
    expanded_to_permuted = torch.empty_like(rows).scatter_(0, order, torch.where(real, rows, -1))
    # 5. tile schedule
    tiles_per_expert = (counts + block_m - 1) // block_m
    tiles_end = torch.cumsum(tiles_per_expert, 0)
    tile = torch.arange(max_tiles(num_rows, num_experts, block_m), device=device)
    expert = torch.searchsorted(tiles_end, tile, right=True)
    used = expert < num_experts
    owner = expert.clamp(max=num_experts - 1)
    first_tile = tiles_end[owner] - tiles_per_expert[owner]
    row_start = offsets[owner] + (tile - first_tile) * block_m
    return DispatchPlan(
        num_experts=num_experts,
        top_k=topk_ids.shape[1],
        block_m=block_m,
        expert_offsets=offsets.int(),
        permuted_to_expanded=permuted_to_expanded.int(),
        expanded_to_permuted=expanded_to_permuted.int(),
        tile_expert=torch.where(used, expert, -1).int(),
        tile_row_start=torch.where(used, row_start, -1).int(),
    )
