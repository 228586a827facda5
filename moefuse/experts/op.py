"""Public experts op ``moe_experts``: validation, backend and tile choice, the torch custom op."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks, _runtime
from ..dispatch import DispatchPlan
from ..formats import BlockFP8, ExpertWeight
from . import configs
from .configs import GemmTiles
from .fp8 import experts_fp8
from .kernel import gemm1_swiglu, gemm2
from .reference import moe_experts_fp8_torch, moe_experts_torch


def moe_experts(
    hidden: torch.Tensor,
    gate_up_proj: ExpertWeight,
    down_proj: ExpertWeight,
    plan: DispatchPlan,
    *,
    swiglu_limit: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs on the rows of a dispatch plan: GEMM1 + SwiGLU, then GEMM2.

    Row p of the result (permuted order) holds ``down(SiLU(gate(x)) * up(x))`` of the expert owning row p,
    x = ``hidden[plan.permuted_to_expanded[p] // K]``; with ``swiglu_limit`` the gate is clamped to
    ``<= limit`` and up to ``[-limit, limit]`` first. Routing weights are not applied (finalize does that,
    reading rows through ``plan.expanded_to_permuted``).

    Args:
        hidden: [M, H] bf16, fp16 or fp32 activations, any strides.
        gate_up_proj: [E, 2I, H] of hidden's dtype, gate rows 0..I-1 then up rows (Hugging Face layout); or a
            :class:`moefuse.formats.BlockFP8` of that shape (then ``down_proj`` too, and hidden bf16 or fp16:
            W8A8 with the activations quantized on the fly, SPEC §5).
        down_proj: [E, H, I] of hidden's dtype, or a ``BlockFP8``.
        plan: from :func:`moefuse.dispatch.moe_dispatch` for these M tokens (M·K rows) and E experts, on
            hidden's device; its ``block_m`` is the GEMMs' tile height.
        swiglu_limit: None, or a finite number > 0 (DeepSeek-V4: 10).
        out: optional [M·K, H] of hidden's dtype to write into.
        backend: "auto" (Triton on CUDA, reference elsewhere), "triton" (CPU needs TRITON_INTERPRET=1) or
            "reference".

    Returns:
        ``out`` [M·K, H], hidden's dtype and device. Rows at or past n_valid = ``plan.expert_offsets[E]``
        (pairs with no expert here) are left unwritten; finalize never reads them.

    Raises:
        TypeError / ValueError naming the argument, before any allocation or launch.

    Numerics (Triton): fp32 accumulation, the intermediate rounded once to hidden's dtype, the output
    rounded once. Tiles: :func:`moefuse.experts.configs.pick` (tuned tables, heuristic fallback, overrides).
    CUDA graphs: capturable, no host sync; grids depend only on shapes and the plan's static tile count.
    """
    if isinstance(gate_up_proj, BlockFP8) or isinstance(down_proj, BlockFP8):
        num_tokens, hidden_size, width, resolved = _validate_fp8(
            hidden, gate_up_proj, down_proj, plan, swiglu_limit, out, backend
        )
        op = _experts_fp8_impl if _runtime.direct_call() else torch.ops.moefuse.experts_fp8
        weights = (gate_up_proj.values, gate_up_proj.scales, down_proj.values, down_proj.scales)
    else:
        num_tokens, hidden_size, width, resolved = _validate(
            hidden, gate_up_proj, down_proj, plan, swiglu_limit, out, backend
        )
        op = _experts_impl if _runtime.direct_call() else torch.ops.moefuse.experts
        weights = (gate_up_proj, down_proj)
    device = hidden.device
    if out is None:
        out = torch.empty(plan.num_rows, hidden_size, dtype=hidden.dtype, device=device)
    config = configs.pick(num_tokens, gate_up_proj.shape[0], hidden_size, width, plan.top_k, hidden.dtype,
                          configs.arch_of(device), block_m=plan.block_m)
    op(
        hidden, *weights,
        plan.expert_offsets, plan.permuted_to_expanded, plan.expanded_to_permuted,
        plan.tile_expert, plan.tile_row_start, plan.top_k, plan.block_m,
        None if swiglu_limit is None else float(swiglu_limit),
        _tiles_to_list(config.gemm1) + _tiles_to_list(config.gemm2),
        _runtime.pdl_enabled(None, device), resolved, out,
    )
    return out


