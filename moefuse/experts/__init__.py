"""Experts stage: grouped GEMM1 with fused SwiGLU and GEMM2 over the rows of a dispatch plan."""

from .configs import GemmTiles, TileConfig, pick, pick_block_m
from .op import check_experts_shapes, moe_experts, plan_block_m
from .reference import moe_experts_torch

__all__ = [
    "GemmTiles", "TileConfig", "check_experts_shapes", "moe_experts", "moe_experts_torch", "pick", "pick_block_m",
    "plan_block_m",
]
