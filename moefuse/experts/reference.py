"""Readable PyTorch version of the routed experts: the spec you can run, the CPU path, the test oracle.

Permuted row p of expert e (``plan.expert_offsets[e] <= p < plan.expert_offsets[e+1]``) holds, for the token
``t = plan.permuted_to_expanded[p] // K`` and x = hidden[t]:

    gate = x @ gate_up_proj[e, :I].T          up = x @ gate_up_proj[e, I:].T
    gate = min(gate, limit)                   up = clamp(up, -limit, limit)      (only with swiglu_limit)
    act = round(SiLU(gate) * up)              (to hidden's dtype: the intermediate is stored in it)
    out[p] = round(act @ down_proj[e].T)      (to out's dtype)

Routing weights are not applied here (finalize applies them). Rows past the last real row are not written.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Optional, cast

import torch

from ..dispatch import DispatchPlan
from ..formats import BLOCK, FP8_MAX, MXFP4, BlockFP8, ExpertWeight, QuantizedWeight, resolve_activation_quant


def expert_segments(plan: DispatchPlan) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """``(expert, start, end, tokens)`` for each expert with rows: its permuted rows ``[start, end)`` and the token
    of each (reads the offsets back to the host)."""
    offsets = plan.expert_offsets.tolist()
    for expert in range(plan.num_experts):
        start, end = offsets[expert], offsets[expert + 1]
        if start < end:
            yield expert, start, end, plan.permuted_to_expanded[start:end].long() // plan.top_k


def expert_weight(weight: ExpertWeight, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """One expert's [N, K] weight in ``dtype``: a plain tensor's slice, or a format's dequantized values."""
    if isinstance(weight, torch.Tensor):
        return weight[expert].to(dtype)
    return weight[expert].dequantize(dtype)[0]


