"""Experts stage: grouped GEMM1 with fused SwiGLU and GEMM2 over the rows of a dispatch plan.

The public names are below; the layer and the integrations import the rest from ``experts.op`` (what the op decides
per format: ``launch_variant``, ``mlp_on_cublas`` ...) and the format folders (``experts.fp8``, ``experts.mxfp4``).
"""

from .._deprecation import moved_names
from .configs import GemmTiles, TileConfig, pick, pick_block_m
from .op import experts_workspace, moe_experts, plan_block_m, rows_linear
from .reference import moe_experts_torch

__all__ = [
    "GemmTiles", "TileConfig", "experts_workspace", "moe_experts", "moe_experts_torch", "pick", "pick_block_m",
    "plan_block_m", "rows_linear",
]

# Internal names this package re-exported before 1.0: they still resolve, with a DeprecationWarning, until 1.1.
__getattr__ = moved_names(__name__, {
    **{name: f"moefuse.experts.op.{name}"
       for name in ("check_experts_shapes", "cublas_mlp", "launch_variant", "mlp_on_cublas")},
    "fp8_mlp": "moefuse.experts.fp8.mlp", "mxfp4_w4a8": "moefuse.experts.mxfp4.w4a8",
    "mxfp4_ws": "moefuse.experts.mxfp4.ws",
}, removed_in="1.1")
