"""MoELayer with fp8 block-scale experts and shared expert (quant="fp8"): against the float64 reference of the same
numerics (SPEC §5), both ways of running the shared expert, checkpoint names, and what is refused."""

from __future__ import annotations

import pytest
import torch
from hf_blocks import block
from tolerances import experts_tolerance

import moefuse
from moefuse import MoEConfig, MoELayer, moe_layer_torch
from moefuse.experts import op as experts_op
from moefuse.experts import pick_block_m, plan_block_m
from moefuse.experts.fp8 import kernels as fp8_kernels
from moefuse.experts.reference import expert_mlp_torch
from moefuse.formats import BlockFP8
from moefuse.layer import routed_experts
from moefuse.testing import assert_rel_close, rms_rel_error

# I a multiple of 128 (a shared expert's gate and up blocks are separate); H not one (partial blocks and groups)
CONFIG = MoEConfig(hidden_size=200, intermediate_size=128, num_experts=6, top_k=2, num_shared_experts=1,
                   num_expert_group=2, topk_group=1, routed_scaling_factor=2.5)
BACKENDS = ["reference", "triton"]
# These layers' few tokens run 16-row tiles. Their max error against float64 is usually 5e-3, but a GEMM1 sum near
# an e4m3 tie flips one rounding of the intermediate (a 3-token split layer met 2.4e-2 through the interpreter, seed
# 3884021315): the table's bound for the path, not a tighter one.
FP8_MAX = experts_tolerance("fp8", 16)[0]


