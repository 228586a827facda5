"""transformers integration: tiny causal LMs of DeepSeek-V3, Qwen3-MoE and GLM-4-MoE, patched and unpatched."""

from __future__ import annotations

import pytest
import torch

import moefuse
from moefuse import MoELayer
from moefuse.route.reference import near_tie_rows
from moefuse.testing import TINY_CAUSAL_LMS, TINY_CONFIG, assert_rel_close, tiny_causal_lm

MODELS = TINY_CAUSAL_LMS


def _model(name: str, seed: int) -> torch.nn.Module:
    return tiny_causal_lm(name, seed)


@torch.no_grad()
def _routing_tie(model: torch.nn.Module, ids: torch.Tensor) -> bool:
    """Whether a token of ``model(ids)`` has, in some MoE layer, a routing choice within 1e-5 of a tie in float64
    (``near_tie_rows``: the experts' keys and, where the router picks groups first, the groups' scores).
    transformers' ``torch.topk`` may break such a tie either way where moefuse takes the lower id (SPEC §2), so
    the patched model may route that token elsewhere (seen once in CI: two group sums equal in fp32)."""
    inputs: list[torch.Tensor] = []
    hooks = [layer.mlp.register_forward_hook(lambda module, args, out: inputs.append(args[0]))
             for layer in model.model.layers]
    model(ids)
    for hook in hooks:
        hook.remove()
    c = model.config
    for layer, x in zip(model.model.layers, inputs):
        gate = layer.mlp.gate
        bias = getattr(gate, "e_score_correction_bias", None)
        logits = x.reshape(-1, x.shape[-1]).double() @ gate.weight.double().T
        tied = near_tie_rows(logits, bias, c.num_experts_per_tok, "softmax" if bias is None else "sigmoid",
                             num_expert_group=getattr(c, "n_group", None) or 1,
                             topk_group=getattr(c, "topk_group", None) or 1, rel=1e-5)
        if bool(tied.any()):
            return True
    return False


def _draw(name: str, gen: torch.Generator) -> tuple[torch.nn.Module, torch.Tensor]:
    """A random model and prompt whose routing has no choice within 1e-5 of a tie (see ``_routing_tie``)."""
    for _ in range(20):
        model = _model(name, seed=int(torch.randint(1 << 30, (), generator=gen)))
        ids = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 6), generator=gen)
        if not _routing_tie(model, ids):
            return model, ids
    raise AssertionError("20 draws in a row had a routing tie")


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_patched_logits_match(name, backend, gen, device):
    model, ids = _draw(name, gen)
    model, ids = model.to(device), ids.to(device)
    with torch.no_grad():
        want = model(ids).logits
        report = moefuse.patch(model, backend=backend)
        assert report.patched == [f"model.layers.{i}.mlp" for i in range(TINY_CONFIG["num_hidden_layers"])]
        assert all(isinstance(layer.mlp, MoELayer) for layer in model.model.layers)
        got = model(ids).logits
        assert moefuse.unpatch(model) == report.patched
        again = model(ids).logits
    assert_rel_close(got, want, 1e-5, f"{name} patched logits")
    assert torch.equal(again, want), "unpatch must restore the original blocks exactly"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_patched_greedy_generation_identical(name):
    # A fixed seed: equality of 16 greedy tokens is a property of one model, and a fresh random model may have
    # two next-token logits within fp32 rounding of each other.
    model = _model(name, seed=1234)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=16, do_sample=False)
        moefuse.patch(model, backend="reference")
        got = model.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(got, want)


def test_patch_shares_tensors_and_lists_unsupported():
    model = _model("deepseek-v3", seed=0)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    params_before = sum(p.numel() for p in model.parameters())
    moefuse.patch(model)
    assert model.model.layers[0].mlp.experts.gate_up_proj is experts
    assert sum(p.numel() for p in model.parameters()) == params_before  # no copies, no duplicates

    class OtherMoE(torch.nn.Module):  # looks like a MoE block, but no adapter knows it
        def __init__(self):
            super().__init__()
            self.gate, self.experts = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    holder = torch.nn.Sequential(OtherMoE())
    assert moefuse.patch(holder).skipped == {"0": "OtherMoE is not a supported MoE block"}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_experts_implementation(name, gen, device):
    moefuse.register_experts_implementation()
    model = _model(name, seed=int(torch.randint(1 << 30, (), generator=gen))).to(device)
    ids = torch.randint(0, TINY_CONFIG["vocab_size"], (2, 6), generator=gen).to(device)
    with torch.no_grad():
        want = model(ids).logits
        model.set_experts_implementation("moefuse")
        got = model(ids).logits
    assert model.config._experts_implementation == "moefuse"
    assert_rel_close(got, want, 1e-5, f"{name} with experts_implementation='moefuse'")
