"""Finalize stage: weighted combine of the experts' rows plus the shared-expert output, and deferred finalize."""

from .deferred import (
    DeferredFinalizeOutput,
    deferred_finalize_allowed,
    deferred_finalize_context,
    deferred_finalize_enabled,
    finalize_deferred_output,
)
from .op import moe_finalize_fuse_shared
from .reference import moe_finalize_fuse_shared_torch

__all__ = [
    "DeferredFinalizeOutput",
    "deferred_finalize_allowed",
    "deferred_finalize_context",
    "deferred_finalize_enabled",
    "finalize_deferred_output",
    "moe_finalize_fuse_shared",
    "moe_finalize_fuse_shared_torch",
]
