"""Public router op ``moe_fused_gate`` (SPEC §1): validation, backend choice, the ``moefuse::fused_gate`` custom op."""

from __future__ import annotations

import math

import torch

from moefuse import _checks, _runtime
from moefuse.route import kernel, linear, reference

SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax")


def moe_fused_gate(
    scores: torch.Tensor,
    bias: torch.Tensor | None,
    topk: int,
    scoring_func: str = "sigmoid",
    num_fused_shared_experts: int = 0,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    apply_routed_scaling_factor_on_output: bool = False,
    *,
    num_expert_group: int = 1,
    topk_group: int = 1,
    moe_softcapping: float = 0.0,
    num_token_non_padded: int | torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "auto",
    batch_invariant: bool | None = None,
    unit_shared_weight: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's experts and their weights from router logits.

    Args:
        scores: router logits [M, E], fp32, bf16 or fp16 (all arithmetic is fp32); or fp32 partial sums [R, M, E]
            of the logits, which the gate adds in run order, ((p0 + p1) + p2) + ... (``router_logits(...,
            unsummed=True)``: one kernel fewer a layer call).
        bias: selection bias [E] fp32 on the same device, or None (zeros). It chooses experts only; weights
            come from the activation alone.
        topk: slots per token (a slot: one of a token's choices, an expert id and its weight), fused shared
            slots included (``K_r = topk - num_fused_shared_experts`` routed).
        scoring_func: ``"sigmoid"``, ``"sqrtsoftplus"`` or ``"softmax"``.
        num_fused_shared_experts: shared-expert slots appended after the routed ones, ids ``E + j``, weight
            ``routed_sum / routed_scaling_factor`` before renormalisation (0 where every routed weight is 0), or 1
            with ``unit_shared_weight``.
        renormalize: divide every slot by the sum of the routed weights (by 1 when that sum is <= 0).
        routed_scaling_factor: finite, > 0.
        apply_routed_scaling_factor_on_output: multiply every slot by ``routed_scaling_factor``.
        num_expert_group: G groups of E/G consecutive experts (G must divide E); a group scores the sum of its
            two largest keys, and only the ``topk_group`` best groups are eligible.
        topk_group: groups kept, 1 <= topk_group <= G.
        moe_softcapping: ``c >= 0``; for softmax, logits become ``c·tanh(x/c)`` first when ``c > 0``. A nonzero
            value with another scoring function is rejected rather than silently ignored.
        num_token_non_padded: None, an int, or a 0-d int32/int64 tensor on the scores' device (read on the
            device: CUDA-graph safe). Rows at or past it get ids -1 and weights 0.
        out: optional preallocated ``(weights fp32 [M, topk], ids int32 [M, topk])``, contiguous, same device.
        backend: ``"auto"``, ``"reference"`` or ``"triton"`` (see ``moefuse._runtime``).
        unit_shared_weight: the fused shared slots' weight exactly 1 (padded rows' 0 aside), whatever the routed
            weights: a layer's shared expert, added whole, also where every routed score underflows (sigmoid
            logits far below zero), where ``routed_sum / routed_scaling_factor`` would drop it.

    Returns:
        ``(weights, ids)``: fp32 [M, topk] and int32 [M, topk]. Routed slots in descending key order (lower id
        first among equal keys; NaN keys last), then the shared slots.

    Raises:
        TypeError / ValueError naming the argument, before any launch, for every case in SPEC §1; with the
        Triton backend also for ``E > 1024`` or ``topk > 32``.
    """
    resolved = _validate(
        scores,
        bias,
        topk,
        scoring_func,
        num_fused_shared_experts,
        renormalize,
        routed_scaling_factor,
        apply_routed_scaling_factor_on_output,
        num_expert_group,
        topk_group,
        moe_softcapping,
        num_token_non_padded,
        out,
        backend,
        unit_shared_weight,
    )
    M = scores.shape[-2]
    if out is None:
        out = (
            torch.empty(M, topk, dtype=torch.float32, device=scores.device),
            torch.empty(M, topk, dtype=torch.int32, device=scores.device),
        )
    ntnp_tensor = num_token_non_padded if isinstance(num_token_non_padded, torch.Tensor) else None
    if num_token_non_padded is None or isinstance(num_token_non_padded, torch.Tensor):
        n_valid = M
    else:
        n_valid = min(max(num_token_non_padded, 0), M)
    op = _fused_gate_impl if _runtime.direct_call() else torch.ops.moefuse.fused_gate
    op(
        scores,
        bias,
        out[0],
        out[1],
        scoring_func,
        num_fused_shared_experts,
        renormalize,
        float(routed_scaling_factor),
        apply_routed_scaling_factor_on_output,
        num_expert_group,
        topk_group,
        float(moe_softcapping),
        ntnp_tensor,
        n_valid,
        _runtime.batch_invariant(batch_invariant),
        unit_shared_weight,
        resolved,
    )
    return out


def _validate(
    scores,
    bias,
    topk,
    scoring_func,
    num_fused_shared_experts,
    renormalize,
    routed_scaling_factor,
    apply_routed_scaling_factor_on_output,
    num_expert_group,
    topk_group,
    moe_softcapping,
    num_token_non_padded,
    out,
    backend,
    unit_shared_weight=False,
) -> str:
    """Every argument check of ``moe_fused_gate``; raises TypeError/ValueError naming the argument.

    Returns the resolved backend (``"reference"`` or ``"triton"``), chosen from the scores' device once they are
    known to be a tensor.
    """
    _checks.check_tensor("scores", scores)
    if scores.dim() == 3:  # the runs' partial sums
        _checks.check_tensor("scores", scores, dtypes=(torch.float32,))
        if scores.shape[0] < 1:
            raise ValueError(f"scores [R, M, E] must hold at least one run, got shape {tuple(scores.shape)}")
    elif scores.dim() != 2:
        raise ValueError(f"scores must be [M, E] (or fp32 [R, M, E] partial sums), got shape {tuple(scores.shape)}")
    else:
        _checks.check_tensor("scores", scores, dtypes=_checks.FLOAT_DTYPES)
    M, E = scores.shape[-2:]
    device = scores.device
    backend = _runtime.resolve_backend(backend, device)
    if E < 1:
        raise ValueError(f"scores must have at least one expert column, got shape {tuple(scores.shape)}")
    if bias is not None:
        _checks.check_tensor("bias", bias, dtypes=(torch.float32,), shape=(E,), device=device)
    _checks.check_int("topk", topk, low=1)
    _checks.check_int("num_fused_shared_experts", num_fused_shared_experts, low=0)
    if topk <= num_fused_shared_experts:
        raise ValueError(
            f"topk ({topk}) must exceed num_fused_shared_experts ({num_fused_shared_experts}): "
            "at least one routed slot is needed"
        )
    if not isinstance(scoring_func, str) or scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    for name, flag in (
        ("renormalize", renormalize),
        ("apply_routed_scaling_factor_on_output", apply_routed_scaling_factor_on_output),
        ("unit_shared_weight", unit_shared_weight),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    _check_real("routed_scaling_factor", routed_scaling_factor)
    if not (math.isfinite(routed_scaling_factor) and routed_scaling_factor > 0):
        raise ValueError(f"routed_scaling_factor must be finite and > 0, got {routed_scaling_factor}")
    _check_real("moe_softcapping", moe_softcapping)
    if not (math.isfinite(moe_softcapping) and moe_softcapping >= 0):
        raise ValueError(f"moe_softcapping must be finite and >= 0, got {moe_softcapping}")
    if moe_softcapping > 0 and scoring_func != "softmax":
        raise ValueError(f"moe_softcapping applies to scoring_func='softmax' only, got {scoring_func!r}")
    _checks.check_int("num_expert_group", num_expert_group, low=1)
    if E % num_expert_group:
        raise ValueError(f"num_expert_group ({num_expert_group}) must divide the number of experts ({E})")
    _checks.check_int("topk_group", topk_group, low=1, high=num_expert_group)
    k_routed = topk - num_fused_shared_experts
    if k_routed > E:
        raise ValueError(f"topk - num_fused_shared_experts ({k_routed} routed slots) exceeds the {E} experts")
    eligible = topk_group * (E // num_expert_group)
    if k_routed > eligible:
        raise ValueError(
            f"topk - num_fused_shared_experts ({k_routed}) exceeds the {eligible} experts that topk_group "
            f"({topk_group}) groups of {E // num_expert_group} hold"
        )
    if num_token_non_padded is not None:
        if isinstance(num_token_non_padded, torch.Tensor):
            _checks.check_tensor(
                "num_token_non_padded", num_token_non_padded, dtypes=(torch.int32, torch.int64), ndim=0, device=device
            )
        else:
            _checks.check_int("num_token_non_padded", num_token_non_padded)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out must be a (weights, ids) pair of tensors")
        for name, tensor, dtype in (("out[0] (weights)", out[0], torch.float32), ("out[1] (ids)", out[1], torch.int32)):
            _checks.check_tensor(name, tensor, dtypes=(dtype,), shape=(M, topk), device=device)
            if not tensor.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
    if backend == "triton":
        if E > kernel.MAX_EXPERTS:
            raise ValueError(f"scores has {E} experts; the triton backend handles at most {kernel.MAX_EXPERTS}")
        if topk > kernel.MAX_TOPK:
            raise ValueError(f"topk ({topk}) exceeds the triton backend's limit of {kernel.MAX_TOPK}")
    return backend


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")


def _fused_gate_impl(
    scores: torch.Tensor,
    bias: torch.Tensor | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
    scoring_func: str,
    num_fused_shared_experts: int,
    renormalize: bool,
    routed_scaling_factor: float,
    apply_routed_scaling_factor_on_output: bool,
    num_expert_group: int,
    topk_group: int,
    moe_softcapping: float,
    num_token_non_padded: torch.Tensor | None,
    n_valid: int,
    invariant: bool,
    unit_shared_weight: bool,
    backend: str,
) -> None:
    """Write the routing of ``scores`` into ``weights``/``ids`` (arguments already validated).

    Padding comes from ``num_token_non_padded`` when it is a tensor, else from ``n_valid`` (M when none).
    """
    if backend == "triton":
        kernel.fused_gate(
            scores,
            bias,
            weights,
            ids,
            scoring_func=scoring_func,
            num_fused_shared_experts=num_fused_shared_experts,
            renormalize=renormalize,
            routed_scaling_factor=routed_scaling_factor,
            apply_routed_scaling_factor_on_output=apply_routed_scaling_factor_on_output,
            num_expert_group=num_expert_group,
            topk_group=topk_group,
            moe_softcapping=moe_softcapping,
            num_token_non_padded=num_token_non_padded,
            n_valid=n_valid,
            invariant=invariant,
            unit_shared_weight=unit_shared_weight,
        )
        return
    reference.moe_fused_gate_torch(
        scores,
        bias,
        weights.shape[1],
        scoring_func,
        num_fused_shared_experts,
        renormalize,
        routed_scaling_factor,
        apply_routed_scaling_factor_on_output,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        moe_softcapping=moe_softcapping,
        num_token_non_padded=num_token_non_padded if num_token_non_padded is not None else n_valid,
        unit_shared_weight=unit_shared_weight,
        out=(weights, ids),
    )


_fused_gate = torch.library.custom_op("moefuse::fused_gate", _fused_gate_impl, mutates_args=("weights", "ids"))


@_fused_gate.register_fake
def _(scores, bias, weights, ids, *args) -> None:
    return None


def router_logits(
    x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None, backend: str = "auto",
    batch_invariant: bool | None = None, weight_parts: torch.Tensor | None = None, unsummed: bool = False,
) -> torch.Tensor:
    """The router linear: fp32 logits ``x @ weight^T`` for :func:`moe_fused_gate`.

    Args:
        x: hidden states [M, H], fp32, bf16 or fp16, any strides.
        weight: router weight [E, H], fp32 (as checkpoints store it), bf16 or fp16, on x's device.
        out: optional fp32 [M, E] to write into.
        backend: ``"auto"``, ``"reference"`` or ``"triton"``. With ``"triton"``, batches of at most
            ``moefuse.route.linear.MAX_TOKENS`` (16) tokens run the Triton kernel, which reads 16-bit inputs
            without an upcast copy; from ``linear.MMA_MIN_TOKENS`` (768) tokens of bf16 ``x`` with an fp32
            ``weight``, a tensor-core kernel on the weight's exact bf16 split (SPEC, router GEMM); other batches
            run cuBLAS's fp32 GEMM on upcast inputs, as the reference does.
        batch_invariant: None (the process default, ``moefuse.set_defaults``) or a bool. True: with ``"triton"``
            one launch at every M (``linear.router_logits_invariant``), so a row's logits are the same bits in any
            batch.
        weight_parts: with ``batch_invariant`` and bf16 ``x``, ``linear.bf16_split(weight.float())`` if the caller
            keeps it across calls (a layer does); None splits the weight on each call.
        unsummed: return fp32 [R, M, E] partial sums for :func:`moe_fused_gate` to add, one kernel fewer: the R
            runs the batch-invariant launch cuts K into (``linear.invariant_logit_runs``) with ``"triton"`` and
            ``batch_invariant``, else R = 1 (the logits). ``out``, if given, is then [R, M, E].

    Returns:
        ``out``: fp32 [M, E] (or [R, M, E], ``unsummed``). Products and sums are fp32 on every backend; only the
        summation order differs.

    Raises:
        TypeError / ValueError naming the argument, before any launch.
    """
    if not isinstance(unsummed, bool):
        raise TypeError(f"unsummed must be a bool, got {type(unsummed).__name__}")
    invariant = _runtime.batch_invariant(batch_invariant)
    resolved = _validate_logits(x, weight, None if unsummed else out, backend)
    runs = None
    if unsummed:
        runs = linear.invariant_logit_runs(x.dtype, x.shape[1]) if invariant and resolved == "triton" else 1
        if out is not None:
            _checks.check_tensor("out", out, dtypes=(torch.float32,), shape=(runs, x.shape[0], weight.shape[0]),
                                 device=x.device)
            if not out.is_contiguous():
                raise ValueError("out must be contiguous (the gate reads the runs as one block)")
    if weight_parts is not None:
        _checks.check_tensor("weight_parts", weight_parts, dtypes=(torch.bfloat16,),
                             shape=(3, *weight.shape), device=x.device)
    if out is None:
        shape = (x.shape[0], weight.shape[0]) if runs is None else (runs, x.shape[0], weight.shape[0])
        out = torch.empty(shape, dtype=torch.float32, device=x.device)
    op = _router_logits_impl if _runtime.direct_call() else torch.ops.moefuse.router_logits
    op(x, weight, resolved, invariant, weight_parts, out)
    return out


def _validate_logits(x, weight, out, backend) -> str:
    """Every argument check of ``router_logits``; returns the resolved backend."""
    _checks.check_tensor("x", x, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    device = x.device
    resolved = _runtime.resolve_backend(backend, device)
    M, H = x.shape
    _checks.check_tensor("weight", weight, dtypes=_checks.FLOAT_DTYPES, ndim=2, device=device)
    if weight.shape[1] != H:
        raise ValueError(f"weight must be [E, {H}] to match x [M, {H}], got shape {tuple(weight.shape)}")
    if out is not None:
        _checks.check_tensor("out", out, dtypes=(torch.float32,), shape=(M, weight.shape[0]), device=device)
    return resolved


def _router_logits_impl(x: torch.Tensor, weight: torch.Tensor, backend: str, invariant: bool,
                        weight_parts: torch.Tensor | None, out: torch.Tensor) -> None:
    """Write the logits into ``out`` (arguments already validated): [M, E], or [R, M, E] (``unsummed``)."""
    if out.dim() == 3:
        if out.shape[0] > 1:  # the invariant launch's runs (M, E and H > 0 where there is anything to write)
            if out.numel():
                linear.router_logits_invariant(x, weight, out, weight_parts)
            return
        out = out[0]
    if backend == "triton" and x.numel() and weight.numel():  # empty shapes: the reference's zeros (or nothing)
        if invariant:
            linear.router_logits_invariant(x, weight, out, weight_parts)
            return
        if x.shape[0] <= linear.MAX_TOKENS:
            linear.router_logits_triton(x, weight, out)
            return
        if linear.takes_mma(x.shape[0], x.dtype, weight.dtype, x.device):
            linear.router_logits_mma(x, weight, out)
            return
    reference.router_logits_torch(x, weight, out=out)


_router_logits = torch.library.custom_op("moefuse::router_logits", _router_logits_impl, mutates_args=("out",))


@_router_logits.register_fake
def _(x, weight, backend, invariant, weight_parts, out) -> None:
    return None
