"""transformers' FP8 experts (FP8Experts, FP8Linear shared expert) through moefuse: from_hf shares the block's
tensors, and the experts interface runs them; both against the float64 reference of SPEC §5."""

from __future__ import annotations

import pytest
import torch
from hf_blocks import load_dequantized_

import moefuse
from moefuse import moe_layer_torch, register_experts_implementation
from moefuse.experts.reference import dequantize_rows, quantize_rows
from moefuse.formats import BlockFP8
from moefuse.testing import assert_rel_close, rel_error

fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
if not all(hasattr(fp8, name) for name in ("FP8Experts", "FP8Linear", "ALL_FP8_EXPERTS_FUNCTIONS")):
    pytest.skip("this transformers has no FP8 experts interface", allow_module_level=True)
H, I, E, K = 200, 128, 8, 2


def _config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                            n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                            norm_topk_prob=True)


def _quantized(shape, gen) -> BlockFP8:
    return BlockFP8.quantize(torch.randn(*shape, generator=gen) * 0.1)


def _fp8_experts(config, gen):
    from transformers.integrations.moe import use_experts_implementation

    cls = use_experts_implementation(fp8.FP8Experts, experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    experts = cls(config, block_size=(128, 128))
    with torch.no_grad():
        for name, shape in (("gate_up_proj", (E, 2 * I, H)), ("down_proj", (E, H, I))):
            q = _quantized(shape, gen)
            getattr(experts, name).data = q.values
            scales = getattr(experts, f"{name}_scale_inv")
            scales.data = torch.ones(scales.shape)
            scales.data[:, : q.scales.shape[1]] = q.scales
    return experts


def _fp8_block(gen):
    """A DeepSeek-V3 block with transformers' FP8 experts and FP8Linear shared projections, random weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = _config()
    block = DeepseekV3MoE(config).eval()
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, H, generator=gen) * 0.1)
        block.gate.e_score_correction_bias.copy_(torch.rand(E, generator=gen) * 0.1)
    block.experts = _fp8_experts(config, gen)
    for name, (out_f, in_f) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        linear = fp8.FP8Linear(in_f, out_f, block_size=(128, 128))
        q = _quantized((1, out_f, in_f), gen)
        linear.weight.data, linear.weight_scale_inv.data = q.values[0], q.scales[0]
        setattr(block.shared_experts, name, linear)
    return block


def test_from_hf_shares_and_matches_float64(gen):
    block = _fp8_block(gen)
    layer = moefuse.from_hf(block)
    assert layer.quant == "fp8" and layer.experts.gate_up_proj is block.experts.gate_up_proj
    assert layer.shared_experts.up_proj is block.shared_experts.up_proj
    x = torch.randn(7, H, generator=gen).bfloat16()
    with torch.no_grad():
        got = layer(x)
        want = moe_layer_torch(layer, x, route_dtype=torch.float32)
    assert_rel_close(got.float(), want, 1e-2, "fp8 layer from transformers")


def test_against_transformers_dequantized_block(gen):
    """transformers' own block on the dequantized weights (float64): the difference is the activation and
    intermediate quantization of SPEC §5, a few e4m3 steps (~6%) at most, far from a wrong expert or scale."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    block = _fp8_block(gen)
    layer = moefuse.from_hf(block)
    dense = load_dequantized_(DeepseekV3MoE(_config()).double().eval(), block, layer)
    with torch.no_grad():
        x = torch.randn(1, 9, H, generator=gen).bfloat16()
        err = rel_error(layer(x).double(), dense(x.double()))
    print(f"rel err vs transformers (dequantized, float64): {err:.3e}")
    assert err < 0.1, err


def test_experts_interface_runs_fp8_experts(gen):
    register_experts_implementation()
    config = _config()
    config._experts_implementation = "moefuse"
    experts = _fp8_experts(config, gen)
    x = torch.randn(6, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(6)])
    weights = torch.rand(6, K, generator=gen)
    with torch.no_grad():
        got = experts(x, ids, weights)
    rows = dequantize_rows(*quantize_rows(x), torch.float64)
    gate_up = BlockFP8(experts.gate_up_proj, experts.gate_up_proj_scale_inv[:, :2]).dequantize(torch.float64)
    down = BlockFP8(experts.down_proj, experts.down_proj_scale_inv).dequantize(torch.float64)
    want = torch.zeros(6, H, dtype=torch.float64)
    for t in range(6):
        for k in range(K):
            h = rows[t] @ gate_up[ids[t, k]].T
            act = torch.nn.functional.silu(h[:I]) * h[I:]
            act = dequantize_rows(*quantize_rows(act.float()[None]), torch.float64)[0]
            want[t] += weights[t, k] * (act @ down[ids[t, k]].T)
    assert_rel_close(got.double(), want, 1e-2, "experts interface, fp8")
