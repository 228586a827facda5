"""Public experts op ``moe_experts``: validation, backend and tile choice, the torch custom op."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Literal, Optional, Union, cast

import torch

from .. import _checks, _runtime
from ..dispatch import DispatchPlan, moe_dispatch
from ..formats import MXFP4, BlockFP8, ExpertWeight, QuantizedWeight, resolve_activation_quant, tile_dtype
from . import configs
from . import persistent as _persistent
from .bf16 import gemm1_swiglu, gemm2
from .configs import Arch, GemmTiles, pick_block_m
from .fp8 import experts_fp8
from .fp8 import kernels as fp8_kernels
from .fp8 import mlp as fp8_mlp
from .mxfp4 import experts_mxfp4
from .mxfp4 import w4a8 as mxfp4_w4a8
from .mxfp4 import w4a8_decode as mxfp4_w4a8_decode
from .mxfp4 import ws as mxfp4_ws
from .reference import moe_experts_fp8_torch, moe_experts_torch, moe_experts_w4a8_torch


def moe_experts(
    hidden: torch.Tensor,
    gate_up_proj: ExpertWeight,
    down_proj: ExpertWeight,
    plan: DispatchPlan,
    *,
    swiglu_limit: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    activation_quant: Optional[str] = "default",
    backend: str = "auto",
    workspace: Optional[torch.Tensor] = None,
    batch_invariant: Optional[bool] = None,
    persistent: Optional[str] = None,
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
            :class:`moefuse.formats.MXFP4` with bf16 hidden (W4A16, SPEC §6; W4A8 with ``activation_quant="fp8"``).
        down_proj: [E, H, I] of hidden's dtype, or the format of ``gate_up_proj``.
        plan: from :func:`moefuse.dispatch.moe_dispatch` for these M tokens (M·K rows) and E experts, on
            hidden's device; its ``block_m`` is the GEMMs' tile height.
        swiglu_limit: None, or a finite number > 0 (DeepSeek-V4: 10).
        out: optional [M·K, H] of hidden's dtype to write into.
        activation_quant: the activations' precision, the same at every token count (so a token's output never
            depends on its batch): ``"default"``, the format's own (plain tensors and MXFP4: unquantized; BlockFP8:
            "fp8"); None, unquantized (plain tensors; MXFP4, W4A16); or ``"fp8"``, e4m3 per token and 128 columns
            (SPEC §5: BlockFP8, W8A8; MXFP4, W4A8 with exactly converted weights, ``experts/mxfp4/w4a8.py``, on
            Hopper with H and I multiples of 128 and ``plan.block_m`` 128: :func:`plan_block_m` gives it). The
            reference backend computes the same numerics at every size.
        backend: "auto" (Triton on CUDA, reference elsewhere), "triton" (CPU needs TRITON_INTERPRET=1) or
            "reference".
        workspace: None, or :func:`experts_workspace`'s int32 zeros on hidden's device: the counters in which fp8
            block-scale GEMM1 split along K (a token or two) counts its runs' arrivals, leaving them zeroed, so
            that the call launches no kernel to zero them. Give each caller its own (a layer): calls in flight at
            the same time, on different streams, must not share one; calls one after another on a stream may.
        batch_invariant: None (the process default, ``moefuse.set_defaults``), or True for sums in one order at
            every plan size: 16-bit and fp8 GEMMs run wgmma on every tile height (shorter tiles swapped), fp8 GEMM1
            is split along K the same way at every size (a lone expert in ``FP8_LONE_SPLIT`` runs, off the
            persistent kernels; routed experts never: ``fp8.kernels.invariant_split_k``), and fp32 weights need a
            plan of ``block_m`` >= 32 (``plan_block_m(...,
            batch_invariant=True)`` gives it). A row's output is then the same bits in any batch (docs/USAGE.md,
            batch invariance).
        persistent: None (the process default), or "auto" / "all" / "none": which persistent prefill kernels run
            where they apply (``experts/persistent.py``; "auto": the fp8 ones).

    Returns:
        ``out`` [M·K, H], hidden's dtype and device. Rows at or past n_valid = ``plan.expert_offsets[E]``
        (pairs with no expert here) are left unwritten; finalize never reads them.

    Raises:
        TypeError / ValueError naming the argument, before any allocation or launch.

    Numerics (Triton): fp32 accumulation, the intermediate rounded once to hidden's dtype, the output
    rounded once. Tiles: :func:`moefuse.experts.configs.pick` (tuned tables, heuristic fallback, overrides).
    CUDA graphs: capturable, no host sync; grids depend only on shapes and the plan's static tile count.
    """
    num_tokens, hidden_size, width, quant, resolved = _validate(
        hidden, gate_up_proj, down_proj, plan, swiglu_limit, out, activation_quant, backend, workspace
    )
    invariant = _runtime.batch_invariant(batch_invariant)
    if invariant and plan.block_m < invariant_rows(gate_up_proj, hidden.dtype):
        raise ValueError(f"batch_invariant=True needs a plan of block_m >= {invariant_rows(gate_up_proj, hidden.dtype)}"
                         f" (one MMA family at every size; plan_block_m(..., batch_invariant=True) gives it), got "
                         f"block_m = {plan.block_m}")
    flags = [int(_runtime.persistent_enabled(not isinstance(gate_up_proj, torch.Tensor), persistent)),
             int(invariant)]  # persistent kernels allowed; the batch-invariant order
    op: Callable[..., None]  # arity per format: the weights' tensors are spread into its arguments
    weights: tuple[torch.Tensor, ...]
    counters: tuple[Optional[torch.Tensor], ...]  # the formats' ops take the workspace; the bf16 kernels never split
    if isinstance(gate_up_proj, torch.Tensor):
        op = cast(Callable[..., None], _experts_impl if _runtime.direct_call() else torch.ops.moefuse.experts)
        weights, counters = (gate_up_proj, cast(torch.Tensor, down_proj)), ()
    else:
        down = cast(QuantizedWeight, down_proj)  # the same format (checked)
        op = _FORMATS[(type(gate_up_proj), quant)].op()
        weights, counters = (gate_up_proj.values, gate_up_proj.scales, down.values, down.scales), (workspace,)
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
        _runtime.pdl_enabled(None, device), resolved, flags, *counters, out,
    )
    return out


