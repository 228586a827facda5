"""Route stage (SPEC §1): the router linear (hidden states → fp32 logits), then logits → top-k weights and ids."""

from moefuse.route.op import moe_fused_gate, router_logits
from moefuse.route.reference import moe_fused_gate_torch, router_logits_torch

__all__ = ["moe_fused_gate", "moe_fused_gate_torch", "router_logits", "router_logits_torch"]
