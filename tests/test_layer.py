"""The MoE layer end to end: against transformers' own blocks and against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from hf_blocks import BLOCKS, block, randomize_

import moefuse
from moefuse import MoEConfig, MoELayer, _runtime, moe_layer_torch
from moefuse.finalize import deferred_finalize_context
from moefuse.testing import assert_rel_close

BACKENDS = ["reference", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", sorted(BLOCKS))
def test_matches_transformers_block(model, backend, gen, device):
    hf = block(model, gen).to(device)
    layer = moefuse.from_hf(hf, backend=backend)
    x = torch.randn(1, 7, hf.experts.gate_up_proj.shape[2], generator=gen).to(device)
    with torch.no_grad():
        want = hf(x)
        got = layer(x)
    assert got.shape == want.shape
    assert_rel_close(got, want, 1e-5, f"{model} ({backend})")


def test_from_hf_shares_tensors(gen):
    hf = block("deepseek-v3", gen)
    layer = moefuse.from_hf(hf)
    assert layer.experts.gate_up_proj.data_ptr() == hf.experts.gate_up_proj.data_ptr()
    assert layer.gate.weight.data_ptr() == hf.gate.weight.data_ptr()
    assert layer.shared_experts.down_proj.weight.data_ptr() == hf.shared_experts.down_proj.weight.data_ptr()
    # the same parameter names as the block: a checkpoint's state dict loads as it is
    assert set(layer.state_dict()) == set(hf.state_dict())


SMALL = MoEConfig(hidden_size=40, intermediate_size=24, num_experts=12, top_k=3, num_shared_experts=1,
                  num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)


def _layer(config: MoEConfig, backend: str, seed: int, device: torch.device | str = "cpu") -> MoELayer:
    return MoELayer(config, dtype=torch.float32, device=device, backend=backend).init_random_(seed, std=0.1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens", [0, 1, 9], ids=["empty-batch", "one-token", "nine-tokens"])
def test_matches_float64_reference(backend, tokens, gen, device):
    layer = _layer(SMALL, backend, seed=int(torch.randint(1 << 30, (), generator=gen)), device=device)
    x = torch.randn(tokens, SMALL.hidden_size, generator=gen).to(device)
    with torch.no_grad():
        got = layer(x)
    assert got.shape == x.shape
    assert_rel_close(got, moe_layer_torch(layer, x), 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_tokens_get_only_the_shared_expert(backend, gen, device):
    # Rows at or past num_token_non_padded are routed to no expert (ids -1): only the shared expert remains.
    layer = _layer(SMALL, backend, seed=3, device=device)
    x = torch.randn(6, SMALL.hidden_size, generator=gen).to(device)
    with torch.no_grad():
        got = layer(x, num_token_non_padded=4)
        want = moe_layer_torch(layer, x, num_token_non_padded=4)
        shared_only = layer.shared_experts(x[4:])
    assert_rel_close(got, want, 1e-5)
    assert_rel_close(got[4:], shared_only, 1e-6, "padded rows")


@pytest.mark.parametrize("backend", BACKENDS)
def test_deferred_equals_eager(backend, gen, monkeypatch, device):
    layer = _layer(SMALL, backend, seed=5, device=device)
    x = torch.randn(8, SMALL.hidden_size, generator=gen).to(device)
    with torch.no_grad():
        deferred = layer(x)
        monkeypatch.setattr(_runtime.DEFAULTS, "deferred_finalize", False)
        assert not layer.supports_deferred_finalize
        eager = layer(x)
    # the same up to the one extra rounding of the separate add
    assert_rel_close(deferred, eager, 1e-6, "deferred vs eager")


def test_experts_runner_defers_inside_context(gen):
    layer = _layer(SMALL, "reference", seed=7)
    x = torch.randn(4, SMALL.hidden_size, generator=gen)
    weights, ids = layer.gate(x)
    with deferred_finalize_context():
        deferred = layer.experts(x, weights, ids)
    combined = layer.experts(x, weights, ids)
    assert deferred.top_k == SMALL.top_k and deferred.gemm2_out.shape[1] == SMALL.hidden_size
    assert isinstance(combined, torch.Tensor) and combined.shape == x.shape


def test_bias_cast_to_bf16_still_routes(gen):
    # model.to(torch.bfloat16) casts buffers too; the router takes its bias in fp32, so the layer upcasts it.
    layer = _layer(SMALL, "reference", seed=11)
    x = torch.randn(5, SMALL.hidden_size, generator=gen)
    with torch.no_grad():
        layer.gate.e_score_correction_bias = layer.gate.e_score_correction_bias.bfloat16()
        got = layer(x)
        layer.gate.e_score_correction_bias = layer.gate.e_score_correction_bias.float()
        want = layer(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad, exc", [
    (lambda: [[0.0] * SMALL.hidden_size], TypeError),  # not a tensor
    (lambda: torch.zeros(3, SMALL.hidden_size + 1), ValueError),  # wrong width
    (lambda: torch.zeros(3, SMALL.hidden_size, dtype=torch.float64), TypeError),  # not the layer's dtype
], ids=["not-a-tensor", "wrong-width", "wrong-dtype"])
def test_bad_input_names_hidden_states(bad, exc):
    layer = _layer(SMALL, "reference", seed=13)
    with pytest.raises(exc, match="hidden_states"):
        layer(bad())


def _no_side_stream_shared(layer: MoELayer) -> None:
    """Make the shared expert's own MLP fail if called: the shared-slot path must not use it."""
    def fail(*args, **kwargs):
        raise AssertionError("the shared expert ran as an MLP, not as a slot of the grouped GEMMs")
    layer.shared_experts.forward = fail


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens", [1, 9])
def test_shared_slot_matches_float64_reference(backend, tokens, gen, device):
    """The shared expert as slot top_k (id E, weight 1) of the grouped GEMMs: the same block function."""
    layer = _layer(SMALL, backend, seed=int(torch.randint(1 << 30, (), generator=gen)), device=device)
    x = torch.randn(tokens, SMALL.hidden_size, generator=gen).to(device)
    with torch.no_grad():
        layer.shared_slot_max_tokens = 0
        side = layer(x)
        layer.shared_slot_max_tokens = tokens
        assert layer.shared_slot_weights() is not None
        _no_side_stream_shared(layer)
        slot = layer(x)
    assert_rel_close(slot, moe_layer_torch(layer, x), 1e-5)
    assert_rel_close(slot, side, 1e-6, "shared slot vs side stream")


