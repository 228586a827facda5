"""Experts stage: grouped GEMM1 with fused SwiGLU and GEMM2 over the rows of a dispatch plan."""

from .configs import GemmTiles, TileConfig, pick, pick_block_m

# fp8_mlp, mxfp4_w4a8, mxfp4_ws: the names the layer and the integrations import (moefuse/layer.py's ``fp8_mlp``
# among them), modules of the format folders under the flat names they had before fp8/ and mxfp4/ (the same module
# objects, so a patch on one is seen through the other).
from .fp8 import mlp as fp8_mlp
from .mxfp4 import w4a8 as mxfp4_w4a8
from .mxfp4 import ws as mxfp4_ws
from .op import (
    check_experts_shapes,
    cublas_mlp,
    experts_workspace,
    launch_variant,
    mlp_on_cublas,
    moe_experts,
    plan_block_m,
)
from .reference import moe_experts_torch

__all__ = [
    "GemmTiles", "TileConfig", "check_experts_shapes", "cublas_mlp", "experts_workspace", "fp8_mlp",
    "launch_variant", "mlp_on_cublas",
    "moe_experts", "moe_experts_torch", "mxfp4_w4a8",
    "mxfp4_ws", "pick", "pick_block_m", "plan_block_m",
]
