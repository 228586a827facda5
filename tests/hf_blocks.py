"""Small transformers MoE blocks of every SPEC §4 model, with random weights: the external oracle.

Routing is chosen so transformers and SPEC agree on what a dropped group means: expert biases are
non-negative and sigmoid scores positive, so every key is positive and a 0.0 mask (older transformers) and a
-inf mask (DeepSeek's code, SPEC) drop the same experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def _deepseek_v3(**overrides) -> nn.Module:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    base = dict(hidden_size=48, moe_intermediate_size=24, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    return DeepseekV3MoE(DeepseekV3Config(**{**base, **overrides}))


def _kimi_k2() -> nn.Module:
    # Kimi-K2 is a DeepSeek-V3 architecture with 384 experts in one group: keep E off powers of two.
    return _deepseek_v3(n_routed_experts=24, n_group=1, topk_group=1, routed_scaling_factor=2.827)


def _deepseek_v4() -> nn.Module:
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    # A small swiglu_limit, so the clamp is active on random weights.
    config = DeepseekV4Config(hidden_size=48, moe_intermediate_size=24, n_routed_experts=16, num_experts_per_tok=3,
                              num_hidden_layers=1, mlp_layer_types=["moe"], swiglu_limit=0.02)
    return DeepseekV4SparseMoeBlock(config, 0)


def _qwen3() -> nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=24, num_experts=16,
                                                 num_experts_per_tok=4, norm_topk_prob=True))


def _glm() -> nn.Module:
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    return Glm4MoeMoE(Glm4MoeConfig(hidden_size=48, moe_intermediate_size=24, n_routed_experts=16,
                                    num_experts_per_tok=4, n_shared_experts=1))


BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "deepseek-v3": _deepseek_v3,
    "kimi-k2": _kimi_k2,
    "deepseek-v4-flash": _deepseek_v4,
    "qwen3-30b-a3b": _qwen3,
    "glm-4.5-air": _glm,
}


@torch.no_grad()
def randomize_(module: nn.Module, gen: torch.Generator, std: float = 0.1) -> nn.Module:
    """Random weights (transformers leaves expert tensors empty and router weights zero); biases in [0, 0.1)."""
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            tensor.copy_(torch.rand(tensor.shape, generator=gen) * 0.1)
        elif tensor.is_floating_point():
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * std)
    return module


def block(name: str, gen: torch.Generator) -> nn.Module:
    """A randomly initialised fp32 transformers block of model ``name``, in eval mode."""
    return randomize_(BLOCKS[name](), gen).eval()


@torch.no_grad()
def load_dequantized_(dense: nn.Module, block: nn.Module, layer: nn.Module) -> nn.Module:
    """Fill a float transformers block ``dense`` with what a quantized ``block`` computes: its router (bias, hash
    table), and the dequantized routed and fp8 shared expert weights of ``layer`` (``MoELayer.from_hf(block)``)."""
    dense.gate.weight.copy_(block.gate.weight)
    for name in ("e_score_correction_bias", "tid2eid"):
        if getattr(block.gate, name, None) is not None:
            getattr(dense.gate, name).copy_(getattr(block.gate, name))
    gate_up, down = layer.experts.weights()
    dense.experts.gate_up_proj.copy_(gate_up.dequantize(torch.float64))
    dense.experts.down_proj.copy_(down.dequantize(torch.float64))
    shared_up, shared_down = (w.dequantize(torch.float64)[0] for w in layer.shared_fp8_weights())
    width = shared_up.shape[0] // 2
    dense.shared_experts.gate_proj.weight.copy_(shared_up[:width])
    dense.shared_experts.up_proj.weight.copy_(shared_up[width:])
    dense.shared_experts.down_proj.weight.copy_(shared_down)
    return dense
