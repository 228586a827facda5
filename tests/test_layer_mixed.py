"""Mixed formats and activation precision in ``MoELayer``: every routed format {None, fp8, mxfp4} with every shared
expert format {None, fp8} (``shared_quant``), and ``activation_quant`` (MXFP4 W4A16 by default, W4A8 on request),
each against the float64 reference of the same numerics."""

from __future__ import annotations

import pytest
import torch

from moefuse import MoEConfig, MoELayer, moe_layer_torch
from moefuse._runtime import defaults
from moefuse.dispatch import moe_dispatch
from moefuse.experts.reference import expert_mlp_torch, moe_experts_w4a8_torch
from moefuse.formats import MXFP4, BlockFP8
from moefuse.layer import QUANTS
from moefuse.testing import assert_rel_close, rms_rel_error

MIXES = [(routed, shared) for routed in QUANTS for shared in (None, "fp8")]
MIX_IDS = [f"{routed}-{shared}" for routed, shared in MIXES]


def _config(shared: str | None) -> MoEConfig:
    """Small DeepSeek-V4-like widths: I a multiple of 128 where the shared expert is fp8 (its gate and up blocks are
    separate), else 96, a multiple of 32 (MXFP4) and not of 128; H a multiple of 32 and not of 128 (fp8's partial
    blocks and groups)."""
    return MoEConfig(hidden_size=64, intermediate_size=128 if shared == "fp8" else 96, num_experts=6, top_k=2,
                     num_shared_experts=1, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=0.5)


def _layer(routed, shared, backend, seed=0, config=None, device="cpu", **kwargs) -> MoELayer:
    return MoELayer(config or _config(shared), quant=routed, shared_quant=shared, backend=backend, device=device,
                    **kwargs).init_random_(seed, std=0.1)


@pytest.mark.parametrize(("routed", "shared"), MIXES, ids=MIX_IDS)
def test_every_mix_matches_float64(routed, shared, gen, device):
    """The Triton kernels (interpreted on a CPU) on each mix, deferred finalize on and off, against the float64
    reference; on a GPU the first call replays a decode graph."""
    layer = _layer(routed, shared, "triton", seed=int(torch.randint(1 << 30, (), generator=gen)), device=device)
    routed_type = {None: torch.Tensor, "fp8": BlockFP8, "mxfp4": MXFP4}[routed]
    assert isinstance(layer.experts.weights()[0], routed_type)
    assert layer.quant == routed and layer.shared_quant == shared
    if shared == "fp8":
        assert isinstance(layer.shared_weights()[0], BlockFP8)
    else:
        assert layer.shared_experts.gate_proj.weight.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="not quantized"):
            layer.shared_weights()
    x = torch.randn(5, layer.config.hidden_size, generator=gen).bfloat16().to(device)
    with torch.no_grad():
        got = layer(x)
        with defaults(deferred_finalize=False):
            plain = layer(x)
        want = moe_layer_torch(layer, x, route_dtype=torch.float32)
    assert_rel_close(got.double(), want, 1e-2, f"routed {routed}, shared {shared}")
    assert_rel_close(plain.double(), want, 1e-2, f"routed {routed}, shared {shared}, not deferred")


@pytest.mark.parametrize(("routed", "shared"), MIXES, ids=MIX_IDS)
def test_shared_slot_only_where_the_formats_agree(routed, shared, gen):
    """The shared expert sits behind the routed weights (and may run as their slot) only in one format; a state
    dict of the mix loads into a fresh layer, and a copy of every tensor (``.to()``) keeps the layer running."""
    layer = _layer(routed, shared, "reference", shared_slot_max_tokens=16)
    same = routed == shared
    assert (layer.shared_slot_weights() is not None) == same
    assert layer.uses_shared_slot(4, torch.device("cpu")) == same
    names = set(layer.state_dict())
    assert ("shared_experts.gate_proj.weight_scale_inv" in names) == (shared == "fp8")
    assert ("experts.gate_up_proj_scale_inv" in names) == (routed is not None)
    x = torch.randn(4, layer.config.hidden_size, generator=gen).bfloat16()
    fresh = MoELayer(_config(shared), quant=routed, shared_quant=shared, backend="reference",
                     shared_slot_max_tokens=16)
    fresh.load_state_dict(layer.state_dict())
    with torch.no_grad():
        want = layer(x)
        assert torch.equal(fresh(x), want)
        layer._apply(torch.clone)  # what .to() does: new tensors one by one (an fp8 shared expert is re-stacked)
        after = layer(x)
    if same:  # the copies left the shared weights apart from the routed ones: no slot now, the same function
        assert layer.shared_slot_weights() is None
        assert_rel_close(after.double(), want.double(), 1e-2, "after a copy")
    else:
        assert torch.equal(after, want)


