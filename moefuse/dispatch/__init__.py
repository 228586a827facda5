"""Dispatch stage: sort (token, slot) pairs by expert and schedule the experts' GEMM tiles, with no host sync."""

from .op import moe_dispatch
from .reference import DispatchPlan, max_tiles, moe_dispatch_torch

__all__ = ["DispatchPlan", "max_tiles", "moe_dispatch", "moe_dispatch_torch"]