def invariant_rows(gate_up_proj: ExpertWeight, hidden_dtype: torch.dtype) -> int:
    """The least plan height of batch-invariant experts: 32 for fp32, whose tiles are at most 32 rows (FMA products:
    one tile shape at every size); none for 16-bit and fp8 block-scale weights, whose tiles under 64 rows then run
    swapped wgmma (``bf16.swapped``, ``experts_fp8(wgmma=True)``: a row has the bits of a 64-row tile), nor for
    MXFP4, whose rows have the same bits on every height and kernel (W4A8's decode and 128-row kernels sum in one
    K order)."""
    return 32 if tile_dtype(gate_up_proj, hidden_dtype) == torch.float32 else 0


# Counters in a workspace: GEMM1 split along K needs one per program of its unsplit grid, and is split only where
# that grid fills at most two programs an SM (``configs.fp8_split_k``): 2 · SMs, for GPUs of up to 512 SMs.
WORKSPACE_SIZE = 1024


def experts_workspace(device: Union[torch.device, str, None] = None) -> torch.Tensor:
    """A workspace for :func:`moe_experts` (``workspace=``): ``WORKSPACE_SIZE`` int32 zeros, which the kernels that
    count in it leave zeroed. A split too large for it (``split_k`` given by hand) zeroes counters of its own."""
    return torch.zeros(WORKSPACE_SIZE, dtype=torch.int32, device=device)