def test_default_shared_format_is_what_quant_implied():
    """Unchanged defaults: an fp8 shared expert beside fp8 and MXFP4 routed experts, an unquantized one beside
    unquantized experts; none without a shared expert."""
    implied = {None: None, "fp8": "fp8", "mxfp4": "fp8"}
    for quant, shared in implied.items():
        layer = MoELayer(_config("fp8"), quant=quant, device="meta")
        assert layer.shared_quant == shared
        assert isinstance(layer.shared_experts.gate_proj, torch.nn.Linear) == (shared is None)
    no_shared = MoEConfig(hidden_size=64, intermediate_size=96, num_experts=4, top_k=2)
    assert MoELayer(no_shared, quant="mxfp4", device="meta").shared_quant is None


def test_refused_mixes():
    # an fp8 shared expert needs I % 128 == 0; the error says why and what to pass instead
    with pytest.raises(ValueError, match=r"multiple of 128.*shared_quant=None"):
        MoELayer(_config(None), quant="mxfp4")
    with pytest.raises(ValueError, match=r"multiple of 128.*shared_quant=None"):
        MoELayer(_config(None), shared_quant="fp8")
    MoELayer(_config(None), quant="mxfp4", shared_quant=None, device="meta")  # I = 96: fine with a bf16 shared one
    with pytest.raises(ValueError, match="shared_quant"):
        MoELayer(_config("fp8"), quant="mxfp4", shared_quant="mxfp4")
    with pytest.raises(TypeError, match="shared_quant='fp8'"):
        MoELayer(_config("fp8"), dtype=torch.float32, shared_quant="fp8")
    MoELayer(_config("fp8"), dtype=torch.float32, device="meta")  # unquantized: any float dtype


def test_activation_quant_defaults_and_refusals():
    assert MoELayer(_config(None), device="meta").activation_quant is None
    assert MoELayer(_config("fp8"), quant="fp8", device="meta").activation_quant == "fp8"
    assert MoELayer(_config("fp8"), quant="mxfp4", device="meta").activation_quant is None  # W4A16 at every size
    assert MoELayer(WIDE, quant="mxfp4", activation_quant="fp8", device="meta").activation_quant == "fp8"
    for quant, bad in ((None, "fp8"), ("fp8", None), ("mxfp4", "int8")):
        with pytest.raises(ValueError, match="activation_quant"):
            MoELayer(_config("fp8"), quant=quant, activation_quant=bad, device="meta")


def test_w4a8_kernels_refuse_what_they_cannot_run(gen, device):
    """The W4A8 kernels need H and I multiples of 128 (H is 64 here): the layer refuses when it is built, naming the
    argument, instead of computing W4A16 behind the caller's back; the reference backend computes W4A8 anywhere.
    Off Hopper (and under the interpreter) the experts op refuses at the call, before any launch."""
    with pytest.raises(ValueError, match="activation_quant.*multiples of 128"):
        _layer("mxfp4", "fp8", "triton", activation_quant="fp8", device=device)
    _layer("mxfp4", "fp8", "reference", activation_quant="fp8", device=device)
    if device.type == "cpu":
        layer = _layer("mxfp4", "fp8", "triton", config=WIDE, activation_quant="fp8", device=device)
        with pytest.raises(ValueError, match="activation_quant.*Hopper"):
            layer(torch.randn(3, layer.config.hidden_size, generator=gen).bfloat16().to(device))


# H and I multiples of 128: the widths the W4A8 kernels take
WIDE = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2, num_shared_experts=1,
                 routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the W4A8 kernels need a Hopper GPU")
@pytest.mark.parametrize("shared", [None, "fp8"])
@pytest.mark.parametrize("tokens", [5, 40], ids=["graph-replay", "eager"])
def test_w4a8_layer_on_hopper(shared, tokens, gen):
    """MXFP4 with ``activation_quant="fp8"`` on the W4A8 kernels, beside either shared expert: against its float64
    reference (SPEC §6's W4A8 tolerances), a decode batch replayed from the layer's own CUDA graph."""
    from moefuse.experts.mxfp4 import ws as mxfp4_ws

    cuda = torch.device("cuda")
    if torch.cuda.get_device_capability(cuda) != (9, 0) or mxfp4_ws.gluon is None:
        pytest.skip("needs an sm_90 GPU and Gluon")
    layer = _layer("mxfp4", shared, "triton", int(torch.randint(1 << 30, (), generator=gen)), config=WIDE,
                   device=cuda, activation_quant="fp8")
    x = torch.randn(tokens, WIDE.hidden_size, generator=gen).bfloat16().to(cuda)
    with torch.no_grad():
        got = layer(x)
        again = layer(x)
        want = moe_layer_torch(layer, x, route_dtype=torch.float32)
    assert len(layer.graphs) == (tokens <= layer.graphs.max_tokens)
    assert torch.equal(got, again)
    assert_rel_close(got.double(), want, 5e-2, f"W4A8 layer, shared {shared}")
    assert rms_rel_error(got.double(), want) <= 1e-2