def _layer(backend: str, seed: int, device, config: MoEConfig = CONFIG) -> MoELayer:
    return MoELayer(config, dtype=torch.bfloat16, device=device, backend=backend, quant="fp8").init_random_(seed, 0.1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens", [0, 1, 9])
def test_matches_float64_reference(backend, tokens, gen, device):
    layer = _layer(backend, int(torch.randint(1 << 30, (), generator=gen)), device)
    x = torch.randn(tokens, CONFIG.hidden_size, generator=gen).to(device, torch.bfloat16)
    with torch.no_grad():
        got = layer(x)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert_rel_close(got.float(), moe_layer_torch(layer, x, route_dtype=torch.float32), FP8_MAX)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_expert_as_slot_and_as_its_own_gemm(backend, gen, device):
    """Every batch runs the shared expert as a slot of the grouped GEMMs; padded tokens (num_token_non_padded) take
    the one-expert grouped GEMM instead, and keep their shared expert."""
    layer = _layer(backend, 3, device)
    x = torch.randn(6, CONFIG.hidden_size, generator=gen).to(device, torch.bfloat16)
    assert layer.uses_shared_slot(6, x.device) and not layer.uses_shared_slot(6, x.device, num_token_non_padded=4)
    with torch.no_grad():
        slot = layer(x)
        padded = layer(x, num_token_non_padded=6)  # nothing padded, but the other path
        partly = layer(x, num_token_non_padded=4)
    assert_rel_close(padded.float(), slot.float(), FP8_MAX, "one-expert GEMM vs slot")
    want = moe_layer_torch(layer, x, num_token_non_padded=4, route_dtype=torch.float32)
    assert_rel_close(partly.float(), want, FP8_MAX, "padded")


def test_shared_slot_plan_takes_the_routed_shapes_height(gen, device, monkeypatch):
    """The slot's plan has the routed shape's tile height (its table's where one is tuned), not the heuristic's for
    the shape with the slot counted, which has no table entry: at 48 tokens the routed shape has 16 rows an expert
    (16-row tiles), the slot's shape 21 (64-row tiles). On the slot shape's heights Kimi-K2's fp8 layer ran 16-row
    tiles at 544-672 tokens where its table runs the persistent kernels: 249-352 us over its gate and routed experts
    alone, against 105-125 from 704 tokens (H100)."""
    layer = _layer("triton", int(torch.randint(1 << 30, (), generator=gen)), device)
    layer.shared_slot_max_tokens = 48  # by default 16-row tiles leave the shared expert's 48 rows to the side stream
    x = torch.randn(48, CONFIG.hidden_size, generator=gen).to(device, torch.bfloat16)
    heights = []

    def spy(*args, block_m=None, **kwargs):
        heights.append(block_m)
        return routed_experts(*args, block_m=block_m, **kwargs)

    monkeypatch.setattr(moefuse.layer, "routed_experts", spy)
    with torch.no_grad():
        got = layer(x)
    assert layer.uses_shared_slot(48, x.device)
    routed = plan_block_m(48, layer.experts.weights()[0], CONFIG.top_k, torch.bfloat16)
    assert heights == [routed] == [16], heights
    slot_shape = pick_block_m(48, CONFIG.num_experts + 1, CONFIG.hidden_size, CONFIG.intermediate_size,
                              CONFIG.top_k + 1, torch.float8_e4m3fn, None)
    assert slot_shape == 64  # what the slot's shape alone would take
    assert_rel_close(got.float(), moe_layer_torch(layer, x, route_dtype=torch.float32), FP8_MAX)


def test_short_tiles_leave_a_many_row_shared_expert_to_the_side_stream(device):
    """By default the fp8 slot runs where the plan's tiles take the shared expert's rows in at most two tiles, or
    are 64 rows or more: up to 32 tokens on 16-row plans, then the side stream until the plan is 64 rows tall (a
    slot on 16-row tiles cost fp8 DeepSeek-V4-Flash 0.9-4% at 64-608 tokens, and was 3.4% faster at 16; H100).
    An explicit ``shared_slot_max_tokens`` is kept as given."""
    layer = _layer("triton", 0, device)
    w = layer.experts.weights()[0]
    slot = {M: layer.uses_shared_slot(M, torch.device(device)) for M in (1, 32, 33, 48, 200)}
    heights = {M: plan_block_m(M, w, CONFIG.top_k, torch.bfloat16) for M in slot}
    assert heights == {1: 16, 32: 16, 33: 16, 48: 16, 200: 64}, heights
    assert slot == {1: True, 32: True, 33: False, 48: False, 200: True}, slot
    layer.shared_slot_max_tokens = 48
    assert layer.uses_shared_slot(48, torch.device(device)) and not layer.uses_shared_slot(49, torch.device(device))


def test_checkpoint_names_load(gen):
    """transformers' FP8Experts / FP8Linear names: gate_up_proj(_scale_inv), shared_experts.*.weight_scale_inv."""
    src = _layer("reference", 5, "cpu")
    names = set(src.state_dict())
    assert {"experts.gate_up_proj", "experts.gate_up_proj_scale_inv", "experts.down_proj_scale_inv",
            "shared_experts.gate_proj.weight_scale_inv", "shared_experts.down_proj.weight"} <= names
    dst = MoELayer(CONFIG, dtype=torch.bfloat16, backend="reference", quant="fp8")
    dst.load_state_dict(src.state_dict())
    x = torch.randn(3, CONFIG.hidden_size, generator=gen).bfloat16()
    with torch.no_grad():
        assert torch.equal(dst(x), src(x))
    assert isinstance(dst.shared_slot_weights()[0], BlockFP8)


def test_refused_formats():
    with pytest.raises(ValueError, match="quant"):
        MoELayer(CONFIG, quant="int4")
    with pytest.raises(TypeError, match="fp8"):
        MoELayer(CONFIG, dtype=torch.float32, quant="fp8")
    odd = MoEConfig(hidden_size=64, intermediate_size=96, num_experts=4, top_k=2, num_shared_experts=1)
    with pytest.raises(ValueError, match="128"):
        MoELayer(odd, quant="fp8")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_shared_expert_module_runs_itself(backend, gen, device):
    """The fp8 shared expert called on its own: a one-expert fp8 grouped GEMM, as inside the layer."""
    layer = _layer(backend, 0, device)
    x = torch.randn(5, CONFIG.hidden_size, generator=gen).bfloat16().to(device)
    gate_up, down = layer.shared_weights()
    with torch.no_grad():
        got = layer.shared_experts(x)
        want = expert_mlp_torch(x, gate_up[0], down[0], CONFIG.swiglu_limit, torch.bfloat16, torch.float64)
    assert_rel_close(got.double(), want, FP8_MAX, f"fp8 shared expert ({backend})")


@pytest.mark.parametrize("split", [2, 3])
def test_split_gemm1_counts_in_the_layers_workspaces(split, gen, device, monkeypatch):
    """With GEMM1 split (a GPU's choice at decode, forced here so that the interpreter runs it too), the routed
    experts (with the shared expert as their slot, or without it) and the shared expert on its own count their
    arrivals in workspaces of their own modules, made at the first call on the device and left zeroed: repeated
    calls give the same bits, within the float64 reference's tolerance."""
    monkeypatch.setattr(fp8_kernels, "default_split_k", lambda *args: split)
    given = []  # the workspace of each launch

    def launch(*args, workspace=None, **kwargs):
        given.append(workspace)
        fp8_kernels.experts_fp8(*args, workspace=workspace, **kwargs)

    monkeypatch.setattr(experts_op, "experts_fp8", launch)
    layer = _layer("triton", int(torch.randint(1 << 30, (), generator=gen)), device)
    x = torch.randn(3, CONFIG.hidden_size, generator=gen).to(device, torch.bfloat16)
    with torch.no_grad():
        for padded in (None, 3):  # the shared expert as a slot, then on its own
            outs = [layer(x, num_token_non_padded=padded) for _ in range(2)]
            assert torch.equal(outs[0], outs[1])
            want = moe_layer_torch(layer, x, num_token_non_padded=padded, route_dtype=torch.float32)
            assert_rel_close(outs[0].float(), want, FP8_MAX, f"split {split}, padded {padded}")
    routed, shared = (module.workspace.on(x.device) for module in (layer.experts, layer.shared_experts))
    for workspace in (routed, shared):
        assert workspace.device == x.device and workspace.dtype == torch.int32 and not workspace.any()
    # slot calls: the routed experts'; then per call the routed experts' and the shared expert's, in either order
    assert [id(w) for w in given[:2]] == [id(routed)] * 2 and routed is not shared
    assert sorted(map(id, given[2:])) == sorted(map(id, [routed, shared] * 2))


@pytest.mark.parametrize("dtype, match", [(torch.float8_e4m3fn, "fp8 experts .* block size None"),
                                          (torch.int8, "FP4 experts .* no scale per 32")],
                         ids=["fp8-without-block-scales", "fp4-without-scales"])
def test_from_hf_refuses_unsupported_quantized_experts(dtype, match, gen):
    """Refused when the layer is built, naming the format (not a dtype error at forward)."""
    hf = block("deepseek-v3", gen)
    hf.experts.gate_up_proj = torch.nn.Parameter(hf.experts.gate_up_proj.detach().to(dtype), requires_grad=False)
    with pytest.raises(ValueError, match=match):
        moefuse.from_hf(hf)


# H and I multiples of 512: the widths cuBLAS's block-scaled GEMMs take (``fp8_mlp.takes``)
WIDE = MoEConfig(hidden_size=512, intermediate_size=512, num_experts=4, top_k=2, num_shared_experts=1,
                 swiglu_limit=0.5)


def test_cublas_shared_expert_rule():
    """cuBLAS runs the fp8 shared expert only on an sm_90 GPU, from MIN_TOKENS tokens, at widths it takes: never on
    a CPU, so the layer there keeps the slot at every size."""
    from moefuse.experts.fp8 import mlp as fp8_mlp

    cpu = torch.device("cpu")
    assert not fp8_mlp.takes(fp8_mlp.MIN_TOKENS, 512, 512, torch.bfloat16, cpu)
    layer = MoELayer(WIDE, quant="fp8")
    assert layer.uses_shared_slot(fp8_mlp.MIN_TOKENS * 4, cpu)
    if torch.cuda.is_available() and fp8_mlp.takes(fp8_mlp.MIN_TOKENS, 512, 512, torch.bfloat16,
                                                   torch.device("cuda")):
        cuda = torch.device("cuda")
        assert not fp8_mlp.takes(fp8_mlp.MIN_TOKENS - 1, 512, 512, torch.bfloat16, cuda)
        assert not fp8_mlp.takes(fp8_mlp.MIN_TOKENS, 512, 384, torch.bfloat16, cuda)  # I / 128 = 3
        assert not fp8_mlp.takes(fp8_mlp.MIN_TOKENS, 640, 512, torch.bfloat16, cuda)
        assert not fp8_mlp.takes(fp8_mlp.MIN_TOKENS, 512, 512, torch.float32, cuda)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's block-scaled GEMMs need a GPU")
@pytest.mark.parametrize("extra", [0, 3], ids=["rows-multiple-of-4", "padded-rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_shared_expert_on_cublas_matches_float64(extra, dtype, gen):
    """At prefill on Hopper the fp8 shared expert runs on cuBLAS (the layer then leaves the slot): against float64
    on the dequantized operands (SPEC §5), with the clamp reached, a NaN row (NaN out) and a zero row (zeros out);
    and the whole layer against its float64 reference."""
    from moefuse.experts.fp8 import mlp as fp8_mlp

    tokens = fp8_mlp.MIN_TOKENS + extra
    cuda = torch.device("cuda")
    if not fp8_mlp.takes(tokens, WIDE.hidden_size, WIDE.intermediate_size, dtype, cuda):
        pytest.skip("needs an sm_90 GPU and a torch with cuBLAS's block scaling (2.9, CUDA 12.9)")
    layer = MoELayer(WIDE, dtype=dtype, quant="fp8", device=cuda).init_random_(
        int(torch.randint(1 << 30, (), generator=gen)), 0.1)
    assert not layer.uses_shared_slot(tokens, cuda) and layer.uses_shared_slot(tokens - 4, cuda)
    x = torch.randn(tokens, WIDE.hidden_size, generator=gen).to(cuda, dtype)
    x[5] = float("nan")
    x[7] = 0.0
    gate_up, down = layer.shared_weights()
    with torch.no_grad():
        got = layer.shared_experts(x)
        want = expert_mlp_torch(x, gate_up[0], down[0], WIDE.swiglu_limit, dtype, torch.float64)
    assert got.shape == x.shape and got.dtype == dtype
    assert got[5].isnan().all() and torch.equal(got[7], torch.zeros_like(got[7]))
    finite = torch.ones(tokens, dtype=torch.bool, device=cuda)
    finite[5] = False
    assert_rel_close(got[finite].double(), want[finite], 5e-2, "fp8 shared expert on cuBLAS")
    assert rms_rel_error(got[finite].double(), want[finite]) <= 1e-2
    x[5] = 1.0
    with torch.no_grad():
        out = layer(x)
    assert_rel_close(out.double(), moe_layer_torch(layer, x, route_dtype=torch.float32), 5e-2, "layer")
