"""DeepSeek-V4's MXFP4 layer (SPEC §6): ``MoELayer(quant="mxfp4")`` against float64 on the unpacked weights, and
transformers' DeepSeek-V4 blocks with FP4 experts (routed and hash-routed) through ``from_hf`` and ``patch``."""

from __future__ import annotations

import math

import pytest
import torch
from hf_blocks import load_dequantized_

import moefuse
from moefuse import MoELayer, moe_layer_torch
from moefuse.config import MoEConfig
from moefuse.formats import LAYER_FORMATS, MXFP4, BlockFP8
from moefuse.testing import assert_rel_close, rel_error

BACKENDS = ["reference", "triton"]
# The shared expert is fp8 block-scale (as DeepSeek-V4 ships it), so I is a multiple of 128.
CONFIG = MoEConfig(96, 128, 6, 3, num_shared_experts=1, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
                   swiglu_limit=0.5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens", [1, 9])
def test_layer_matches_float64(backend, tokens, gen, device):
    layer = MoELayer(CONFIG, quant="mxfp4", device=device, backend=backend).init_random_(seed=3, std=0.1)
    assert isinstance(layer.experts.weights()[0], MXFP4) and isinstance(layer.shared_weights()[0], BlockFP8)
    assert layer.experts.gate_up_proj.dtype == torch.int8
    assert layer.experts.gate_up_proj_scale_inv.dtype == torch.float8_e8m0fnu
    x = torch.randn(tokens, CONFIG.hidden_size, generator=gen).bfloat16().to(device)
    with torch.no_grad():
        got = layer(x)
        want = moe_layer_torch(layer, x, route_dtype=torch.float32)
    assert_rel_close(got.double(), want, 1e-2, f"mxfp4 layer ({backend})")


def test_layer_refuses_what_it_cannot_run():
    with pytest.raises(TypeError, match="mxfp4"):
        MoELayer(CONFIG, dtype=torch.float16, quant="mxfp4")
    with pytest.raises(ValueError, match="32"):
        MoELayer(MoEConfig(80, 48, 4, 2), quant="mxfp4")
    layer = MoELayer(CONFIG, quant="mxfp4").init_random_()
    layer.check_weights()
    with torch.no_grad():
        layer.experts.down_proj_scale_inv.view(torch.uint8)[1, 2, 0] = 255  # NaN: outside the kernels' range
    with pytest.raises(ValueError, match="down_proj_scale_inv"):
        layer.check_weights()


def _fp4_block(gen, *, hash_routed: bool = False, vocab: int = 40):
    """transformers' DeepSeek-V4 block with its FP4 experts (ue8m0 scales) and an FP8Linear shared expert."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    pytest.importorskip("transformers.models.deepseek_v4")
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    H, I, E = CONFIG.hidden_size, CONFIG.intermediate_size, CONFIG.num_experts
    config = DeepseekV4Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=3,
                              num_hidden_layers=1, mlp_layer_types=["hash_moe" if hash_routed else "moe"],
                              swiglu_limit=0.5, vocab_size=vocab)
    block = DeepseekV4SparseMoeBlock(config, 0).eval()
    try:
        experts = fp8.FP8Experts(config, block_size=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4")
    except TypeError:
        pytest.skip("this transformers has no FP4 experts")
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, H, generator=gen) * 0.1)
        if hash_routed:
            block.gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=gen)[:3] for _ in range(vocab)]))
        else:
            block.gate.e_score_correction_bias.copy_(torch.rand(E, generator=gen) * 0.1)
        for name, shape in (("gate_up_proj", (E, 2 * I, H)), ("down_proj", (E, H, I))):
            q = MXFP4.quantize(torch.randn(*shape, generator=gen) * 0.1)
            getattr(experts, name).copy_(q.values.view(torch.int8))
            getattr(experts, f"{name}_scale_inv").view(torch.uint8).copy_(q.scales)
    block.experts = experts
    for name, (out_f, in_f) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        linear = fp8.FP8Linear(in_f, out_f, block_size=(128, 128))
        q = BlockFP8.quantize(torch.randn(1, out_f, in_f, generator=gen) * 0.1)
        linear.weight.data, linear.weight_scale_inv.data = q.values[0], q.scales[0]
        setattr(block.shared_experts, name, linear)
    return block


def _dense_twin(block, layer):
    """The same transformers block in float64 with the weights unpacked (routed) and dequantized (shared)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    return load_dequantized_(DeepseekV4SparseMoeBlock(block.experts.config, 0).double().eval(), block, layer)


@pytest.mark.parametrize("hash_routed", [False, True], ids=["routed", "hash-routed"])
def test_from_hf_fp4_block(hash_routed, gen):
    """Shares the block's tensors, matches float64 on the unpacked weights (1e-2), and transformers' own block on
    them in float64 up to the fp8 shared expert's activation quantization (SPEC §5)."""
    block = _fp4_block(gen, hash_routed=hash_routed)
    layer = moefuse.from_hf(block)
    assert layer.quant == "mxfp4" and layer.experts.gate_up_proj is block.experts.gate_up_proj
    assert layer.experts.down_proj_scale_inv.data_ptr() == block.experts.down_proj_scale_inv.data_ptr()
    x = torch.randn(2, 5, CONFIG.hidden_size, generator=gen).bfloat16()
    input_ids = torch.randint(0, 40, (2, 5), generator=gen) if hash_routed else None
    with torch.no_grad():
        got = layer(x, input_ids=input_ids)
        want = moe_layer_torch(layer, x, route_dtype=torch.float32, input_ids=input_ids)
        dense = _dense_twin(block, layer)
        hf = dense(x.double(), input_ids=input_ids) if hash_routed else dense(x.double())
    assert_rel_close(got.double(), want, 1e-2, "fp4 layer from transformers vs float64")
    err = rel_error(got.double(), hf)
    assert err < 0.1, f"vs transformers' block on the unpacked weights: {err:.3e}"


def test_experts_interface_runs_fp4_experts(gen):
    """transformers' FP4 experts module run by moefuse (``experts_implementation="moefuse"``)."""
    moefuse.register_experts_implementation()
    block = _fp4_block(gen)
    experts = block.experts
    experts.config._experts_implementation = "moefuse"
    x = torch.randn(6, CONFIG.hidden_size, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(CONFIG.num_experts, generator=gen)[:3] for _ in range(6)])
    weights = torch.rand(6, 3, generator=gen)
    got = moefuse.hf.experts_forward(experts, x, ids, weights)
    layer = moefuse.from_hf(block)
    gate_up, down = (w.dequantize(torch.float64) for w in layer.experts.weights())
    want = torch.zeros(6, CONFIG.hidden_size, dtype=torch.float64)
    for t in range(6):
        for k in range(3):
            h = x[t].double() @ gate_up[ids[t, k]].T
            gate, up = h[:128].clamp(max=0.5), h[128:].clamp(-0.5, 0.5)
            want[t] += weights[t, k] * ((torch.nn.functional.silu(gate) * up) @ down[ids[t, k]].T)
    assert_rel_close(got.double(), want, 1e-2, "experts interface, fp4")


