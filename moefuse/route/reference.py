"""Readable PyTorch router (SPEC §1): the spec you can run, the CPU path and the float64 test oracle.

Also here, because they are part of what "correct" means for a router: ``near_tie_rows`` (the rows where the
spec lets a backend's ids differ from the float64 reference) and ``compare_to_reference`` (the verdict the
tests and the GPU check both use).
"""

from __future__ import annotations

from typing import Any

import torch


def activation(x: torch.Tensor, scoring_func: str, moe_softcapping: float = 0.0) -> torch.Tensor:
    """Per-expert activation ``a`` of logits ``x`` [M, E], in ``x``'s dtype.

    ``sqrtsoftplus`` uses ``softplus(x) = max(x,0) + log1p(e^-|x|)`` and, for x < 0, the equivalent
    ``e^(x/2)·sqrt(log1p(z)/z)`` with ``z = e^x``, which keeps its accuracy where softplus itself is tiny.
    Narrower than float64, sigmoid and sqrtsoftplus are computed in float64 and rounded once: below about -87 their
    fp32 formulas lose the subnormal range (fp32's ``1/(1+e^-x)`` is 0 there, as e^-x overflows; ``log1p`` of a
    subnormal is off by percents), where the spec's activations, the kernel's and float64's still have values
    (sigmoid reaches 0 only below about -104), and renormalising turns such values back into ordinary weights.
    Softmax propagates a NaN anywhere in the row to the whole row, like ``torch.softmax``.
    """
    if scoring_func in ("sigmoid", "sqrtsoftplus") and x.dtype != torch.float64:
        return activation(x.double(), scoring_func).to(x.dtype)
    if scoring_func == "sigmoid":
        return torch.sigmoid(x)
    if scoring_func == "sqrtsoftplus":
        z = torch.exp(-x.abs())
        log1p_over_z = torch.where(z > 0, torch.log1p(z) / z, torch.ones_like(z))
        positive = torch.sqrt(x.clamp_min(0) + torch.log1p(z))
        return torch.where(x >= 0, positive, torch.exp(x / 2) * torch.sqrt(log1p_over_z))
    if scoring_func == "softmax":
        if moe_softcapping > 0:
            x = moe_softcapping * torch.tanh(x / moe_softcapping)
        e = torch.exp(x - x.amax(dim=-1, keepdim=True))
        return e / e.sum(dim=-1, keepdim=True)
    raise ValueError(f"unknown scoring_func {scoring_func!r}")