def _check_weights(hidden: torch.Tensor, gate_up_proj: object, down_proj: object) -> tuple[int, int, int]:
    """Both expert weights: plain tensors of hidden's dtype, or one format with activations it takes (the format
    checked its own tensors when built). Returns (E, 2I, H) as the weights say."""
    device = hidden.device
    if not isinstance(gate_up_proj, QuantizedWeight):  # plain tensors (or a wrong type, which check_tensor names)
        tensor = _checks.check_tensor("gate_up_proj", gate_up_proj, dtypes=(hidden.dtype,), ndim=3, device=device)
        _checks.check_tensor("down_proj", down_proj, dtypes=(hidden.dtype,), ndim=3, device=device)
        E, N, K = tensor.shape
        return E, N, K
    if type(down_proj) is not type(gate_up_proj):
        raise TypeError(f"down_proj must be a {type(gate_up_proj).__name__} like gate_up_proj, got "
                        f"{type(down_proj).__name__}")
    _checks.check_tensor(f"hidden (with {type(gate_up_proj).__name__} weights)", hidden,
                         dtypes=gate_up_proj.activation_dtypes)
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
    activation_quant: object,
    backend: str,
    workspace: object = None,
) -> tuple[int, int, int, Optional[str], str]:
    """All checks of ``moe_experts``, before any allocation or launch; returns (M, H, I, activation precision,
    backend)."""
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
    if workspace is not None:
        workspace = _checks.check_tensor("workspace", workspace, dtypes=(torch.int32,), ndim=1, device=device)
        if not workspace.is_contiguous():
            raise ValueError(f"workspace must be contiguous, got strides {workspace.stride()}")
    quant = resolve_activation_quant(cast(ExpertWeight, gate_up_proj), activation_quant)
    resolved = _runtime.resolve_backend(backend, device)
    if resolved == "triton" and device.type == "cuda" and not _runtime.interpreting():
        check_gpu(cast(ExpertWeight, gate_up_proj), quant, _runtime.gpu(device))
    if isinstance(gate_up_proj, MXFP4) and quant == "fp8" and resolved == "triton":
        _check_w4a8(hidden, gate_up_proj, cast(MXFP4, down_proj), plan)
    return num_tokens, hidden_size, width, quant, resolved


# fp8 operands of the tensor cores (W8A8, W4A8): Ada (sm_89) and later.
FP8_MMA = (8, 9)


def check_gpu(gate_up_proj: ExpertWeight, activation_quant: Optional[str], gpu: _runtime.GPU) -> None:
    """Refuse, naming the argument, a format whose Triton kernels ``gpu`` cannot run: fp8 activations (fp8
    block-scale weights, or MXFP4 with ``activation_quant="fp8"``) need fp8 MMAs (sm_89 or later). Everything else
    runs on any GPU Triton supports; the Hopper-only kernels fall back to the ``tl`` ones elsewhere, except W4A8
    (``_check_w4a8``)."""
    if activation_quant == "fp8" and gpu.capability < FP8_MMA:
        raise ValueError(f"gate_up_proj: {type(gate_up_proj).__name__} weights with fp8 activations need fp8 tensor "
                         f"cores (compute capability >= {FP8_MMA[0]}.{FP8_MMA[1]}); {gpu.name} is "
                         f"{gpu.capability[0]}.{gpu.capability[1]}: use bf16 weights (or MXFP4 with "
                         f"activation_quant=None) or backend='reference'")