def _validate_fp8(hidden, gate_up_proj, down_proj, plan, swiglu_limit, out, backend) -> tuple[int, int, int, str]:
    """The checks of ``moe_experts`` on :class:`BlockFP8` weights: both weights fp8, bf16/fp16 activations, then
    :func:`_validate` on the values, and the scales on hidden's device."""
    for name, weight in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if not isinstance(weight, BlockFP8):
            raise TypeError(f"{name} must be a BlockFP8 like the other expert weight, got {type(weight).__name__}")
    _checks.check_tensor("hidden", hidden, dtypes=(torch.bfloat16, torch.float16), ndim=2)
    checked = _validate(hidden, gate_up_proj.values, down_proj.values, plan, swiglu_limit, out, backend,
                        weight_dtype=None)
    for name, weight in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if weight.scales.device != hidden.device:
            raise ValueError(f"{name}.scales is on {weight.scales.device}, expected {hidden.device}")
    return checked


def _validate(
    hidden: object,
    gate_up_proj: object,
    down_proj: object,
    plan: object,
    swiglu_limit: object,
    out: object,
    backend: str,
    *,
    weight_dtype: object = "hidden",
) -> tuple[int, int, int, str]:
    """All checks of ``moe_experts``, before any allocation or launch; returns (M, H, I, backend).

    The weights must have hidden's dtype (``weight_dtype="hidden"``) or are values already checked (None: fp8).
    """
    hidden = _checks.check_tensor("hidden", hidden, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    device = hidden.device
    num_tokens, hidden_size = hidden.shape
    dtypes = (hidden.dtype,) if weight_dtype == "hidden" else None
    gate_up_proj = _checks.check_tensor("gate_up_proj", gate_up_proj, dtypes=dtypes, ndim=3, device=device)
    num_experts, two_width, weight_h = gate_up_proj.shape
    if two_width == 0 or two_width % 2:
        raise ValueError(f"gate_up_proj must be [E, 2I, H] with 2I even and > 0, got shape {tuple(gate_up_proj.shape)}")
    if weight_h != hidden_size:
        raise ValueError(f"gate_up_proj has H = {weight_h} in dim 2 but hidden has H = {hidden_size}")
    if hidden_size == 0:
        raise ValueError("hidden must have H >= 1 columns")
    width = two_width // 2
    _checks.check_tensor(
        "down_proj", down_proj, dtypes=dtypes, shape=(num_experts, hidden_size, width), device=device
    )
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan must be a moefuse.dispatch.DispatchPlan, got {type(plan).__name__}")
    if plan.num_experts != num_experts:
        raise ValueError(f"plan was built for {plan.num_experts} experts but gate_up_proj holds {num_experts}")
    if plan.num_rows != num_tokens * plan.top_k:
        raise ValueError(
            f"plan has {plan.num_rows} rows (M*K) but hidden has M = {num_tokens} tokens and plan.top_k = {plan.top_k}"
        )
    if plan.expert_offsets.device != device:
        raise ValueError(f"plan is on {plan.expert_offsets.device}, expected {device} like hidden")
    if swiglu_limit is not None:
        if isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float)):
            raise TypeError(f"swiglu_limit must be None or a number, got {type(swiglu_limit).__name__}")
        if not (math.isfinite(swiglu_limit) and swiglu_limit > 0):
            raise ValueError(f"swiglu_limit must be finite and > 0, got {swiglu_limit}")
    if out is not None:
        out = _checks.check_tensor(
            "out", out, dtypes=(hidden.dtype,), shape=(plan.num_rows, hidden_size), device=device
        )
        if any(size > 1 and stride == 0 for size, stride in zip(out.shape, out.stride())):
            raise ValueError(f"out must not have overlapping elements, got strides {out.stride()} (an expanded view?)")
    return num_tokens, hidden_size, width, _runtime.resolve_backend(backend, device)


