"""transformers blocks whose routed and shared experts are in different formats, built as transformers builds a
checkpoint's modules (``replace_with_fp8_linear`` with the unquantized modules in ``modules_to_not_convert``):
routed {bf16, FP8Experts fp8, FP8Experts fp4} x shared {nn.Linear bf16, FP8Linear fp8}, each through
``moefuse.from_hf`` and ``moefuse.patch`` against transformers' own block on the dequantized weights (float64)."""

from __future__ import annotations

import inspect

import pytest
import torch
from hf_blocks import dense_twin, quantized_block

import moefuse
from moefuse import MoELayer, moe_layer_torch
from moefuse.hf import unsupported_reason
from moefuse.testing import assert_rel_close, rel_error

fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
pytest.importorskip("transformers.models.deepseek_v4")
from transformers import FineGrainedFP8Config  # noqa: E402 (after the skips above)

if not all("expert_dtype" in inspect.signature(f).parameters for f in (fp8.FP8Experts, FineGrainedFP8Config)):
    pytest.skip("this transformers has no FP4 experts", allow_module_level=True)
MIXES = [(routed, shared) for routed in (None, "fp8", "mxfp4") for shared in (None, "fp8")]
MIX_IDS = [f"{routed}-{shared}" for routed, shared in MIXES]
H = 64  # a multiple of 32 (MXFP4), not of 128 (fp8's partial blocks)


def _block(name: str, gen: torch.Generator, routed: str | None, shared: str | None, **overrides) -> torch.nn.Module:
    """I = 128 beside an fp8 shared expert (its gate and up blocks are separate), else 96: a multiple of 32, not of
    128. DeepSeek-V4's clamp at 0.5, active on these weights."""
    sizes = dict(hidden_size=H, moe_intermediate_size=128 if shared == "fp8" else 96)
    if name == "deepseek-v4-flash":
        sizes["swiglu_limit"] = 0.5
    return quantized_block(name, gen, routed, shared, **{**sizes, **overrides})


def _tolerance(layer: MoELayer) -> float:
    """Against transformers' block on the dequantized weights: the fp8 activation quantization (SPEC §5) is a few
    e4m3 steps where any expert is fp8 (measured up to 5.6e-2), otherwise the bf16 roundings (measured 6e-3)."""
    return 0.1 if "fp8" in (layer.quant, layer.shared_quant) else 1e-2


@pytest.mark.parametrize(("routed", "shared"), MIXES, ids=MIX_IDS)
def test_from_hf_reads_each_format_off_the_block(routed, shared, gen, device):
    """DeepSeek-V4 (the model that ships FP4 experts): the layer takes each format as the block has it, shares its
    tensors, runs the Triton kernels (interpreted on a CPU) and matches float64 and transformers' own block."""
    block = _block("deepseek-v4-flash", gen, routed, shared, n_routed_experts=8).to(device)  # 8: fewer tiles
    assert unsupported_reason(block) is None
    layer = moefuse.from_hf(block, backend="triton")
    assert (layer.quant, layer.shared_quant) == (routed, shared)
    assert layer.experts.gate_up_proj is block.experts.gate_up_proj
    assert layer.shared_experts.down_proj is block.shared_experts.down_proj
    assert layer.shared_slot_weights() is None  # from_hf keeps the block's separate tensors
    x = torch.randn(1, 5, H, generator=gen).bfloat16().to(device)
    with torch.no_grad():
        got = layer(x).cpu()
        want = moe_layer_torch(layer, x, route_dtype=torch.float32).cpu()
        hf = dense_twin(block, layer)(x.double().cpu())
    assert_rel_close(got.double(), want, 1e-2, f"routed {routed}, shared {shared} vs float64")
    err = rel_error(got.double(), hf)
    assert err < _tolerance(layer), f"vs transformers' block on the dequantized weights: {err:.3e}"


BLOCK_MIXES = [(name, routed, shared) for name in ("deepseek-v3", "glm-4.5-air", "deepseek-v4-hash")
               for routed, shared in MIXES] + [("qwen3-30b-a3b", routed, None) for routed in (None, "fp8", "mxfp4")]


@pytest.mark.parametrize(("name", "routed", "shared"), BLOCK_MIXES,
                         ids=[f"{name}-{routed}-{shared}" for name, routed, shared in BLOCK_MIXES])