def check_experts_shapes(gate_up_proj: ExpertWeight, activation_quant: Optional[str]) -> None:
    """Refuse, naming ``activation_quant``, widths the Triton backend's kernels for this format and (resolved)
    activation precision cannot take on any device: for a layer to check when it is built."""
    E, two_width, H = gate_up_proj.shape
    if isinstance(gate_up_proj, MXFP4) and activation_quant == "fp8" and not mxfp4_w4a8.fits(
            mxfp4_w4a8.BLOCK_M, H, two_width // 2):
        raise ValueError(f"activation_quant='fp8' with MXFP4 weights (W4A8) needs H and I multiples of "
                         f"{mxfp4_w4a8.BLOCK_K}, got H = {H}, I = {two_width // 2}")


def _check_w4a8(hidden: torch.Tensor, gate_up: MXFP4, down: MXFP4, plan: DispatchPlan) -> None:
    """The W4A8 kernels are Gluon kernels for Hopper: refuse, naming the argument, what they cannot run."""
    check_experts_shapes(gate_up, "fp8")
    heights = sorted({*mxfp4_w4a8_decode.LAUNCH, mxfp4_w4a8.BLOCK_M})
    if plan.block_m not in heights:
        raise ValueError(f"activation_quant='fp8' with MXFP4 weights (W4A8) needs plan.block_m in {heights} "
                         f"(plan_block_m gives one), got block_m = {plan.block_m}")
    if not mxfp4_ws.ws_eligible(hidden, gate_up, down, plan):
        raise ValueError("activation_quant='fp8' with MXFP4 weights (W4A8) runs on Hopper (sm_90) only, compiled "
                         "(not under the interpreter), on weights whose tensors are contiguous; use "
                         "activation_quant=None (W4A16) or backend='reference' here")


def plan_block_m(
    num_tokens: int,
    gate_up_proj: ExpertWeight,
    top_k: int,
    hidden_dtype: torch.dtype,
    activation_quant: Optional[str] = "default",
    arch: Union[Arch, Literal["auto"]] = "auto",
    *,
    batch_invariant: Optional[bool] = None,
    persistent: Optional[str] = None,
) -> int:
    """The dispatch plan's ``block_m`` for ``moe_experts`` on these weights: the tile table's (``pick_block_m``);
    for MXFP4 with ``activation_quant="fp8"`` (W4A8) the table's where the decode kernels take it (16 and 32 rows,
    ``mxfp4/w4a8_decode.py``), else the 128-row kernels' (the same sums in the same order); for fp8
    block-scale on Hopper the persistent kernels' 128 rows where the GPU's table chose them (without a table: from
    ``persistent.FP8_MIN_TOKENS`` tokens) unless ``persistent`` turns them off. With ``batch_invariant`` (None:
    the process default) plans are at least :func:`invariant_rows` rows (32 for fp32 weights)."""
    quant = resolve_activation_quant(gate_up_proj, activation_quant)
    persistent = _runtime.persistent_arg(persistent)
    E, two_width, H = gate_up_proj.shape
    I = two_width // 2
    target = configs.resolve_arch(arch)
    dtype = tile_dtype(gate_up_proj, hidden_dtype)
    height = pick_block_m(num_tokens, E, H, I, top_k, dtype, target)  # cached: the table's, else the heuristic's
    if isinstance(gate_up_proj, MXFP4) and quant == "fp8":  # W4A16's height, where W4A8 has kernels of it
        return height if height in mxfp4_w4a8_decode.LAUNCH else mxfp4_w4a8.BLOCK_M
    invariant = _runtime.batch_invariant(batch_invariant)
    floor = invariant_rows(gate_up_proj, hidden_dtype) if invariant else 0
    if isinstance(gate_up_proj, BlockFP8):  # 128 rows are the persistent kernels' (the tl kernels' spill)
        tuned = configs.tuned(E, H, I, top_k, dtype, target)
        tall = height == _persistent.BLOCK_M if tuned else num_tokens >= _persistent.FP8_MIN_TOKENS
        splits = invariant and fp8_kernels.invariant_split_k(E) > 1  # at every size: not on the persistent kernels
        if tall and not splits and _persistent.runs_fp8(H, I, None if target is None else configs.gpu_of(target),
                                                        persistent):
            return _persistent.BLOCK_M
        if tuned and height == _persistent.BLOCK_M:  # the table's 128 rows where the persistent kernels do not run
            height = configs.heuristic(num_tokens, E, H, I, top_k, dtype, gpu=configs.gpu_of(target)).block_m
    return max(height, floor)


def launch_variant(gate_up_proj: ExpertWeight, num_rows: int, activation_quant: Optional[str],
                   batch_invariant: bool = False) -> tuple:
    """What besides the tiles decides which kernels ``moe_experts`` compiles for a plan of ``num_rows`` rows on these
    weights and (resolved) ``activation_quant``: the batch-invariant order (16-bit and fp8 GEMMs on wgmma at every
    tile height), fp8 block-scale's split of GEMM1 along K (none where ``batch_invariant``) or into gate and up
    halves (the columns each of their programs sums), MXFP4's W4A8 kernels. Warm-up keys on it."""
    if isinstance(gate_up_proj, BlockFP8):
        width, device = gate_up_proj.shape[1] // 2, gate_up_proj.values.device
        invariant_split = fp8_kernels.invariant_split_k(gate_up_proj.shape[0])
        split = invariant_split if batch_invariant else fp8_kernels.default_split_k(num_rows, width, device)
        halves = fp8_kernels.default_halves(num_rows, width, invariant_split if batch_invariant else None, device)
        return ("split_k", split, fp8_kernels.default_half_columns(num_rows, width, device) if halves else 0,
                "wgmma" if batch_invariant else "")
    if isinstance(gate_up_proj, MXFP4):
        return ("activations", activation_quant)
    return ("wgmma",) if batch_invariant else ()


def rows_linear(x: torch.Tensor, weight: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``x @ weight^T`` in x's dtype (x [M, K], weight [N, K] of x's dtype, any strides): the experts' GEMM2 kernel
    on one expert holding every row, tiles ``configs.WGMMA_MIN_ROWS`` tall (32 in fp32), so that a row's products
    are summed in one order at every M: the batch-invariant layer's dense projections (its shared expert), where
    cuBLAS would pick its kernel by M. The reference backend computes ``F.linear``."""
    M, K = x.shape
    N = weight.shape[0]
    resolved = _runtime.resolve_backend(backend, x.device)
    if resolved != "triton" or M == 0 or N == 0:
        return torch.nn.functional.linear(x, weight)
    tiles = rows_linear_tiles(M, weight, x.dtype, configs.arch_of(x.device))
    plan = moe_dispatch(torch.zeros(M, 1, dtype=torch.int32, device=x.device), 1, tiles.block_m, backend=resolved)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    gemm2(x, weight[None], plan, out, tiles.gemm2, use_pdl=_runtime.pdl_enabled(None, x.device))
    return out


def rows_linear_tiles(M: int, weight: torch.Tensor, dtype: torch.dtype, arch: Arch) -> configs.TileConfig:
    """The tiles :func:`rows_linear` launches for M rows of ``dtype`` times ``weight`` [N, K]^T on ``arch`` (warm-up
    keys on them): one expert holding every row, on plans of ``configs.WGMMA_MIN_ROWS`` rows (32 in fp32)."""
    N, K = weight.shape
    gpu = configs.gpu_of(arch)
    tiles = configs.heuristic(M, 1, N, K, 1, dtype, block_m=32 if dtype == torch.float32 else configs.WGMMA_MIN_ROWS,
                              gpu=gpu)
    # A few rows make one row of tiles, each program reading its columns' whole weight: narrower column blocks (to
    # 32) until every SM has a program. The width changes no row's sums: wgmma adds the same K steps in one order.
    block_n = configs.spread_columns(tiles.gemm2.block_n, -(-M // tiles.block_m), N, 32, gpu)
    if block_n == tiles.gemm2.block_n:
        return tiles
    return replace(tiles, gemm2=replace(tiles.gemm2, block_n=block_n, num_warps=4))


def mlp_on_cublas(num_tokens: int, weight_type: type, hidden_size: int, width: int, hidden_dtype: torch.dtype,
                  device: torch.device) -> bool:
    """Whether :func:`cublas_mlp` takes a one-expert MLP of ``width`` on ``num_tokens`` tokens with weights of
    ``weight_type`` rather than the grouped GEMMs: fp8 block-scale at prefill on Hopper (``fp8_mlp.takes``). A host
    decision on shapes alone. Plain weights are not asked: an ``nn.Linear`` runs them on cuBLAS already."""
    return weight_type is BlockFP8 and fp8_mlp.takes(num_tokens, hidden_size, width, hidden_dtype, device)


def cublas_mlp(x: torch.Tensor, gate_up_proj: ExpertWeight, down_proj: ExpertWeight,
               swiglu_limit: Optional[float]) -> torch.Tensor:
    """One expert's SwiGLU MLP on cuBLAS's GEMMs, where :func:`mlp_on_cublas` holds."""
    if not (isinstance(gate_up_proj, BlockFP8) and isinstance(down_proj, BlockFP8)):
        raise TypeError(f"cublas_mlp takes BlockFP8 weights, got {type(gate_up_proj).__name__}")
    return fp8_mlp.fp8_mlp(x, gate_up_proj, down_proj, swiglu_limit)


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
    flags: list[int],
    out: torch.Tensor,
) -> None:
    """Compute into ``out``; arguments were validated, backend and tiles chosen by the public wrapper.

    ``tiles`` is GEMM1's then GEMM2's (block_n, block_k, group_m, num_warps, num_stages); ``flags``: whether the
    persistent kernels may run, and whether the sums take the batch-invariant order.
    """
    plan = DispatchPlan(gate_up_proj.shape[0], top_k, block_m, expert_offsets, permuted_to_expanded,
                        expanded_to_permuted, tile_expert, tile_row_start)
    if backend != "triton":
        moe_experts_torch(hidden, gate_up_proj, down_proj, plan, swiglu_limit=swiglu_limit, out=out)
        return
    if flags[0] and _persistent.eligible(hidden, gate_up_proj, down_proj, plan, out):
        _persistent.experts_persistent(hidden, gate_up_proj, down_proj, plan, out, swiglu_limit)
        return
    intermediate = torch.empty(plan.num_rows, gate_up_proj.shape[1] // 2, dtype=hidden.dtype, device=hidden.device)
    invariant = bool(flags[1])
    gemm1_swiglu(hidden, gate_up_proj, plan, intermediate, GemmTiles(*tiles[:5]), swiglu_limit, use_pdl=use_pdl,
                 wgmma=invariant)
    gemm2(intermediate, down_proj, plan, out, GemmTiles(*tiles[5:]), use_pdl=use_pdl, wgmma=invariant)


_experts_op = torch.library.custom_op("moefuse::experts", _experts_impl, mutates_args=("out",))


@dataclass(frozen=True)
class _Format:
    """What the op needs of a weight format and activation precision: its custom op (the kernels' launcher and the
    reference behind one signature: hidden, values and scales of both weights, the plan...). The activation dtypes
    the format takes are the weight class's (``activation_dtypes``)."""

    name: str
    impl: Callable[..., None]

    def op(self) -> Callable[..., None]:
        """The eager direct call, or the registered custom op where tracing needs it."""
        return self.impl if _runtime.direct_call() else getattr(torch.ops.moefuse, self.name)


def _format(cls: type[QuantizedWeight], name: str, launch: Callable[..., None],
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
        flags: list[int],
        workspace: Optional[torch.Tensor],
        out: torch.Tensor,
    ) -> None:
        plan = DispatchPlan(gate_up_values.shape[0], top_k, block_m, expert_offsets, permuted_to_expanded,
                            expanded_to_permuted, tile_expert, tile_row_start)
        gate_up, down = cls.unchecked(gate_up_values, gate_up_scales), cls.unchecked(down_values, down_scales)
        if backend != "triton":
            reference(hidden, gate_up, down, plan, swiglu_limit=swiglu_limit, out=out)
            return
        launch(hidden, gate_up, down, plan, out, GemmTiles(*tiles[:5]), GemmTiles(*tiles[5:]), swiglu_limit,
               use_pdl=use_pdl, workspace=workspace, persistent=bool(flags[0]), batch_invariant=bool(flags[1]))

    impl.__name__ = impl.__qualname__ = f"_{name}_impl"
    op = torch.library.custom_op(f"moefuse::{name}", impl, mutates_args=("out", "workspace"))
    op.register_fake(lambda *args: None)
    return _Format(name, impl)


def _fp8(hidden: torch.Tensor, gate_up: BlockFP8, down: BlockFP8, plan: DispatchPlan, out: torch.Tensor,
         gemm1_tiles: GemmTiles, gemm2_tiles: GemmTiles, swiglu_limit: Optional[float], *,
         use_pdl: bool = False, workspace: Optional[torch.Tensor] = None, persistent: bool = True,
         batch_invariant: bool = False) -> None:
    """W8A8: the persistent kernels where they take the shapes (128-row plans on Hopper, which ``plan_block_m`` gives
    where they measured faster) unless ``persistent`` is off, else the ``tl`` kernels: GEMM1 split along K where
    ``fp8.kernels.default_split_k`` says, or with ``batch_invariant`` split as ``fp8.kernels.invariant_split_k``
    says at every size (a lone expert: never on the persistent kernels, which do not split) and on wgmma at every
    tile height (a row's sums those of the 64-row and persistent tiles)."""
    split = fp8_kernels.invariant_split_k(gate_up.shape[0]) if batch_invariant else None
    if persistent and split in (None, 1) and _persistent.eligible_fp8(hidden, gate_up, down, plan, out):
        _persistent.experts_persistent_fp8(hidden, gate_up, down, plan, out, swiglu_limit)
    else:
        experts_fp8(hidden, gate_up, down, plan, out, gemm1_tiles, gemm2_tiles, swiglu_limit, use_pdl=use_pdl,
                    workspace=workspace, split_k=split, wgmma=batch_invariant)


def _mxfp4_w4a16(hidden: torch.Tensor, gate_up: MXFP4, down: MXFP4, plan: DispatchPlan, out: torch.Tensor,
                 gemm1_tiles: GemmTiles, gemm2_tiles: GemmTiles, swiglu_limit: Optional[float], *,
                 use_pdl: bool = False, workspace: Optional[torch.Tensor] = None, persistent: bool = True,
                 batch_invariant: bool = False) -> None:
    """W4A16: the warp-specialized kernels on Hopper where they take the shapes, the ``tl`` kernels elsewhere (the
    same sums in the same order: bit-identical outputs, SPEC §6). They count no arrivals: ``workspace`` is not used."""
    if mxfp4_ws.ws_eligible(hidden, gate_up, down, plan):
        with _unit_column_stride(out) as rows:
            mxfp4_ws.experts_mxfp4_ws(hidden, gate_up, down, plan, rows, swiglu_limit)
    else:
        experts_mxfp4(hidden, gate_up, down, plan, out, gemm1_tiles, gemm2_tiles, swiglu_limit, use_pdl=use_pdl)


def _mxfp4_w4a8(hidden: torch.Tensor, gate_up: MXFP4, down: MXFP4, plan: DispatchPlan, out: torch.Tensor,
                gemm1_tiles: GemmTiles, gemm2_tiles: GemmTiles, swiglu_limit: Optional[float], *,
                use_pdl: bool = False, workspace: Optional[torch.Tensor] = None, persistent: bool = True,
                batch_invariant: bool = False) -> None:
    """W4A8 (checked by ``_check_w4a8``): the decode kernels on their tile heights, the 128-row kernels on theirs
    (the same arithmetic in the same K order, SPEC §6); their own tiles, no PDL and no counters (``workspace`` is
    not used)."""
    with _unit_column_stride(out) as rows:
        if plan.block_m in mxfp4_w4a8_decode.LAUNCH:
            mxfp4_w4a8_decode.experts_mxfp4_w4a8_decode(hidden, gate_up, down, plan, rows, swiglu_limit)
        else:
            mxfp4_w4a8.experts_mxfp4_w4a8(hidden, gate_up, down, plan, rows, swiglu_limit)


@contextlib.contextmanager
def _unit_column_stride(out: torch.Tensor) -> Iterator[torch.Tensor]:
    """``out``, or where its columns are not adjacent a contiguous copy written back after the block: the Gluon
    kernels store rows as [row stride, 1] (their TMA-free epilogue takes one stride). The copy keeps the values of
    the rows the experts leave unwritten, so they stay as they were."""
    if out.stride(1) == 1:
        yield out
        return
    rows = out.contiguous()
    yield rows
    out.copy_(rows)


# The experts per (format, activation precision): each a custom op of its own.
_FORMATS = {
    (BlockFP8, "fp8"): _format(BlockFP8, "experts_fp8", _fp8, moe_experts_fp8_torch),
    (MXFP4, None): _format(MXFP4, "experts_mxfp4", _mxfp4_w4a16, moe_experts_torch),
    (MXFP4, "fp8"): _format(MXFP4, "experts_mxfp4_w4a8", _mxfp4_w4a8, moe_experts_w4a8_torch),
}


@_experts_op.register_fake
def _(hidden, gate_up_proj, down_proj, expert_offsets, permuted_to_expanded, expanded_to_permuted, tile_expert,
      tile_row_start, top_k, block_m, swiglu_limit, tiles, use_pdl, backend, flags, out) -> None:
    return None