@pytest.mark.parametrize("shared", [None, "fp8"])
def test_w4a8_reference_numerics(shared, gen):
    """MXFP4 with ``activation_quant="fp8"``: the float64 reference of the layer computes W4A8 (SPEC §6) exactly as
    the experts' own W4A8 reference does (``moe_experts_w4a8_torch``: the same float64 operations, so 1e-6 sees one
    e4m3 rounding of the intermediate made differently), the layer on the reference backend agrees with it within
    its fp32 sums and bf16 roundings, and W4A16 lies apart from it by far more than that."""
    layer = _layer("mxfp4", shared, "reference", seed=int(torch.randint(1 << 30, (), generator=gen)),
                   activation_quant="fp8")
    c = layer.config
    x = torch.randn(6, c.hidden_size, generator=gen).bfloat16()
    with torch.no_grad():
        weights, ids = layer.gate(x)
        plan = moe_dispatch(ids, c.num_experts, 16, backend="reference")
        rows = moe_experts_w4a8_torch(x, *layer.experts.weights(), plan, swiglu_limit=c.swiglu_limit,
                                      out=torch.empty(plan.num_rows, c.hidden_size, dtype=torch.float64),
                                      dtype=torch.float64)
        slots = rows[plan.expanded_to_permuted.long()].view(6, c.top_k, c.hidden_size)
        want = (slots * weights.double()[..., None]).sum(1)
        s = layer.shared_experts
        gate_up, down = ((w[0] for w in layer.shared_weights()) if shared == "fp8" else
                         (torch.cat([s.gate_proj.weight, s.up_proj.weight]), s.down_proj.weight))
        want += expert_mlp_torch(x.double(), gate_up, down, c.swiglu_limit, torch.bfloat16, torch.float64)
        reference = moe_layer_torch(layer, x, route_dtype=torch.float32)
        got = layer(x)
        layer.experts.activation_quant = None  # the same weights as W4A16
        w4a16 = moe_layer_torch(layer, x, route_dtype=torch.float32)
    assert_rel_close(reference, want, 1e-6, "moe_layer_torch with activation_quant='fp8'")
    # SPEC §6's W4A8 tolerances: fp32 sums flip e4m3 roundings of the narrow intermediate (measured here: 5e-3 max,
    # 3e-3 RMS; W4A16 lies 3.1-4.4e-2 RMS away, over 80 draws)
    assert_rel_close(got.double(), want, 5e-2, "W4A8 layer (reference backend)")
    near = rms_rel_error(got.double(), want)
    assert near <= 1e-2, f"W4A8 layer (reference backend): RMS {near:.2e}"
    apart = rms_rel_error(w4a16, want)
    assert apart > max(1.5e-2, 3 * near), f"W4A16 and W4A8 differ by only {apart:.2e} RMS"


def test_sharded_layer_keeps_the_mix(gen):
    """``ShardedMoELayer.from_layer`` takes the layer's routed, shared and activation formats (one gloo rank)."""
    import torch.distributed as dist

    from moefuse.parallel import ShardedMoELayer

    layer = _layer("mxfp4", None, "reference", activation_quant="fp8")
    x = torch.randn(5, layer.config.hidden_size, generator=gen).bfloat16()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for mode in ("ep", "tp"):
            sharded = ShardedMoELayer.from_layer(layer, mode)
            assert (sharded.quant, sharded.shared_quant, sharded.activation_quant) == ("mxfp4", None, "fp8")
            assert isinstance(sharded.shared_experts.gate_proj, torch.nn.Linear)
            with torch.no_grad():
                assert_rel_close(sharded(x).double(), layer(x).double(), 1e-2, f"sharded ({mode})")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("routed", "shared", "activation_quant"),
                         [("mxfp4", None, "fp8"), ("fp8", None, "default"), (None, "fp8", "default")],
                         ids=["mxfp4-None-w4a8", "fp8-None", "None-fp8"])
def test_mixed_layer_compiles_without_graph_breaks(routed, shared, activation_quant, gen):
    """The mixes trace as the one-format layers do (tests/test_compile.py): one graph, the same output."""
    torch._dynamo.reset()
    layer = _layer(routed, shared, "reference", activation_quant=activation_quant)
    x = torch.randn(5, layer.config.hidden_size, generator=gen).bfloat16()
    with torch.no_grad():
        want = layer(x)
        got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, want)
