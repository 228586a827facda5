"""Which transformers modules each weight format can take: the refusal reasons :mod:`moefuse.hf` reports.

A checkpoint's format is read off its values' dtype (:func:`moefuse.formats.format_of_stored`); what else a
format needs of transformers' modules (fp8: 128 x 128 block scales and dynamic activation scales; MXFP4: one scale
per 32 K values of a row) differs by format, so each format's reasons live here, one entry of :data:`REASONS` per
:class:`~moefuse.formats.LayerFormat` class. The format objects never name transformers, and ``hf.py`` never
names a format: it asks :func:`experts_reason` and :func:`shared_reason`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from moefuse.formats import BLOCK, MX_GROUP, BlockFP8Format, LayerFormat, MXFP4Format

# A transformers module, read by attribute names (its classes vary with the model and the version): duck-typed.
HFModule = Any


@dataclass(frozen=True)
class Reasons:
    """One format's refusals: ``experts(fmt, module)`` for a routed experts module, ``shared(fmt, projs)`` for a
    shared expert's gate, up and down modules; each None when the module can run as ``fmt``."""

    experts: Callable[[LayerFormat, HFModule], Optional[str]]
    shared: Callable[[LayerFormat, list[HFModule]], Optional[str]]


def experts_reason(fmt: LayerFormat, experts: HFModule) -> Optional[str]:
    """Why a transformers experts module whose values ``fmt`` stores cannot run as ``fmt``, or None."""
    return _reasons(fmt).experts(fmt, experts)


def shared_reason(fmt: LayerFormat, projs: list[HFModule]) -> Optional[str]:
    """Why a transformers shared expert (its gate, up and down modules) whose values ``fmt`` stores cannot run as
    ``fmt``, or None."""
    return _reasons(fmt).shared(fmt, projs)


def _reasons(fmt: LayerFormat) -> Reasons:
    reasons = REASONS.get(type(fmt))
    if reasons is None:
        raise LookupError(f"no transformers reasons for the format {fmt.name!r} ({type(fmt).__name__}): add an entry "
                          "to moefuse.hf_formats.REASONS")
    return reasons


def _any_experts(fmt: LayerFormat, experts: HFModule) -> Optional[str]:
    """The plain format takes any experts module: its tensors are the weights."""
    return None


def _any_shared(fmt: LayerFormat, projs: list[HFModule]) -> Optional[str]:
    """A shared expert in a format no shared expert takes is refused; the plain format takes any ``nn.Linear`` s
    (the layer calls them)."""
    if fmt.shared_width_step is None:
        return f"a shared expert in {fmt.name} (no checkpoint ships one)"
    return None


def _block_reason(name: str, modules: list[HFModule]) -> Optional[str]:
    """Why transformers' fp8 ``modules`` are not 128 x 128 block-scale with dynamic activation scales, or None."""
    block_size = getattr(modules[0], "block_size", None)
    if block_size is None or tuple(block_size) != (BLOCK, BLOCK):
        return f"{name} with block size {block_size} (only {BLOCK} x {BLOCK} block scales)"
    if any(getattr(module, "activation_scheme", "dynamic") != "dynamic" for module in modules):
        return f"{name} with static activation scales (only dynamic)"
    return None


def _block_fp8_experts(fmt: LayerFormat, experts: HFModule) -> Optional[str]:
    name = type(experts).__name__
    return (_block_reason(f"{fmt.name} experts {name}", [experts])
            or (None if hasattr(experts, "gate_up_proj_scale_inv") else
                f"{fmt.name} experts {name} without gate_up_proj_scale_inv"))


def _block_fp8_shared(fmt: LayerFormat, projs: list[HFModule]) -> Optional[str]:
    name = f"{fmt.name} shared expert {type(projs[0]).__name__}"
    if any(getattr(proj, "bias", None) is not None for proj in projs):  # the block-scale GEMMs add none
        return f"{name} with biases"
    reason = _block_reason(name, projs)
    if reason is None and not all(hasattr(proj, "weight_scale_inv") for proj in projs):
        reason = f"{name} without weight_scale_inv"
    width = projs[0].weight.shape[0]
    if reason is None and width % BLOCK:
        reason = (f"{name} whose width {width} is not a multiple of {BLOCK} (its gate and up blocks are "
                  "separate in a checkpoint)")
    return reason


def _mxfp4_experts(fmt: LayerFormat, experts: HFModule) -> Optional[str]:
    name = type(experts).__name__
    for proj in ("gate_up_proj", "down_proj"):
        values, scales = getattr(experts, proj), getattr(experts, f"{proj}_scale_inv", None)
        if scales is None or tuple(scales.shape) != (*values.shape[:2], 2 * values.shape[2] // MX_GROUP):
            return f"FP4 experts {name} whose {proj} has no scale per {MX_GROUP} K values of a row"
        if scales.dtype not in (torch.float8_e8m0fnu, torch.uint8, torch.float32):
            return f"FP4 experts {name} with {scales.dtype} scales"
    return None


REASONS: dict[type[LayerFormat], Reasons] = {
    LayerFormat: Reasons(_any_experts, _any_shared),
    BlockFP8Format: Reasons(_block_fp8_experts, _block_fp8_shared),
    MXFP4Format: Reasons(_mxfp4_experts, _any_shared),  # no checkpoint ships an MXFP4 shared expert
}
