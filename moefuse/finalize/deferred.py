"""Deferred finalize (SPEC §3): let the experts runner hand back its un-combined rows so that the combine and
the shared-expert add happen in one fused pass, after the shared experts (on a side stream) are done.

The switch is a ``contextvars.ContextVar``: each thread and each asyncio task sees its own value, setting it
touches no GPU state, so it is free under CUDA-graph capture and safe in multi-threaded servers.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .. import _checks, _runtime
from .op import moe_finalize_fuse_shared

_DEFERRED_FINALIZE: contextvars.ContextVar[bool] = contextvars.ContextVar("moefuse_deferred_finalize", default=False)


@contextlib.contextmanager
def deferred_finalize_context(enabled: bool = True) -> Iterator[None]:
    """Inside this block the experts runner returns a ``DeferredFinalizeOutput`` instead of combining.

    Nests: ``enabled=False`` inside an enabled block turns deferral off until it exits, and every exit restores
    the previous value (also on exceptions). Threads started inside do not inherit it (Python gives a new
    thread an empty context unless the caller runs it in ``contextvars.copy_context()``); asyncio tasks copy
    the context at creation, so a task created inside sees the value it had then, and later changes in one
    task never leak into another.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    token = _DEFERRED_FINALIZE.set(enabled)
    try:
        yield
    finally:
        _DEFERRED_FINALIZE.reset(token)


def deferred_finalize_enabled() -> bool:
    """Whether the current thread/task is inside an enabled ``deferred_finalize_context`` (default False)."""
    return _DEFERRED_FINALIZE.get()


def deferred_finalize_allowed() -> bool:
    """Whether the process default allows deferral (``moefuse.set_defaults(deferred_finalize=...)``; the environment
    variable ``MOEFUSE_ENABLE_DEFERRED_FINALIZE=0`` turns it off at import). A layer's ``deferred_finalize`` argument
    overrides it (``MoELayer.supports_deferred_finalize``)."""
    return _runtime.DEFAULTS.deferred_finalize


@dataclass(frozen=True, eq=False)
class DeferredFinalizeOutput:
    """What the experts runner returns inside ``deferred_finalize_context``: the inputs of the finalize op.

    No output buffer is allocated; ``finalize_deferred_output`` combines these rows with the shared-expert
    output in one pass. ``eq=False``: tensors have no single truth value, so instances compare by identity.

    Example (2 tokens, top-2; token 1's second routed choice, its slot 1, has no row; gemm2_out has one padding
    row)::

        >>> import torch
        >>> gemm2_out = torch.tensor([[1.0, 2.0], [10.0, 20.0], [0.0, 0.0], [100.0, 200.0]])
        >>> deferred = DeferredFinalizeOutput(
        ...     gemm2_out=gemm2_out,
        ...     expert_weights=torch.tensor([[0.5, 0.25], [1.0, 1.0]]),
        ...     expanded_idx_to_permuted_idx=torch.tensor([1, 0, 3, -1], dtype=torch.int32),
        ...     top_k=2,
        ... )
        >>> finalize_deferred_output(deferred, torch.ones(2, 2))
        tensor([[  6.2500,  11.5000],
                [101.0000, 201.0000]])
    """

    # [R, Hp] bf16/fp16/fp32: expert outputs, one row per (token, slot) pair in expert order (padding allowed).
    gemm2_out: torch.Tensor
    # [M, top_k] fp32/bf16: routing weights, scaling factor already applied.
    expert_weights: torch.Tensor
    # int32 [M * top_k]: row of gemm2_out holding slot k of token t at t * top_k + k, or -1 for no row.
    expanded_idx_to_permuted_idx: torch.Tensor
    # Slots per token (>= 1).
    top_k: int

    def __post_init__(self) -> None:
        gemm2_out = _checks.check_tensor("gemm2_out", self.gemm2_out, dtypes=_checks.FLOAT_DTYPES, ndim=2)
        top_k = _checks.check_int("top_k", self.top_k, low=1)
        weights = _checks.check_tensor(
            "expert_weights",
            self.expert_weights,
            dtypes=(torch.float32, torch.bfloat16),
            ndim=2,
            device=gemm2_out.device,
        )
        _checks.check_tensor("expert_weights", weights, shape=(None, top_k))
        _checks.check_tensor(
            "expanded_idx_to_permuted_idx",
            self.expanded_idx_to_permuted_idx,
            dtypes=(torch.int32,),
            shape=(weights.shape[0] * top_k,),
            device=gemm2_out.device,
        )


def finalize_deferred_output(
    deferred: DeferredFinalizeOutput,
    shared_output: torch.Tensor | None,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Fused combine + shared add of a deferred experts result: ``moe_finalize_fuse_shared`` on its fields.

    ``shared_output`` [M, H] of gemm2_out's dtype, or None for a model without shared experts. Returns
    ``out`` [M, H]; same errors, devices and CUDA-graph behaviour as ``moe_finalize_fuse_shared``.
    """
    if not isinstance(deferred, DeferredFinalizeOutput):
        raise TypeError(f"deferred must be a DeferredFinalizeOutput, got {type(deferred).__name__}")
    return moe_finalize_fuse_shared(
        deferred.gemm2_out,
        deferred.expanded_idx_to_permuted_idx,
        deferred.expert_weights,
        shared_output,
        deferred.top_k,
        out=out,
        backend=backend,
    )