def moe_experts_torch(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor | MXFP4,
    down_proj: torch.Tensor | MXFP4,
    plan: DispatchPlan,
    *,
    swiglu_limit: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Each expert's SwiGLU MLP on its rows of the plan, computed in ``dtype``.

    Args:
        hidden: [M, H] activations. gate_up_proj: [E, 2I, H] (gate rows first). down_proj: [E, H, I]. Either
            may be :class:`~moefuse.formats.MXFP4` (W4A16, SPEC §6): its unpacked values, which are exact.
        plan: the :class:`~moefuse.dispatch.DispatchPlan` of the routing, M·K rows.
        swiglu_limit: None, or the DeepSeek-V4 clamp (> 0).
        out: where to write [M·K, H] (any float dtype); default a new tensor of hidden's dtype.
        dtype: compute dtype; float32 is the kernels' accumulation, float64 makes this the test oracle.
            The intermediate is rounded to hidden's dtype in any case, as the kernels store it.

    Returns:
        ``out``; rows at or past ``plan.expert_offsets[E]`` are left as they were. Any device; reads the
        expert offsets back to the host (a sync): a reference, not a fast path.
    """
    num_rows, width = plan.num_rows, gate_up_proj.shape[1] // 2
    if out is None:
        out = torch.empty(num_rows, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    for expert, start, end, tokens in expert_segments(plan):
        x = hidden[tokens].to(dtype)  # [rows, H]
        gate_up = x @ expert_weight(gate_up_proj, expert, dtype).T  # [rows, 2I]
        act = swiglu_torch(gate_up[:, :width], gate_up[:, width:], swiglu_limit).to(hidden.dtype).to(dtype)  # [rows, I]
        out[start:end] = (act @ expert_weight(down_proj, expert, dtype).T).to(out.dtype)
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token, per-128-column e4m3 quantization of activations (SPEC §5), in fp32: the reference of the
    fp8 kernels' quantization (``fp8/quantize.py``), which must match it bit for bit.

    For each row and each group g of 128 columns (the last group covers what is left of the width):
    ``amax = max |x|``; ``scale = amax / 448`` and ``inv = 448 / amax`` (each one fp32 division, rounded to
    nearest); ``q = e4m3(clamp(x * inv, -448, 448))`` rounded to nearest even. An all-zero group has scale 0 and
    quantizes to zeros. NaN propagates (its group's scale is NaN). Returns ``(q [M, W] float8_e4m3fn, scales
    [M, ceil(W / 128)] fp32)``; ``q * scale`` per group approximates ``x``.
    """
    M, W = x.shape
    groups = math.ceil(W / BLOCK)
    padded = torch.zeros(M, groups * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :W] = x.float()
    blocks = padded.view(M, groups, BLOCK)
    amax = blocks.abs().amax(dim=2)
    # Tensor divisors both ways: on CUDA torch computes ``tensor / 448.0`` as a multiply by the reciprocal and
    # ``448.0 / tensor`` as a reciprocal times 448, each rounding twice (a quarter of the quotients off by an ulp,
    # enough to flip the e4m3 rounding of near-ties that bf16 inputs make common).
    scale = amax / torch.full_like(amax, FP8_MAX)
    inv = torch.where(amax > 0, torch.full_like(amax, FP8_MAX) / amax, 0.0)
    inv = torch.where(amax.isnan(), amax, inv)
    q = (blocks * inv[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(M, groups * BLOCK)[:, :W], scale


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` per row and group of 128 columns: the inverse of :func:`quantize_rows`, in ``dtype``."""
    W = q.shape[1]
    return q.to(dtype) * scales.to(dtype).repeat_interleave(BLOCK, 1)[:, :W]


def moe_experts_fp8_torch(
    hidden: torch.Tensor,
    gate_up_proj: BlockFP8 | MXFP4,
    down_proj: BlockFP8 | MXFP4,
    plan: DispatchPlan,
    *,
    swiglu_limit: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
    round_intermediate: bool = False,
) -> torch.Tensor:
    """The experts on fp8 block-scale weights (W8A8, SPEC §5), computed in ``dtype`` on the dequantized operands.

    For each expert's rows: the activations are quantized per token and 128 columns (:func:`quantize_rows`),
    ``gate_up = deq(x) @ deq(W1)^T`` (exactly the sum over 128-column blocks of the fp8 products times both
    scales), the SwiGLU as in :func:`moe_experts_torch`, the intermediate quantized the same way from fp32 (from
    hidden's dtype with ``round_intermediate``: :func:`moe_experts_w4a8_torch`), and
    ``out = round(deq(act) @ deq(W2)^T)`` to out's dtype. float64 makes this the oracle of the kernels, which
    differ only by their fp32 sums (and, rarely, by an e4m3 rounding of the intermediate flipped by them).
    """
    num_rows, width = plan.num_rows, gate_up_proj.shape[1] // 2
    if out is None:
        out = torch.empty(num_rows, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    for expert, start, end, tokens in expert_segments(plan):
        x = dequantize_rows(*quantize_rows(hidden[tokens]), dtype)  # [rows, H]
        gate_up = x @ expert_weight(gate_up_proj, expert, dtype).T  # [rows, 2I]
        act = swiglu_torch(gate_up[:, :width], gate_up[:, width:], swiglu_limit)
        if round_intermediate:
            act = act.to(hidden.dtype)
        act = dequantize_rows(*quantize_rows(act.float()), dtype)
        out[start:end] = (act @ expert_weight(down_proj, expert, dtype).T).to(out.dtype)
    return out


def w4a8_weight(weight: MXFP4) -> MXFP4:
    """The MXFP4 weights the W4A8 kernels multiply (SPEC §6): a group of 32 whose exponent is more than 11 under its
    row's largest (``e - base < -5``, ``base = max(largest - 6, 1)``) is flushed to zero, codes and all; every other
    group is unchanged (its e4m3 values times 2^base are exact)."""
    exps = weight.scales.int()
    base = (exps.amax(dim=2, keepdim=True) - 6).clamp(min=1)
    keep = (exps - base >= -5).repeat_interleave(16, dim=2)  # 16 bytes of codes a group
    return MXFP4.unchecked(torch.where(keep, weight.values.view(torch.uint8), 0), weight.scales)


def moe_experts_w4a8_torch(
    hidden: torch.Tensor,
    gate_up_proj: MXFP4,
    down_proj: MXFP4,
    plan: DispatchPlan,
    *,
    swiglu_limit: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The experts on MXFP4 weights with fp8 activations (W4A8, SPEC §6): :func:`moe_experts_fp8_torch` on the
    weights :func:`w4a8_weight` keeps, with the intermediate rounded to hidden's dtype before it is quantized (the
    kernels store it so). float64 makes this the oracle of the W4A8 kernels."""
    return moe_experts_fp8_torch(hidden, w4a8_weight(gate_up_proj), w4a8_weight(down_proj), plan,
                                 swiglu_limit=swiglu_limit, out=out, dtype=dtype, round_intermediate=True)


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor, limit: Optional[float]) -> torch.Tensor:
    """``SiLU(gate) * up``, with DeepSeek-V4's clamp first (gate to ``<= limit``, up to ``[-limit, limit]``)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


def expert_mlp_torch(x: torch.Tensor, gate_up: ExpertWeight, down: ExpertWeight, limit: float | None,
                activation_dtype: torch.dtype, dtype: torch.dtype, activation_quant: str | None = "default"
                ) -> torch.Tensor:
    """One expert's SwiGLU MLP on rows ``x``, computed in ``dtype``, with the numerics the experts op computes for
    ``activation_quant`` (:func:`moefuse.formats.resolve_activation_quant`) on these weights. With fp8 activations
    they are quantized as the kernels do (SPEC §5), from ``activation_dtype``, and so is the intermediate: from fp32
    for fp8 weights (W8A8), from ``activation_dtype`` for MXFP4 ones (W4A8: the kernels store it so first; their
    weights as ``experts.reference.w4a8_weight`` keeps them, SPEC §6). MXFP4 weights are unpacked exactly."""
    fp8 = resolve_activation_quant(gate_up, activation_quant) == "fp8"
    w4a8 = fp8 and isinstance(gate_up, MXFP4)
    if w4a8:
        gate_up, down = w4a8_weight(cast(MXFP4, gate_up)), w4a8_weight(cast(MXFP4, down))
    if fp8:
        x = dequantize_rows(*quantize_rows(x.to(activation_dtype)), dtype)
    if isinstance(gate_up, QuantizedWeight):  # down is of the same format
        w1, w2 = gate_up.dequantize(dtype)[0], cast(QuantizedWeight, down).dequantize(dtype)[0]
    else:
        w1, w2 = gate_up.to(dtype), cast(torch.Tensor, down).to(dtype)
    h = x @ w1.T
    width = h.shape[1] // 2
    act = swiglu_torch(h[:, :width], h[:, width:], limit)
    if fp8:
        act = dequantize_rows(*quantize_rows((act.to(activation_dtype) if w4a8 else act).float()), dtype)
    return act @ w2.T
