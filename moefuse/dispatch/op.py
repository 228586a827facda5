"""Public dispatch op ``moe_dispatch``: validation, backend choice, the torch custom op."""

from __future__ import annotations

import torch

from .. import _checks, _runtime
from .kernel import dispatch_triton
from .reference import DispatchPlan, max_tiles, moe_dispatch_torch

MAX_EXPERTS = 2048  # the kernels keep one int32 per expert (next power of two of E+1) in registers
MAX_BLOCK_M = 256


def moe_dispatch(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, backend: str = "auto") -> DispatchPlan:
    """Sort the (token, slot) pairs of ``topk_ids`` by expert (slot k of token t: ``topk_ids[t, k]``, its k-th
    routed choice) and schedule the experts' GEMM tiles.

    Args:
        topk_ids: [M, K] int32 or int64 expert ids from the router (M may be 0). Ids outside
            [0, num_experts) (-1 for padded tokens, experts on another rank, fused shared slots) get no row
            and a -1 slot; they are legitimate input, not an error.
        num_experts: E, the experts of this rank, 1 <= E <= 2048.
        block_m: rows per GEMM tile, a power of two in [16, 256] (16 is the smallest ``tl.dot`` tile).
            Use :func:`moefuse.experts.pick_block_m` so dispatch and experts agree on the tile height.
        backend: "auto" (Triton on CUDA, reference elsewhere), "triton" (CPU needs TRITON_INTERPRET=1) or
            "reference".

    Returns:
        A :class:`DispatchPlan` (int32 tensors on the ids' device); see its docstring for every field.
        Rows of one expert keep expanded-index order, so every backend returns the same plan, bit for bit.

    Raises:
        TypeError / ValueError naming the argument, before any allocation or launch.

    CUDA graphs and ``torch.compile``: no host sync; output shapes and grids depend only on M, K, E and
    block_m (the tile arrays have the static length ``cdiv(M*K, block_m) + min(E, M*K)``).
    Launches: one kernel for M*K <= 256, three above.
    """
    resolved = _validate(topk_ids, num_experts, block_m, backend)
    device = topk_ids.device
    num_rows = topk_ids.numel()
    num_tiles = max_tiles(num_rows, num_experts, block_m)
    plan = DispatchPlan(
        num_experts=num_experts,
        top_k=topk_ids.shape[1],
        block_m=block_m,
        expert_offsets=torch.empty(num_experts + 1, dtype=torch.int32, device=device),
        permuted_to_expanded=torch.empty(num_rows, dtype=torch.int32, device=device),
        expanded_to_permuted=torch.empty(num_rows, dtype=torch.int32, device=device),
        tile_expert=torch.empty(num_tiles, dtype=torch.int32, device=device),
        tile_row_start=torch.empty(num_tiles, dtype=torch.int32, device=device),
    )
    op = _dispatch_impl if _runtime.direct_call() else torch.ops.moefuse.dispatch
    op(
        topk_ids, num_experts, block_m, _runtime.pdl_enabled(None, device), resolved,
        plan.expert_offsets, plan.permuted_to_expanded, plan.expanded_to_permuted,
        plan.tile_expert, plan.tile_row_start,
    )
    return plan


def _validate(topk_ids: object, num_experts: object, block_m: object, backend: str) -> str:
    """All checks of ``moe_dispatch``, before any allocation or launch; returns the resolved backend."""
    topk_ids = _checks.check_tensor("topk_ids", topk_ids, dtypes=(torch.int32, torch.int64), ndim=2)
    if topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must have at least one slot per token, got shape {tuple(topk_ids.shape)}")
    if topk_ids.numel() >= 2**31 // 2:
        raise ValueError(f"topk_ids has {topk_ids.numel()} pairs; int32 row indices need fewer than 2**30")
    _checks.check_int("num_experts", num_experts, low=1, high=MAX_EXPERTS)
    block_m = _checks.check_int("block_m", block_m, low=16, high=MAX_BLOCK_M)
    if block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    return _runtime.resolve_backend(backend, topk_ids.device)


def _dispatch_impl(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    use_pdl: bool,
    backend: str,
    expert_offsets: torch.Tensor,
    permuted_to_expanded: torch.Tensor,
    expanded_to_permuted: torch.Tensor,
    tile_expert: torch.Tensor,
    tile_row_start: torch.Tensor,
) -> None:
    """Compute the plan into the given tensors; arguments were validated and ``backend`` resolved."""
    outputs = (expert_offsets, permuted_to_expanded, expanded_to_permuted, tile_expert, tile_row_start)
    if backend == "triton":
        dispatch_triton(topk_ids, num_experts, block_m, *outputs, use_pdl=use_pdl)
        return
    plan = moe_dispatch_torch(topk_ids, num_experts, block_m)
    results = (plan.expert_offsets, plan.permuted_to_expanded, plan.expanded_to_permuted,
               plan.tile_expert, plan.tile_row_start)
    for dst, src in zip(outputs, results):
        dst.copy_(src)


_dispatch_op = torch.library.custom_op(
    "moefuse::dispatch", _dispatch_impl,
    mutates_args=("expert_offsets", "permuted_to_expanded", "expanded_to_permuted", "tile_expert", "tile_row_start"),
)


@_dispatch_op.register_fake
def _(topk_ids, num_experts, block_m, use_pdl, backend, expert_offsets, permuted_to_expanded,
      expanded_to_permuted, tile_expert, tile_row_start) -> None:
    return None
