"""Dispatch stage: sort (token, slot) pairs by expert and schedule the experts' GEMM tiles, with no host sync.

A token's slot k is its k-th routed choice: column k of the router's ``topk_ids`` [M, K]."""

from .op import moe_dispatch
from .reference import DispatchPlan, max_tiles, moe_dispatch_torch

__all__ = ["DispatchPlan", "max_tiles", "moe_dispatch", "moe_dispatch_torch"]
