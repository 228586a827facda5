"""moefuse: fast, exact mixture-of-experts kernels for LLM inference.

Stages (each a public op with a PyTorch reference beside its Triton kernel; SPEC.md is the contract):

- route:    ``router_logits``             hidden states -> fp32 router logits
            ``moe_fused_gate``            logits -> top-k weights and expert ids
- dispatch: ``moe_dispatch``              expert ids -> rows sorted by expert and a GEMM tile schedule
- experts:  ``moe_experts``               grouped GEMM1 + SwiGLU + GEMM2 -> one row per (token, slot)
- finalize: ``moe_finalize_fuse_shared``  weighted combine of each token's rows + shared expert output

``MoELayer`` composes them (with deferred finalize and the shared expert on a side stream, bf16 or fp8 experts:
``moefuse.formats``); ``moefuse.parallel`` shards it over a process group;
``moefuse.hf`` plugs them into transformers; ``warmup`` compiles every kernel variant before serving.
"""

from moefuse._runtime import set_defaults
from moefuse.config import PRESETS, MoEConfig, preset
from moefuse.dispatch import DispatchPlan, moe_dispatch, moe_dispatch_torch
from moefuse.experts import moe_experts, moe_experts_torch
from moefuse.finalize import (
    DeferredFinalizeOutput,
    deferred_finalize_context,
    deferred_finalize_enabled,
    finalize_deferred_output,
    moe_finalize_fuse_shared,
    moe_finalize_fuse_shared_torch,
)
from moefuse.hf import from_hf, patch, register_experts_implementation, unpatch
from moefuse.layer import MoELayer
from moefuse.reference import moe_layer_torch
from moefuse.route import moe_fused_gate, moe_fused_gate_torch, router_logits, router_logits_torch
from moefuse.warmup import WarmupReport, warmup

__version__ = "1.0.0"

__all__ = [
    "PRESETS",
    "DeferredFinalizeOutput",
    "DispatchPlan",
    "MoEConfig",
    "MoELayer",
    "deferred_finalize_context",
    "deferred_finalize_enabled",
    "finalize_deferred_output",
    "from_hf",
    "moe_dispatch",
    "moe_dispatch_torch",
    "moe_experts",
    "moe_experts_torch",
    "moe_finalize_fuse_shared",
    "moe_finalize_fuse_shared_torch",
    "moe_fused_gate",
    "moe_fused_gate_torch",
    "moe_layer_torch",
    "patch",
    "preset",
    "register_experts_implementation",
    "set_defaults",
    "router_logits",
    "router_logits_torch",
    "unpatch",
    "warmup",
    "WarmupReport",
]