def test_patch_takes_each_mix(name, routed, shared, gen):
    """Every supported block with a shared expert (Qwen3-MoE has none: its routed formats), patched inside a model
    (the reference backend), against transformers' own block; unpatch puts the block back."""
    hashed = name == "deepseek-v4-hash"
    extra = dict(mlp_layer_types=["hash_moe"], vocab_size=40) if hashed else {}
    block = _block("deepseek-v4-flash" if hashed else name, gen, routed, shared, **extra)
    model = torch.nn.Module()
    model.mlp = block
    report = moefuse.patch(model, backend="reference")
    assert report.patched == ["mlp"] and not report.skipped, report
    layer = model.mlp
    assert isinstance(layer, MoELayer) and (layer.quant, layer.shared_quant) == (routed, shared)
    x = torch.randn(1, 6, H, generator=gen).bfloat16()
    ids = torch.randint(0, 40, (1, 6), generator=gen) if hashed else None
    with torch.no_grad():
        got = layer(x, input_ids=ids)
        dense = dense_twin(block, layer)
        hf = dense(x.double(), input_ids=ids) if hashed else dense(x.double())
    err = rel_error(got.double(), hf)
    assert err < _tolerance(layer), f"{name}: vs transformers' block on the dequantized weights: {err:.3e}"
    assert moefuse.unpatch(model) == ["mlp"] and model.mlp is block


def test_fp8_shared_expert_of_odd_width_is_skipped(gen):
    """An fp8 shared expert of width 96: refused with the reason (a bf16 one of that width is taken, above)."""
    block = _block("deepseek-v4-flash", gen, "mxfp4", "fp8", moe_intermediate_size=96)
    assert "multiple of 128" in unsupported_reason(block)
    model = torch.nn.Module()
    model.mlp = block
    report = moefuse.patch(model)
    assert report.patched == [] and "separate" in report.skipped["mlp"]
    with pytest.raises(ValueError, match="multiple of 128"):
        moefuse.from_hf(block)


def test_activation_dtype_follows_a_plain_shared_expert(gen):
    """FP4 experts beside a bf16 shared expert: the hidden states are bf16 (the shared expert's dtype); another
    dtype asked for is refused at construction, naming it."""
    block = _block("deepseek-v4-flash", gen, "mxfp4", None)
    assert moefuse.from_hf(block).activation_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="activation_dtype"):
        moefuse.from_hf(block, activation_dtype=torch.float16)


def test_patch_passes_activation_quant(gen):
    """``patch(activation_quant="fp8")`` makes FP4 experts W4A8 (here on the reference backend); a block it does not
    apply to (bf16 experts) is refused naming the block, before any block is replaced."""
    fp4 = _block("deepseek-v4-flash", gen, "mxfp4", "fp8")
    model = torch.nn.Module()
    model.mlp = fp4
    moefuse.patch(model, backend="reference", activation_quant="fp8")
    layer = model.mlp
    assert layer.activation_quant == "fp8"
    x = torch.randn(4, H, generator=gen).bfloat16()
    with torch.no_grad():
        assert_rel_close(layer(x).double(), moe_layer_torch(layer, x, route_dtype=torch.float32), 5e-2, "W4A8")
    assert moefuse.from_hf(fp4, backend="reference", activation_quant="fp8").activation_quant == "fp8"
    assert moefuse.from_hf(fp4).activation_quant is None  # W4A16 by default

    model = torch.nn.ModuleDict({"first": _block("deepseek-v4-flash", gen, "mxfp4", None),
                                 "second": _block("deepseek-v4-flash", gen, None, None)})
    blocks = dict(model.items())
    with pytest.raises(ValueError, match=r"second: activation_quant='fp8'"):
        moefuse.patch(model, backend="reference", activation_quant="fp8")
    assert dict(model.items()) == blocks  # nothing replaced
    # The kernels' backends take W4A8 at widths of 128s only (H = 64 here): refused when the layer is built
    with pytest.raises(ValueError, match=r"first: activation_quant='fp8'.*multiples of 128"):
        moefuse.patch(model, activation_quant="fp8")
    assert dict(model.items()) == blocks
