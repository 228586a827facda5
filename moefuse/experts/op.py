"""Public experts op ``moe_experts``: validation, backend and tile choice, the torch custom op."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, cast

import torch

from .. import _checks, _runtime
from ..dispatch import DispatchPlan
from ..formats import MXFP4, BlockFP8, ExpertWeight, QuantizedWeight, tile_dtype
from . import configs
from .configs import GemmTiles
from .fp8 import experts_fp8
from .kernel import gemm1_swiglu, gemm2
from .mxfp4 import experts_mxfp4
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
            weight format of that shape (then ``down_proj`` the same format): :class:`moefuse.formats.BlockFP8`
            with bf16 or fp16 hidden (W8A8, the activations quantized on the fly, SPEC §5), or
            :class:`moefuse.formats.MXFP4` with bf16 hidden (W4A16, SPEC §6; on Hopper, from 512 tokens in
            128-row tiles, W4A8: fp8 activations and exactly converted weights, ``experts/mxfp4_w4a8.py``).
        down_proj: [E, H, I] of hidden's dtype, or the format of ``gate_up_proj``.
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
    num_tokens, hidden_size, width, resolved = _validate(
        hidden, gate_up_proj, down_proj, plan, swiglu_limit, out, backend
    )
    op: Callable[..., None]  # arity per format: the weights' tensors are spread into its arguments
    weights: tuple[torch.Tensor, ...]
    if isinstance(gate_up_proj, torch.Tensor):
        op = cast(Callable[..., None], _experts_impl if _runtime.direct_call() else torch.ops.moefuse.experts)
        weights = (gate_up_proj, cast(torch.Tensor, down_proj))
    else:
        down = cast(QuantizedWeight, down_proj)  # the same format (checked)
        op = _FORMATS[type(gate_up_proj)].op()
        weights = (gate_up_proj.values, gate_up_proj.scales, down.values, down.scales)
    device = hidden.device
    if out is None:
        out = torch.empty(plan.num_rows, hidden_size, dtype=hidden.dtype, device=device)
    config = configs.pick(num_tokens, gate_up_proj.shape[0], hidden_size, width, plan.top_k,
                          tile_dtype(gate_up_proj, hidden.dtype), configs.arch_of(device), block_m=plan.block_m)
    op(
        hidden, *weights,
        plan.expert_offsets, plan.permuted_to_expanded, plan.expanded_to_permuted,
        plan.tile_expert, plan.tile_row_start, plan.top_k, plan.block_m,
        None if swiglu_limit is None else float(swiglu_limit),
        _tiles_to_list(config.gemm1) + _tiles_to_list(config.gemm2),
        _runtime.pdl_enabled(None, device), resolved, out,
    )
    return out


def _check_weights(hidden: torch.Tensor, gate_up_proj: object, down_proj: object) -> tuple[int, int, int]:
    """Both expert weights: plain tensors of hidden's dtype, or one format with activations it takes (the format
    checked its own tensors when built). Returns (E, 2I, H) as the weights say."""
    device = hidden.device
    if not isinstance(gate_up_proj, QuantizedWeight):  # plain tensors (or a wrong type, which check_tensor names)
        tensor = _checks.check_tensor("gate_up_proj", gate_up_proj, dtypes=(hidden.dtype,), ndim=3, device=device)
        _checks.check_tensor("down_proj", down_proj, dtypes=(hidden.dtype,), ndim=3, device=device)
        E, N, K = tensor.shape
        return E, N, K
    fmt = _FORMATS[type(gate_up_proj)]
    if type(down_proj) is not type(gate_up_proj):
        raise TypeError(f"down_proj must be a {type(gate_up_proj).__name__} like gate_up_proj, got "
                        f"{type(down_proj).__name__}")
    _checks.check_tensor(f"hidden (with {type(gate_up_proj).__name__} weights)", hidden, dtypes=fmt.activations)
    for name, weight in (("gate_up_proj", gate_up_proj), ("down_proj", cast(QuantizedWeight, down_proj))):
        if weight.device != device:
            raise ValueError(f"{name} is on {weight.device}, expected {device} like hidden")
    E, N, K = gate_up_proj.shape
    return E, N, K


def _validate(
    hidden: object,
    gate_up_proj: object,
    down_proj: object,
    plan: object,
    swiglu_limit: object,
    out: object,
    backend: str,
) -> tuple[int, int, int, str]:
    """All checks of ``moe_experts``, before any allocation or launch; returns (M, H, I, backend)."""
    hidden = _checks.check_tensor("hidden", hidden, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    device = hidden.device
    num_tokens, hidden_size = hidden.shape
    num_experts, two_width, weight_h = _check_weights(hidden, gate_up_proj, down_proj)
    if two_width == 0 or two_width % 2:
        raise ValueError(f"gate_up_proj must be [E, 2I, H] with 2I even and > 0, got shape "
                         f"{(num_experts, two_width, weight_h)}")
    if weight_h != hidden_size:
        raise ValueError(f"gate_up_proj has H = {weight_h} in dim 2 but hidden has H = {hidden_size}")
    if hidden_size == 0:
        raise ValueError("hidden must have H >= 1 columns")
    width = two_width // 2
    down_shape = tuple(cast(ExpertWeight, down_proj).shape)  # a tensor or gate_up_proj's format (checked)
    if down_shape != (num_experts, hidden_size, width):
        raise ValueError(f"down_proj must be [E, H, I] = {(num_experts, hidden_size, width)}, got shape "
                         f"{down_shape}")
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


@dataclass(frozen=True)
class _Format:
    """What the op needs of a weight format: the activation dtypes it takes and its custom op (the kernels'
    launcher and the reference behind one signature: hidden, values and scales of both weights, the plan...)."""

    activations: tuple[torch.dtype, ...]
    name: str
    impl: Callable[..., None]

    def op(self) -> Callable[..., None]:
        """The eager direct call, or the registered custom op where tracing needs it."""
        return self.impl if _runtime.direct_call() else getattr(torch.ops.moefuse, self.name)


def _format(cls: type[QuantizedWeight], name: str, activations: tuple[torch.dtype, ...], launch: Callable[..., None],
            reference: Callable[..., torch.Tensor]) -> _Format:
    """Register ``moefuse::<name>``: the experts on weights of format ``cls`` (Triton ``launch`` or ``reference``)."""

    def impl(
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
        plan = DispatchPlan(gate_up_values.shape[0], top_k, block_m, expert_offsets, permuted_to_expanded,
                            expanded_to_permuted, tile_expert, tile_row_start)
        gate_up, down = cls.unchecked(gate_up_values, gate_up_scales), cls.unchecked(down_values, down_scales)
        if backend != "triton":
            reference(hidden, gate_up, down, plan, swiglu_limit=swiglu_limit, out=out)
            return
        launch(hidden, gate_up, down, plan, out, GemmTiles(*tiles[:5]), GemmTiles(*tiles[5:]), swiglu_limit,
               use_pdl=use_pdl)

    impl.__name__ = impl.__qualname__ = f"_{name}_impl"
    op = torch.library.custom_op(f"moefuse::{name}", impl, mutates_args=("out",))
    op.register_fake(lambda *args: None)
    return _Format(activations, name, impl)


_FORMATS = {
    BlockFP8: _format(BlockFP8, "experts_fp8", (torch.bfloat16, torch.float16), experts_fp8, moe_experts_fp8_torch),
    MXFP4: _format(MXFP4, "experts_mxfp4", (torch.bfloat16,), experts_mxfp4, moe_experts_torch),
}


@_experts_op.register_fake
def _(hidden, gate_up_proj, down_proj, expert_offsets, permuted_to_expanded, expanded_to_permuted, tile_expert,
      tile_row_start, top_k, block_m, swiglu_limit, tiles, use_pdl, backend, out) -> None:
    return None