def test_shared_weights_are_views_behind_the_routed_ones(gen):
    """Stacked storage: a state dict loads into the views, and the slot view reads the loaded values."""
    src = _layer(SMALL, "reference", seed=17)
    dst = MoELayer(SMALL, dtype=torch.float32, backend="reference")
    dst.load_state_dict(src.state_dict())
    gate_up, down = dst.shared_slot_weights()
    E, I = SMALL.num_experts, SMALL.intermediate_size
    assert torch.equal(gate_up[E, :I], src.shared_experts.gate_proj.weight)
    assert torch.equal(gate_up[E, I:], src.shared_experts.up_proj.weight)
    assert torch.equal(down[E], src.shared_experts.down_proj.weight)
    assert torch.equal(gate_up[:E], src.experts.gate_up_proj)


def test_shared_slot_falls_back_when_weights_move(gen):
    """A replaced shared weight, a layer from transformers or a model without a shared expert: no slot view,
    and the layer still computes the block (through the side-stream path) with the weights it now has."""
    layer = _layer(SMALL, "reference", seed=19)
    layer.shared_slot_max_tokens = 64
    with torch.no_grad():
        layer.shared_experts.down_proj.weight = torch.nn.Parameter(layer.shared_experts.down_proj.weight * 3)
    assert layer.shared_slot_weights() is None
    x = torch.randn(4, SMALL.hidden_size, generator=gen)
    with torch.no_grad():
        assert_rel_close(layer(x), moe_layer_torch(layer, x), 1e-5)
    assert moefuse.from_hf(block("deepseek-v3", gen)).shared_slot_weights() is None
    no_shared = MoEConfig(hidden_size=40, intermediate_size=24, num_experts=12, top_k=3)
    assert MoELayer(no_shared, dtype=torch.float32).shared_slot_weights() is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_slot_not_used_for_padded_tokens(backend, gen, device):
    """With num_token_non_padded the side-stream path runs, so padded tokens keep their shared expert."""
    layer = _layer(SMALL, backend, seed=23, device=device)
    layer.shared_slot_max_tokens = 64
    x = torch.randn(6, SMALL.hidden_size, generator=gen).to(device)
    with torch.no_grad():
        got = layer(x, num_token_non_padded=4)
        assert_rel_close(got[4:], layer.shared_experts(x[4:]), 1e-6, "padded rows")


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_shared_slot_max_tokens(bad, exc):
    with pytest.raises(exc, match="shared_slot_max_tokens"):
        MoELayer(SMALL, dtype=torch.float32, shared_slot_max_tokens=bad)