def _tiles_to_list(tiles: GemmTiles) -> list[int]:
    return [tiles.block_n, tiles.block_k, tiles.group_m, tiles.num_warps, tiles.num_stages]


def _experts_impl(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    expert_offsets: torch.Tensor,
    permuted_to_expanded: torch.Tensor,
    expanded_to_permuted: torch.Tensor,
    tile_expert: torch.Tensor,
    tile_row_start: torch.Tensor,
    top_k: int,
    block_m: int,
    swiglu_limit: Optional[float],
    tiles: list[int],
    use_pdl: bool,
    backend: str,
    out: torch.Tensor,
) -> None:
    """Compute into ``out``; arguments were validated, backend and tiles chosen by the public wrapper.

    ``tiles`` is GEMM1's then GEMM2's (block_n, block_k, group_m, num_warps, num_stages).
    """
    plan = DispatchPlan(gate_up_proj.shape[0], top_k, block_m, expert_offsets, permuted_to_expanded,
                        expanded_to_permuted, tile_expert, tile_row_start)
    if backend != "triton":
        moe_experts_torch(hidden, gate_up_proj, down_proj, plan, swiglu_limit=swiglu_limit, out=out)
        return
    intermediate = torch.empty(plan.num_rows, gate_up_proj.shape[1] // 2, dtype=hidden.dtype, device=hidden.device)
    gemm1_swiglu(hidden, gate_up_proj, plan, intermediate, GemmTiles(*tiles[:5]), swiglu_limit, use_pdl=use_pdl)
    gemm2(intermediate, down_proj, plan, out, GemmTiles(*tiles[5:]), use_pdl=use_pdl)


_experts_op = torch.library.custom_op("moefuse::experts", _experts_impl, mutates_args=("out",))


def _experts_fp8_impl(
    hidden: torch.Tensor,
    gate_up_values: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_values: torch.Tensor,
    down_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    permuted_to_expanded: torch.Tensor,
    expanded_to_permuted: torch.Tensor,
    tile_expert: torch.Tensor,
    tile_row_start: torch.Tensor,
    top_k: int,
    block_m: int,
    swiglu_limit: Optional[float],
    tiles: list[int],
    use_pdl: bool,
    backend: str,
    out: torch.Tensor,
) -> None:
    """Compute into ``out`` on fp8 block-scale weights (validated by the wrapper)."""
    plan = DispatchPlan(gate_up_values.shape[0], top_k, block_m, expert_offsets, permuted_to_expanded,
                        expanded_to_permuted, tile_expert, tile_row_start)
    gate_up, down = BlockFP8(gate_up_values, gate_up_scales), BlockFP8(down_values, down_scales)
    if backend != "triton":
        moe_experts_fp8_torch(hidden, gate_up, down, plan, swiglu_limit=swiglu_limit, out=out)
        return
    experts_fp8(hidden, gate_up, down, plan, out, GemmTiles(*tiles[:5]), GemmTiles(*tiles[5:]), swiglu_limit,
                use_pdl=use_pdl)


_experts_fp8_op = torch.library.custom_op("moefuse::experts_fp8", _experts_fp8_impl, mutates_args=("out",))


@_experts_fp8_op.register_fake
def _(*args) -> None:
    return None


@_experts_op.register_fake
def _(hidden, gate_up_proj, down_proj, expert_offsets, permuted_to_expanded, expanded_to_permuted, tile_expert,
      tile_row_start, top_k, block_m, swiglu_limit, tiles, use_pdl, backend, out) -> None:
    return None
