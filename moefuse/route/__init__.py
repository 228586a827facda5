"""Route stage (SPEC §1): router logits → per-token expert weights and ids."""

from moefuse.route.op import moe_fused_gate
from moefuse.route.reference import moe_fused_gate_torch

__all__ = ["moe_fused_gate", "moe_fused_gate_torch"]