def _deepseek_v4_hash_block(gen, vocab: int = 50):
    """transformers' hash-routed DeepSeek-V4 block (experts from tid2eid[input_ids]), random weights and table."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    config = DeepseekV4Config(hidden_size=48, moe_intermediate_size=24, n_routed_experts=16, num_experts_per_tok=3,
                              num_hidden_layers=1, mlp_layer_types=["hash_moe"], swiglu_limit=0.02,
                              vocab_size=vocab)
    hf = randomize_(DeepseekV4SparseMoeBlock(config, 0), gen).eval()
    with torch.no_grad():  # distinct experts per token id, as the checkpoints' tables have
        hf.gate.tid2eid.copy_(torch.stack([torch.randperm(16, generator=gen)[:3] for _ in range(vocab)]))
    return hf


@pytest.mark.parametrize("backend", BACKENDS)
def test_hash_routed_layer_matches_transformers(backend, gen, device):
    """DeepSeek-V4's first MoE layers: experts fixed by the token id, weights from the sqrt-softplus scores."""
    hf = _deepseek_v4_hash_block(gen).to(device)
    layer = moefuse.from_hf(hf, backend=backend)
    assert layer.gate.tid2eid is hf.gate.tid2eid
    x = torch.randn(2, 5, 48, generator=gen).to(device)
    input_ids = torch.randint(0, 50, (2, 5), generator=gen).to(device)
    with torch.no_grad():
        want = hf(x, input_ids=input_ids)
        got = layer(x, input_ids=input_ids)
        ref = moe_layer_torch(layer, x, input_ids=input_ids)
        padded = layer(x, num_token_non_padded=7, input_ids=input_ids)
        ref_padded = moe_layer_torch(layer, x, num_token_non_padded=7, input_ids=input_ids)
    assert_rel_close(got, want, 1e-5, f"hash-routed ({backend}) vs transformers")
    assert_rel_close(got, ref, 1e-5, "vs float64 reference")
    assert_rel_close(padded, ref_padded, 1e-5, "padded tokens")


def test_hash_routed_layer_needs_input_ids(gen):
    layer = moefuse.from_hf(_deepseek_v4_hash_block(gen), backend="reference")
    with pytest.raises(ValueError, match="input_ids"):
        layer(torch.randn(4, 48))
    with pytest.raises(ValueError, match="input_ids"):
        layer(torch.randn(4, 48), input_ids=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="input_ids"):
        layer(torch.randn(4, 48), input_ids=torch.zeros(4))
    # The router and the float64 reference, called directly, name it too.
    with pytest.raises(ValueError, match="input_ids"):
        layer.gate(torch.randn(4, 48))
    with pytest.raises(ValueError, match="input_ids"):
        moe_layer_torch(layer, torch.randn(4, 48))


def test_slot_plan_launch_keeps_gemm1_in_one_wave(monkeypatch):
    """``MoELayer.expert_tiles`` on a GPU with a tile table: the slot plan takes the routed shape's tuned launch with
    GEMM1 kept to one wave (``configs.slot_tiles``): DeepSeek-V3's token on an H100 is 144 programs of the table's
    128 columns with the slot, so 64 columns on 2 stages; without the slot the table's own launch. A full-size layer
    on the meta device (no memory), the GPU faked."""
    from dataclasses import replace

    from moefuse.experts import configs

    h100 = replace(_runtime.HOPPER, name="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(configs, "arch_of", lambda device: h100)
    layer = MoELayer(moefuse.preset("deepseek-v3"), device="meta")
    meta = torch.device("meta")
    _, routed = layer.expert_tiles(1, meta, slot=False)
    _, slot = layer.expert_tiles(1, meta, slot=True)
    assert (routed.gemm1.block_n, routed.gemm1.num_stages) == (128, 3)
    assert (slot.gemm1.block_n, slot.gemm1.num_stages) == (64, 2) and slot.gemm2 == routed.gemm2
    assert layer.expert_tiles(2, meta, slot=True) == layer.expert_tiles(2, meta, slot=False)
