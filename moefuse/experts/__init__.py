"""Experts stage: grouped GEMM1 with fused SwiGLU and GEMM2 over the rows of a dispatch plan.

The public names are below; the layer and the integrations import the rest from ``experts.op`` (what the op decides
per format: ``launch_variant``, ``mlp_on_cublas`` ...) and the format folders (``experts.fp8``, ``experts.mxfp4``).
"""

from .configs import GemmTiles, TileConfig, pick, pick_block_m
from .op import experts_workspace, moe_experts, plan_block_m, rows_linear
from .reference import moe_experts_torch

__all__ = [
    "GemmTiles", "TileConfig", "experts_workspace", "moe_experts", "moe_experts_torch", "pick", "pick_block_m",
    "plan_block_m", "rows_linear",
]