def hash_gate_torch(
    logits: torch.Tensor,
    expert_ids: torch.Tensor,
    scoring_func: str,
    *,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    num_token_non_padded: int | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing (DeepSeek-V4's first MoE layers): each token's experts are given (``expert_ids`` [M, K], the
    model's ``tid2eid[input_ids]``), their weights are the activated logits of those experts, divided by their sum
    (by 1 when it is <= 0) with ``renormalize``, times ``routed_scaling_factor``. Rows at or past
    ``num_token_non_padded`` get ids -1 and weights 0, as in SPEC §1. Computed in ``dtype``; returns (fp32 weights,
    int32 ids). Plain tensor ops, no host sync."""
    ids = expert_ids.to(torch.int64)
    weights = activation(logits.to(dtype), scoring_func).gather(1, ids)
    if renormalize:
        total = weights.sum(dim=1, keepdim=True)
        weights = weights / torch.where(total > 0, total, torch.ones_like(total))
    weights = weights * routed_scaling_factor
    if num_token_non_padded is not None:
        padded = torch.arange(ids.shape[0], device=ids.device)[:, None] >= num_token_non_padded
        weights, ids = weights.masked_fill(padded, 0.0), ids.masked_fill(padded, -1)
    return weights.float(), ids.to(torch.int32)


def rank_desc(keys: torch.Tensor) -> torch.Tensor:
    """Indices that sort the last axis of ``keys`` by the spec's order: larger first, lower index among equal
    values, NaN after everything (``-inf`` included)."""
    nan = keys.isnan()
    order = torch.sort(keys.masked_fill(nan, float("-inf")), dim=-1, descending=True, stable=True).indices
    nan_last = torch.sort(nan.gather(-1, order).to(torch.uint8), dim=-1, stable=True).indices
    return order.gather(-1, nan_last)


def selection_keys(
    scores: torch.Tensor,
    bias: torch.Tensor | None,
    scoring_func: str,
    *,
    num_expert_group: int = 1,
    topk_group: int = 1,
    moe_softcapping: float = 0.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(a, keys, group_scores)`` in ``dtype``: activations [M, E], keys [M, E] with dropped groups at
    ``-inf``, and the group scores [M, G] (None when G == 1).

    A group's score is the sum of its two largest keys in the spec's order (one key when the group has a
    single expert); a value present twice counts twice.
    """
    M, E = scores.shape
    a = activation(scores.to(dtype), scoring_func, moe_softcapping)
    keys = a + bias.to(dtype) if bias is not None else a
    if num_expert_group == 1:
        return a, keys, None
    grouped = keys.view(M, num_expert_group, E // num_expert_group)
    top2 = rank_desc(grouped)[..., :2]
    group_scores = grouped.gather(-1, top2).sum(-1)
    kept_groups = rank_desc(group_scores)[:, :topk_group]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    keys = grouped.masked_fill(~kept[..., None], float("-inf")).view(M, E)
    return a, keys, group_scores


def summed_runs(scores: torch.Tensor) -> torch.Tensor:
    """Logits [M, E] from ``scores``: itself when 2-D; [R, M, E] partial sums (fp32) added in run order,
    ((p0 + p1) + p2) + ..., when 3-D (``router_logits(..., unsummed=True)``)."""
    if scores.dim() == 2:
        return scores
    total = scores[0]
    for run in scores[1:]:
        total = total + run
    return total


def moe_fused_gate_torch(
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
    unit_shared_weight: bool = False,
    dtype: torch.dtype = torch.float32,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route every token: ``(weights fp32 [M, topk], ids int32 [M, topk])``, arithmetic in ``dtype``.

    Same arguments as ``moefuse.moe_fused_gate`` (which validates them; this function does not); 3-D ``scores`` are
    added as :func:`summed_runs` adds them. ``dtype`` is float32 (what the kernels compute in) or float64 (the
    oracle). ``out`` is an optional ``(weights, ids)`` pair to write into.
    """
    weights, ids = _route(
        summed_runs(scores),
        bias,
        topk,
        scoring_func,
        num_fused_shared_experts,
        renormalize,
        routed_scaling_factor,
        apply_routed_scaling_factor_on_output,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        moe_softcapping=moe_softcapping,
        num_token_non_padded=num_token_non_padded,
        unit_shared_weight=unit_shared_weight,
        dtype=dtype,
    )
    if out is None:
        return weights.float(), ids.int()
    out[0].copy_(weights)
    out[1].copy_(ids)
    return out


def _route(
    scores: torch.Tensor,
    bias: torch.Tensor | None,
    topk: int,
    scoring_func: str,
    num_fused_shared_experts: int,
    renormalize: bool,
    routed_scaling_factor: float,
    apply_routed_scaling_factor_on_output: bool,
    *,
    num_expert_group: int,
    topk_group: int,
    moe_softcapping: float,
    num_token_non_padded: int | torch.Tensor | None,
    dtype: torch.dtype,
    unit_shared_weight: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_fused_gate_torch`` with weights left in ``dtype`` and ids int64."""
    M, E = scores.shape
    a, keys, _ = selection_keys(
        scores,
        bias,
        scoring_func,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        moe_softcapping=moe_softcapping,
        dtype=dtype,
    )
    ids = rank_desc(keys)[:, : topk - num_fused_shared_experts]
    weights = a.gather(1, ids)
    routed_sum = weights.sum(dim=1, keepdim=True)
    shared_ids = E + torch.arange(num_fused_shared_experts, device=scores.device).expand(M, -1)
    ids = torch.cat([ids, shared_ids], dim=1)
    weights = torch.cat([weights, (routed_sum / routed_scaling_factor).expand(M, num_fused_shared_experts)], dim=1)
    if renormalize:
        weights = weights / torch.where(routed_sum > 0, routed_sum, torch.ones_like(routed_sum))
    if apply_routed_scaling_factor_on_output:
        weights = weights * routed_scaling_factor
    if unit_shared_weight:
        weights[:, topk - num_fused_shared_experts:] = 1.0
    if num_token_non_padded is not None:
        padded = (torch.arange(M, device=scores.device) >= num_token_non_padded)[:, None]
        weights = weights.masked_fill(padded, 0.0)
        ids = ids.masked_fill(padded, -1)
    return weights, ids


# ---- judging another backend against the float64 reference -------------------------------------------------


def near_tie_rows(
    scores: torch.Tensor,
    bias: torch.Tensor | None,
    topk: int,
    scoring_func: str = "sigmoid",
    num_fused_shared_experts: int = 0,
    *,
    num_expert_group: int = 1,
    topk_group: int = 1,
    moe_softcapping: float = 0.0,
    rel: float = 1e-6,
) -> torch.Tensor:
    """bool [M]: rows whose selection an fp32 backend may legitimately make differently from float64.

    A row is flagged when, in float64, two neighbouring keys among the ``K_r + 1`` largest (the boundary pair
    the spec names, and the pairs inside the selection, whose order fp32 rounding may swap) or the
    ``topk_group``-th and next group scores lie within ``rel`` of each other (relative, equality included).
    """
    k_routed = topk - num_fused_shared_experts
    _, keys, group_scores = selection_keys(
        scores,
        bias,
        scoring_func,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        moe_softcapping=moe_softcapping,
        dtype=torch.float64,
    )
    top = keys.gather(1, rank_desc(keys)[:, : k_routed + 1])
    flagged = _close(top[:, :-1], top[:, 1:], rel).any(dim=1)
    if group_scores is not None and topk_group < group_scores.shape[1]:
        g = group_scores.gather(1, rank_desc(group_scores)[:, topk_group - 1 : topk_group + 1])
        flagged |= _close(g[:, 0], g[:, 1], rel)
    return flagged


def _close(x: torch.Tensor, y: torch.Tensor, rel: float) -> torch.Tensor:
    """Equal (inf and NaN included), or within ``rel`` of the larger magnitude."""
    both_nan = x.isnan() & y.isnan()
    return both_nan | (x == y) | ((x - y).abs() <= rel * torch.maximum(x.abs(), y.abs()))


def compare_to_reference(
    weights: torch.Tensor,
    ids: torch.Tensor,
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
    allow_near_ties: bool = True,
) -> dict[str, float | int]:
    """Judge a backend's ``(weights, ids)`` against the float64 reference on the same inputs.

    Returns ``invalid_rows`` (ids outside [0, E), repeated, wrong shared ids, or a padded row not -1/0),
    ``bad_rows`` (ids differ and the row is not a near tie, or ``allow_near_ties`` is off), ``tie_rows``
    (excused rows whose ids differ), ``weight_err`` (max over rows with equal ids of
    ``max|w - w64| / max|finite w64|`` within the row; inf or NaN must match exactly) and ``rows``.
    """
    M, E = scores.shape
    k_routed = topk - num_fused_shared_experts
    opts: dict[str, Any] = dict(num_expert_group=num_expert_group, topk_group=topk_group,
                                moe_softcapping=moe_softcapping)
    ref_w, ref_ids = _route(
        scores,
        bias,
        topk,
        scoring_func,
        num_fused_shared_experts,
        renormalize,
        routed_scaling_factor,
        apply_routed_scaling_factor_on_output,
        num_token_non_padded=num_token_non_padded,
        dtype=torch.float64,
        **opts,
    )
    ids, weights = ids.long(), weights.double()
    padded = ref_ids[:, 0] == -1

    routed = ids[:, :k_routed]
    distinct = (routed.sort(dim=1).values.diff(dim=1) != 0).all(dim=1)
    in_range = ((routed >= 0) & (routed < E)).all(dim=1)
    shared_ok = (ids[:, k_routed:] == E + torch.arange(num_fused_shared_experts, device=ids.device)).all(dim=1)
    valid = torch.where(padded, (ids == -1).all(dim=1) & (weights == 0).all(dim=1), distinct & in_range & shared_ok)

    same = (ids == ref_ids).all(dim=1)
    excused = near_tie_rows(scores, bias, topk, scoring_func, num_fused_shared_experts, **opts)
    excused = excused & ~padded if allow_near_ties else torch.zeros_like(same)

    equal = (weights == ref_w) | (weights.isnan() & ref_w.isnan())  # inf and NaN must sit in the same places
    diff = torch.where(equal, 0.0, (weights - ref_w).abs()).nan_to_num(nan=float("inf"), posinf=float("inf"))
    scale = torch.where(ref_w.isfinite(), ref_w.abs(), 0.0).amax(dim=1).clamp_min(1e-30)
    row_err = diff.amax(dim=1) / scale
    return {
        "rows": M,
        "invalid_rows": int((~valid).sum()),
        "bad_rows": int((~same & ~excused).sum()),
        "tie_rows": int((~same & excused).sum()),
        "weight_err": float(row_err[same].max()) if bool(same.any()) else 0.0,
    }


def router_logits_torch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Router logits ``x @ weight^T`` in fp32 (the models' router linear): [M, H] x [E, H] -> fp32 [M, E]."""
    logits = torch.nn.functional.linear(x.float(), weight.float())
    return logits if out is None else out.copy_(logits)