def test_experts_interface_converts_fp32_scales_once(gen, monkeypatch):
    """FP4 experts whose scales are fp32 powers of two: the experts interface converts them to exponents on the
    first call only (the conversion reads the device), and again once the tensor is changed in place."""
    E, H, I = 3, 64, 32
    experts = torch.nn.Module()
    for name, (n, k) in {"gate_up_proj": (2 * I, H), "down_proj": (H, I)}.items():
        w = MXFP4.quantize(torch.randn(E, n, k, generator=gen) / math.sqrt(k))
        setattr(experts, name, torch.nn.Parameter(w.values.view(torch.int8), requires_grad=False))
        scales = torch.exp2(w.scales.float() - 127)
        setattr(experts, f"{name}_scale_inv", torch.nn.Parameter(scales, requires_grad=False))
    calls = []
    fmt = LAYER_FORMATS["mxfp4"]
    convert = fmt.checkpoint_scales
    monkeypatch.setattr(fmt, "checkpoint_scales", lambda v, s: calls.append(s) or convert(v, s))
    x = torch.randn(4, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(4)])
    weights = torch.rand(4, 2, generator=gen)
    first = moefuse.hf.experts_forward(experts, x, ids, weights)
    again = moefuse.hf.experts_forward(experts, x, ids, weights)
    assert len(calls) == 2 and torch.equal(first, again)  # gate_up's and down's scales, converted once each
    with torch.no_grad():
        experts.down_proj_scale_inv.mul_(2.0)  # still powers of two: the output doubles, exactly
    doubled = moefuse.hf.experts_forward(experts, x, ids, weights)
    assert len(calls) == 3 and torch.equal(doubled, 2 * first)
