"""Small transformers MoE blocks of every SPEC §4 model, with random weights: the external oracle. Quantized ones
as transformers builds a checkpoint's (``quantized_block``), and their float64 twins (``dense_twin``).

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


def _kimi_k2(**overrides) -> nn.Module:
    # Kimi-K2 is a DeepSeek-V3 architecture with 384 experts in one group: keep E off powers of two.
    return _deepseek_v3(**{"n_routed_experts": 24, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
                           **overrides})


def _deepseek_v4(**overrides) -> nn.Module:
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    # A small swiglu_limit, so the clamp is active on random weights. mlp_layer_types=["hash_moe"]: hash-routed.
    base = dict(hidden_size=48, moe_intermediate_size=24, n_routed_experts=16, num_experts_per_tok=3,
                num_hidden_layers=1, mlp_layer_types=["moe"], swiglu_limit=0.02)
    return DeepseekV4SparseMoeBlock(DeepseekV4Config(**{**base, **overrides}), 0)


def _qwen3(**overrides) -> nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    base = dict(hidden_size=48, moe_intermediate_size=24, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
    return Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**{**base, **overrides}))


def _glm(**overrides) -> nn.Module:
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    base = dict(hidden_size=48, moe_intermediate_size=24, n_routed_experts=16, num_experts_per_tok=4,
                n_shared_experts=1)
    return Glm4MoeMoE(Glm4MoeConfig(**{**base, **overrides}))


BLOCKS: dict[str, Callable[..., nn.Module]] = {  # each takes config overrides
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
def quantized_block(name: str, gen: torch.Generator, routed: str | None, shared: str | None, *,
                    dtype: torch.dtype = torch.bfloat16, std: float = 0.1, **overrides) -> nn.Module:
    """A transformers block of model ``name`` (config ``overrides``) in ``dtype`` whose routed experts are ``routed``
    (None, "fp8" or "mxfp4": transformers' FP8Experts, ``expert_dtype="fp4"`` for MXFP4) and whose shared expert is
    ``shared`` (None or "fp8": FP8Linear), as transformers builds a checkpoint's modules: ``replace_with_fp8_linear``
    of its FineGrainedFP8 quantizer, with what stays unquantized in ``modules_to_not_convert``. Random weights,
    quantized ones drawn as N(0, std²) and quantized (``BlockFP8.quantize``, ``MXFP4.quantize``); fp32 scales (the
    layer converts ue8m0 ones as it does fp32 ones: tests/test_layer_mxfp4.py covers them). Eval mode."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    block = randomize_(BLOCKS[name](**overrides), gen, std).to(dtype).eval()
    table = getattr(block.gate, "tid2eid", None)
    if table is not None:  # hash-routed: distinct experts per token id, as the checkpoints' tables have
        E = block.experts.gate_up_proj.shape[0]
        table.copy_(torch.stack([torch.randperm(E, generator=gen)[: table.shape[1]] for _ in range(table.shape[0])]))
    skip = ["mlp.gate"] + ["mlp.experts"] * (routed is None) + ["mlp.shared_experts"] * (shared is None)
    if getattr(block, "shared_experts", None) is None and routed is None:
        return block
    config = FineGrainedFP8Config(weight_block_size=(128, 128), expert_dtype="fp4" if routed == "mxfp4" else "fp8",
                                  modules_to_not_convert=skip)
    holder = nn.Module()  # names as in a model ("mlp.experts"); the experts' config where a module has none
    holder.mlp, holder.config = block, block.experts.config
    replace_with_fp8_linear(holder, modules_to_not_convert=skip, quantization_config=config)
    for module in block.modules():  # the quantized modules come on the meta device: fill them
        for param_name, param in list(module.named_parameters(recurse=False)):
            if param.device.type == "meta" and not param_name.endswith("_scale_inv"):
                _fill_quantized_(module, param_name, param, gen, std)
    return block


def _fill_quantized_(module: nn.Module, name: str, values: torch.Tensor, gen: torch.Generator, std: float) -> None:
    """Quantized random values for ``module.<name>`` (on meta) and its ``<name>_scale_inv`` (an FP8Linear's
    ``weight`` has ``weight_scale_inv``) in the dtypes and shapes transformers allocated."""
    from moefuse.formats import MXFP4, BlockFP8

    scale_name = f"{name}_scale_inv"
    scales = getattr(module, scale_name)
    shape = (1, *values.shape) if values.dim() == 2 else tuple(values.shape)
    if values.dtype == torch.int8:  # FP4: two codes a byte along K
        q = MXFP4.quantize(torch.randn(*shape[:2], 2 * shape[2], generator=gen) * std)
        new_scales = torch.exp2(q.scales.float() - 127).to(scales.dtype)
        new_values = q.values.view(torch.int8)
    else:
        q = BlockFP8.quantize(torch.randn(*shape, generator=gen) * std)
        # transformers allocates at least two block rows for a fused gate_up: the rows past the format are unused
        new_scales = torch.ones(scales.shape if values.dim() == 3 else (1, *scales.shape))
        new_scales[:, : q.scales.shape[1]] = q.scales
        new_values = q.values
    if values.dim() == 2:
        new_values, new_scales = new_values[0], new_scales[0]
    setattr(module, name, nn.Parameter(new_values, requires_grad=False))
    setattr(module, scale_name, nn.Parameter(new_scales, requires_grad=False))


@torch.no_grad()
def load_dequantized_(dense: nn.Module, block: nn.Module, layer: nn.Module) -> nn.Module:
    """Fill a float transformers block ``dense`` with what a (possibly quantized) ``block`` computes: its router
    (bias, hash table), and the routed and shared expert weights of ``layer`` (``moefuse.from_hf(block)``),
    dequantized where they are quantized."""
    dense.gate.weight.copy_(block.gate.weight)
    for name in ("e_score_correction_bias", "tid2eid"):
        if getattr(block.gate, name, None) is not None:
            getattr(dense.gate, name).copy_(getattr(block.gate, name))
    for name, weight in zip(("gate_up_proj", "down_proj"), layer.experts.weights()):
        value = weight if isinstance(weight, torch.Tensor) else weight.dequantize(torch.float64)
        getattr(dense.experts, name).copy_(value)
    if layer.shared_experts is None:
        return dense
    if layer.shared_quant == "fp8":
        shared_up, shared_down = (w.dequantize(torch.float64)[0] for w in layer.shared_weights())
        width = shared_up.shape[0] // 2
        weights = {"gate_proj": shared_up[:width], "up_proj": shared_up[width:], "down_proj": shared_down}
    else:
        weights = {name: getattr(layer.shared_experts, name).weight for name in ("gate_proj", "up_proj", "down_proj")}
    for name, weight in weights.items():
        getattr(dense.shared_experts, name).weight.copy_(weight)
    return dense


def dense_twin(block: nn.Module, layer: nn.Module) -> nn.Module:
    """transformers' own block of ``block``'s class and config in float64, computing what ``block`` does with its
    weights unpacked and dequantized (:func:`load_dequantized_`): the external oracle of a quantized block."""
    config = block.experts.config
    dense = type(block)(config, 0) if type(block).__name__ == "DeepseekV4SparseMoeBlock" else type(block)(config)
    return load_dequantized_(dense.double().eval(), block, layer)
