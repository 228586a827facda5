"""Router stage (SPEC §1): the reference against float64, the Triton kernel (interpreter on CPU) against
float64, adversarial ties and non-finite logits, property tests, and every error path."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from moefuse.route import kernel, moe_fused_gate, moe_fused_gate_torch
from moefuse.route.reference import activation, compare_to_reference, near_tie_rows, summed_runs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as tests/conftest.py picks it

# NaN/inf inputs make the interpreter's numpy arithmetic warn (the values are handled on purpose).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

WEIGHT_TOL = 1e-5  # per-row relative error of the weights against float64


def _inputs(gen, M, E, *, dtype=torch.float32, mean=0.0, std=2.0, bias=True, device="cpu"):
    """Logits N(mean, std) in ``dtype`` and a bias N(0, 0.5) (the anchor distributions)."""
    scores = (torch.randn(M, E, generator=gen, dtype=torch.float64) * std + mean).to(dtype).to(device)
    b = (torch.randn(E, generator=gen) * 0.5).to(device) if bias else None
    return scores, b


def _route_and_judge(scores, bias, topk, *, strict=False, backend="triton", **opts):
    """Run the op and judge it against float64; fails on invalid ids, unexcused id differences or weight error."""
    weights, ids = moe_fused_gate(scores, bias, topk, **opts, backend=backend)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (scores.shape[0], topk)
    verdict = compare_to_reference(weights, ids, scores, bias, topk, **opts, allow_near_ties=not strict)
    assert verdict["invalid_rows"] == 0, verdict
    assert verdict["bad_rows"] == 0, verdict
    assert verdict["weight_err"] <= WEIGHT_TOL, verdict
    return weights, ids, verdict


# ---- model configurations and options ---------------------------------------------------------------------

DSV3 = dict(topk=8, scoring_func="sigmoid", routed_scaling_factor=2.5, num_expert_group=8, topk_group=4)
CASES = {
    # SPEC §4 models, at small M
    "dsv3-256-g8k4-top8": (256, DSV3, {}),
    "dsv3-fused-shared": (256, {**DSV3, "topk": 9, "num_fused_shared_experts": 1}, {}),
    "dsv3-fused-shared-scale-on-output": (
        256, {**DSV3, "topk": 9, "num_fused_shared_experts": 1, "apply_routed_scaling_factor_on_output": True}, {}),
    "kimi-k2-384-top8": (384, dict(topk=8, routed_scaling_factor=2.827), {}),
    "dsv4-256-sqrtsoftplus-top6": (256, dict(topk=6, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5), {}),
    "dsv4-logits-N(-14,2)": (256, dict(topk=6, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5),
                             {"mean": -14.0}),
    "qwen3-128-softmax-top8": (128, dict(topk=8, scoring_func="softmax"), {"bias": False}),
    "glm-128-top8-shared": (128, dict(topk=9, num_fused_shared_experts=1), {}),
    # shapes
    "E160-not-pow2": (160, dict(topk=8), {}),
    "E1-topk1": (1, dict(topk=1), {}),
    "E1-with-2-shared": (1, dict(topk=3, num_fused_shared_experts=2), {}),
    "topk1": (64, dict(topk=1), {}),
    "topk-equals-E": (16, dict(topk=16), {}),
    "topk32-E512": (512, dict(topk=32), {}),
    "E1024-topk32-with-shared": (1024, dict(topk=32, num_fused_shared_experts=2, routed_scaling_factor=2.5), {}),
    # groups
    "groups-5-of-32-keep2": (160, dict(topk=6, num_expert_group=5, topk_group=2), {}),
    "groups-3-of-128-keep1": (384, dict(topk=8, num_expert_group=3, topk_group=1), {}),
    "groups-12-of-8-keep3": (96, dict(topk=7, num_expert_group=12, topk_group=3), {}),
    "groups-of-one-expert": (16, dict(topk=4, num_expert_group=16, topk_group=5), {}),
    "groups-keep-all": (64, dict(topk=8, num_expert_group=4, topk_group=4), {}),
    "grouped-softmax": (64, dict(topk=6, scoring_func="softmax", num_expert_group=8, topk_group=3), {}),
    "grouped-sqrtsoftplus": (256, dict(topk=8, scoring_func="sqrtsoftplus", num_expert_group=8, topk_group=4), {}),
    # options and dtypes
    "bf16-logits-dsv3": (256, DSV3, {"dtype": torch.bfloat16}),
    "fp16-logits-softmax": (128, dict(topk=8, scoring_func="softmax"), {"dtype": torch.float16}),
    "bf16-logits-sqrtsoftplus": (256, dict(topk=6, scoring_func="sqrtsoftplus"), {"dtype": torch.bfloat16}),
    "softmax-softcap-30": (128, dict(topk=8, scoring_func="softmax", moe_softcapping=30.0), {"std": 20.0}),
    "softmax-softcap-0.5": (64, dict(topk=4, scoring_func="softmax", moe_softcapping=0.5), {}),
    "renormalize-off": (256, dict(topk=8, renormalize=False, routed_scaling_factor=2.5), {}),
    "renormalize-off-shared": (128, dict(topk=10, num_fused_shared_experts=2, renormalize=False,
                                         routed_scaling_factor=2.0), {}),
    "scale-on-output-no-renorm": (128, dict(topk=8, renormalize=False, routed_scaling_factor=2.5,
                                            apply_routed_scaling_factor_on_output=True), {}),
    "no-bias-dsv3": (256, DSV3, {"bias": False}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_float64(case, gen, device):
    """The kernel picks the float64 reference's experts (up to near ties) and its weights within 1e-5."""
    E, opts, dist = CASES[case]
    # Fewer rows for the widest case: under the interpreter its 1,024 experts cost as much as the others together.
    M = int(torch.randint(3, 38 if E <= 512 else 10, (), generator=gen))
    scores, bias = _inputs(gen, M, E, device=device, **dist)
    _route_and_judge(scores, bias, **opts)


@pytest.mark.parametrize("case", ["dsv3-256-g8k4-top8", "dsv3-fused-shared", "kimi-k2-384-top8",
                                  "dsv4-logits-N(-14,2)", "qwen3-128-softmax-top8", "softmax-softcap-30",
                                  "renormalize-off-shared", "bf16-logits-dsv3"])
def test_reference_fp32_matches_float64(case, gen, device):
    """The float32 reference (the CPU path) agrees with itself in float64."""
    E, opts, dist = CASES[case]
    scores, bias = _inputs(gen, 64, E, device=device, **dist)
    _route_and_judge(scores, bias, backend="reference", **opts)


def test_auto_backend_on_cpu_is_the_reference(gen):
    """backend="auto" on CPU tensors runs the reference."""
    scores, bias = _inputs(gen, 9, 64)
    got = moe_fused_gate(scores, bias, 6, backend="auto")
    want = moe_fused_gate_torch(scores, bias, 6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("block_m", [8, 16])
@pytest.mark.parametrize("case", ["dsv3-fused-shared", "qwen3-128-softmax-top8", "E160-not-pow2"])
def test_multi_row_programs(case, block_m, gen, device, monkeypatch):
    """Large-M launches pack several rows per program; M is not a multiple of BLOCK_M so the tail is masked."""
    monkeypatch.setattr(kernel, "launch_config", lambda M, E, G=1: (block_m, 4))
    E, opts, dist = CASES[case]
    scores, bias = _inputs(gen, 3 * block_m + 5, E, device=device, **dist)
    _route_and_judge(scores, bias, num_token_non_padded=2 * block_m + 1, **opts)


def test_launch_config():
    """Decode gets one row per program; big M packs rows, up to 1024 keys per program; all powers of two."""
    assert kernel.launch_config(1, 256, 8)[0] == 1
    for M in (1, 16, 64, 512, 4096, 8192, 100_000):
        for E, G in ((1, 1), (128, 1), (160, 5), (256, 8), (384, 1), (1024, 1)):
            block_m, warps = kernel.launch_config(M, E, G)
            assert block_m & (block_m - 1) == 0 and warps in (1, 2, 4)
            assert block_m == 1 or block_m * triton.next_power_of_2(E) <= 1024
    assert kernel.launch_config(8192, 256, 8)[0] > 1


# ---- activations over a dense grid ----------------------------------------------------------------------------


@triton.jit
def _activation_kernel(x_ptr, y_ptr, n, FN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if FN == 0:
        y = kernel._sqrtsoftplus(x)
    elif FN == 1:
        y = kernel._sigmoid(x)
    elif FN == 2:
        y = kernel._tanh(x)
    else:
        y = kernel._exp(x)
    tl.store(y_ptr + offs, y, mask=offs < n)


SPECIALS = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-30, -1e-30]
ACTIVATIONS = {  # name: (FN code, float64 truth, grid)
    "sqrtsoftplus": (0, lambda x: torch.sqrt(x.clamp_min(0) + torch.log1p(torch.exp(-x.abs()))), (-100, 100)),
    "sigmoid": (1, torch.sigmoid, (-80, 80)),
    "tanh": (2, torch.tanh, (-40, 40)),
    "exp": (3, torch.exp, (-87, 88.5)),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_relative_error_dense_grid(name, device):
    """Every x of a 400k-point grid (and ±inf, NaN, ±0): within 1e-6 relative of float64 (SPEC: sqrtsoftplus on
    [-100, 100]); the grids stop where the true value leaves fp32's normal range."""
    code, truth, (lo, hi) = ACTIVATIONS[name]
    x = torch.cat([torch.linspace(lo, hi, 400_001), torch.tensor(SPECIALS)]).to(device)
    y = torch.empty_like(x)
    block = 1 << 16 if x.device.type == "cpu" else 1024  # few interpreted programs; a GPU compiles small blocks fast
    _activation_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), FN=code, BLOCK=block)
    want = truth(x.double())
    finite = want.isfinite() & (want != 0)
    rel = ((y.double() - want).abs() / want.abs())[finite]
    assert rel.max().item() <= 1e-6, f"{name}: max rel error {rel.max().item():.2e} at x={x[finite][rel.argmax()]}"
    same = (y.double() == want) | (y.isnan() & want.isnan())
    assert bool(same[~finite].all()), f"{name}: non-finite or zero values differ at x={x[~finite][~same[~finite]]}"


@pytest.mark.parametrize("name", ["sigmoid", "sqrtsoftplus"])
def test_reference_activation_keeps_the_subnormals(name):
    """The reference's fp32 activations on [-100, 100] (SPEC §1): within 1e-6 relative of float64 where the value
    is a normal fp32, and within half a subnormal step (2^-150) below, where fp32's own formulas fail (sigmoid's
    1/(1+e^-x) is 0 from -88.7; sqrtsoftplus's log1p of a subnormal erred by 2%)."""
    x = torch.linspace(-100, 100, 400_001)
    got = activation(x, name).double()
    want = ACTIVATIONS[name][1](x.double())
    normal = want >= torch.finfo(torch.float32).tiny
    rel = ((got - want).abs() / want)[normal]
    assert rel.max().item() <= 1e-6, f"{name}: {rel.max().item():.2e} at x={x[normal][rel.argmax()]}"
    below = torch.where(normal, 0.0, (got - want).abs())  # sqrtsoftplus has none: e^(x/2) stays normal
    assert below.max().item() <= 2.0**-150, f"{name}: {below.max().item():.2e} at x={x[below.argmax()]}"


def test_sqrtsoftplus_weights_through_the_op(gen, device):
    """With every expert selected and no renormalisation the weights are the activations themselves."""
    x = torch.cat([torch.linspace(-100, 100, 63 * 32 - len(SPECIALS)), torch.tensor(SPECIALS)])
    x = x[torch.randperm(x.numel(), generator=gen)].view(63, 32).to(device)
    weights, ids = moe_fused_gate(x, None, 32, "sqrtsoftplus", renormalize=False, backend="triton")
    want = torch.sqrt(x.double().clamp_min(0) + torch.log1p(torch.exp(-x.double().abs()))).gather(1, ids.long())
    rel = ((weights.double() - want).abs() / want.abs()).nan_to_num(0.0)
    assert rel.max().item() <= 1e-6
    assert bool((weights.isnan() == want.isnan()).all())


# ---- adversarial inputs ---------------------------------------------------------------------------------------


def _quantised(gen, M, E, values, device):
    """Logits drawn from a few exact values, so keys tie exactly in every precision."""
    v = torch.tensor(values)
    return v[torch.randint(0, len(v), (M, E), generator=gen)].to(device)


def test_exact_key_ties_go_to_lower_id(gen, device):
    """Many experts share a logit and there is no bias: equal keys must go to the lower id, in fp32 as in fp64."""
    scores = _quantised(gen, 29, 64, [0.0, 0.5, 1.0, 1.5, 2.0], device)
    for scoring in ("sigmoid", "sqrtsoftplus", "softmax"):
        _route_and_judge(scores, None, 8, scoring_func=scoring, strict=True)


def test_exact_ties_at_the_boundary_with_groups(gen, device):
    """Quantised logits with groups: expert and group-score ties are decided by id, strictly."""
    scores = _quantised(gen, 23, 64, [0.0, 0.5, 1.0, 1.5, 2.0], device)
    _route_and_judge(scores, None, 6, num_expert_group=8, topk_group=3, strict=True)


def test_equal_group_scores_keep_lower_groups(gen, device):
    """Every group holds the same multiset of logits, so all group scores tie: groups 0..topk_group-1 win."""
    M, G, GS = 11, 8, 8
    base = torch.randn(M, 1, GS, generator=gen)
    perm = torch.argsort(torch.rand(M, G, GS, generator=gen), dim=-1)
    scores = base.expand(M, G, GS).gather(-1, perm).reshape(M, G * GS).to(device)
    _, ids, _ = _route_and_judge(scores, None, 8, num_expert_group=G, topk_group=3, strict=True)
    assert bool((ids < 3 * GS).all())


def test_duplicated_group_maximum_counts_twice(device):
    """Group 0's maximum appears twice (score 2·max); group 1 has a larger maximum but a small second."""
    scores = torch.full((2, 32), -4.0, device=device)
    scores[:, 0] = scores[:, 1] = 1.0  # group 0: sigmoid(1) twice = 1.462
    scores[:, 8] = 3.0  # group 1: sigmoid(3) + sigmoid(-4) = 0.971
    scores[1, 1] = -4.0  # row 1: group 0 now scores 0.749, below group 1
    _, ids, _ = _route_and_judge(scores, None, 2, num_expert_group=4, topk_group=1, strict=True)
    assert ids[0].tolist() == [0, 1]
    assert ids[1].tolist() == [8, 9]


def test_negative_biases_and_dropped_groups(gen, device):
    """Keys all negative: dropped groups (key -inf) must still lose to every kept expert, and ids stay distinct."""
    scores, _ = _inputs(gen, 31, 256, device=device)
    bias = (torch.randn(256, generator=gen) * 0.5 - 5.0).to(device)
    _route_and_judge(scores, bias, 8, num_expert_group=8, topk_group=4, routed_scaling_factor=2.5)
    _route_and_judge(scores, bias, 17, num_expert_group=8, topk_group=1)  # takes most of one group


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("scoring", ["sigmoid", "sqrtsoftplus", "softmax"])
def test_extreme_logits(scoring, backend, gen, device):
    """Logits in [-100, -20] and around +90: the tails where naive formulas underflow or overflow. Rows of logits
    all in [-92, -88.8] make every sigmoid subnormal, which renormalising turns back into ordinary weights (fp32's
    plain 1/(1+e^-x) is 0 there: e^-x overflows). Lower, a subnormal keeps too few bits for WEIGHT_TOL whoever
    computes it: the reference's weights on 40,000 such rows (top-8 of 64, both renormalisations) erred up to 2.2e-6
    against float64 with logits in [-92, -88.8], and up to 2.2e-2 in [-104, -88.8]."""
    low = -20 - 80 * torch.rand(17, 64, generator=gen)
    high = 90 + torch.randn(4, 64, generator=gen)
    subnormal = -92 + 3.2 * torch.rand(5, 64, generator=gen)
    scores = torch.cat([low, high, subnormal]).to(device)
    bias = (torch.randn(64, generator=gen) * 1e-3).to(device)
    _route_and_judge(scores, bias, 8, scoring_func=scoring, renormalize=False, backend=backend)
    _route_and_judge(scores, bias, 8, scoring_func=scoring, backend=backend)


@pytest.mark.parametrize("scoring", ["sigmoid", "sqrtsoftplus", "softmax"])
@pytest.mark.parametrize("groups", [1, 4])
def test_nan_and_inf_logits(scoring, groups, gen, device):
    """NaN keys rank below -inf; ±inf logits; whole rows of NaN or -inf. Ids stay distinct and in range."""
    E = 32
    scores, bias = _inputs(gen, 12, E, device=device)
    scores[0, [3, 7, 20]] = float("nan")
    scores[1, [0, 5]] = float("inf")
    scores[2, [1, 2, 30]] = float("-inf")
    scores[3] = float("nan")
    scores[4] = float("-inf")
    scores[5, :] = float("-inf")
    scores[5, 9] = float("nan")
    scores[6, ::2] = float("nan")  # half the row NaN: the other half must be picked first
    scores[7, :8] = float("nan")  # group 0 all NaN: its score is NaN and it ranks last
    _route_and_judge(scores, bias, 8, scoring_func=scoring, num_expert_group=groups, topk_group=min(groups, 2))
    _route_and_judge(scores, None, 8, scoring_func=scoring, num_expert_group=groups, topk_group=min(groups, 2))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_unit_shared_weight(backend, gen, device):
    """``unit_shared_weight``: the fused shared slots weigh exactly 1 where the routed weights do not decide them,
    also in a row whose sigmoid activations all underflow to 0 (logits near -300), where the spec's
    ``routed_sum / routed_scaling_factor`` gives 0; routed slots unchanged; padded rows still 0 and -1."""
    scores, bias = _inputs(gen, 8, 256, device=device)
    scores[2] = -300 + torch.randn(256, generator=gen).to(device)
    opts = dict(num_fused_shared_experts=2, **{**DSV3, "topk": 10}, backend=backend)
    plain = moe_fused_gate(scores, bias, **opts)
    unit = moe_fused_gate(scores, bias, **opts, unit_shared_weight=True, num_token_non_padded=7)
    assert bool((plain[0][2] == 0).all())  # the spec's weights: the shared slots too
    assert bool((unit[0][:7, 8:] == 1.0).all()) and torch.equal(unit[0][:7, :8], plain[0][:7, :8])
    assert torch.equal(unit[1][:7], plain[1][:7])
    assert bool((unit[0][7] == 0).all()) and bool((unit[1][7] == -1).all())
    with pytest.raises(TypeError, match="unit_shared_weight"):
        moe_fused_gate(scores, bias, **opts, unit_shared_weight=1)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_padded_rows(backend, gen, device):
    """Rows at or past num_token_non_padded get id -1 and weight 0, from an int or a 0-d int32/int64 tensor."""
    scores, bias = _inputs(gen, 8, 256, device=device)
    opts = dict(num_fused_shared_experts=1, **{**DSV3, "topk": 9})
    tensors = [torch.tensor(5, dtype=torch.int32), torch.tensor(8), torch.tensor(0, dtype=torch.int32)]
    for n in [0, 1, 7, 8, 50, -3] + [t.to(device) for t in tensors]:
        weights, ids, _ = _route_and_judge(scores, bias, num_token_non_padded=n, backend=backend, **opts)
        n_rows = min(max(int(n), 0), 8)
        assert bool((ids[n_rows:] == -1).all()) and bool((weights[n_rows:] == 0).all())
        assert bool((ids[:n_rows] >= 0).all())


def test_preallocated_out(gen, device):
    """out=(weights, ids) is written in place and returned; the result equals a fresh call."""
    scores, bias = _inputs(gen, 10, 384, dtype=torch.bfloat16, device=device)
    out = (torch.full((10, 8), float("nan"), device=device),
           torch.full((10, 8), 12345, dtype=torch.int32, device=device))
    got = moe_fused_gate(scores, bias, 8, routed_scaling_factor=2.827, out=out, backend="triton")
    assert got[0] is out[0] and got[1] is out[1]
    fresh = moe_fused_gate(scores, bias, 8, routed_scaling_factor=2.827, backend="triton")
    assert torch.equal(out[0], fresh[0]) and torch.equal(out[1], fresh[1])
    ref_out = (torch.empty(10, 8, device=device), torch.empty(10, 8, dtype=torch.int32, device=device))
    ref = moe_fused_gate_torch(scores, bias, 8, routed_scaling_factor=2.827, out=ref_out)
    assert ref[1] is ref_out[1] and torch.equal(ref[1], fresh[1])


def test_empty_batch(device):
    """M = 0 launches nothing and returns empty outputs."""
    weights, ids = moe_fused_gate(torch.empty(0, 64, device=device), None, 4, backend="triton")
    assert weights.shape == ids.shape == (0, 4)


def test_near_tie_rows_flags_only_close_boundaries():
    """The tolerance helper: a boundary pair 1e-7 apart is a near tie; a pair 1e-3 apart is not."""
    scores = torch.zeros(2, 8)
    bias = torch.tensor([0.9, 0.8, 0.5, 0.5 - 1e-7, 0.0, 0.0, 0.0, 0.0], dtype=torch.float32)
    assert near_tie_rows(scores, bias, 3).tolist() == [True, True]
    bias[3] = 0.499
    assert near_tie_rows(scores, bias, 3).tolist() == [False, False]


def test_custom_op_opcheck(gen, device):
    """moefuse::fused_gate passes torch.library.opcheck (schema, fake impl, mutation declarations)."""
    scores, bias = _inputs(gen, 5, 64, device=device)
    weights, ids = torch.empty(5, 6, device=device), torch.empty(5, 6, dtype=torch.int32, device=device)
    for invariant, unit in ((False, False), (True, True)):
        args = (scores, bias, weights, ids, "sigmoid", 1, True, 2.5, False, 4, 2, 0.0, None, 5, invariant, unit,
                "triton")
        torch.library.opcheck(torch.ops.moefuse.fused_gate.default, args,
                              test_utils=("test_schema", "test_faketensor"))


# ---- properties ------------------------------------------------------------------------------------------------


@st.composite
def _problems(draw):
    G = draw(st.sampled_from([1, 1, 2, 4, 8]))
    GS = draw(st.integers(1, 40))
    E = G * GS
    topk_group = draw(st.integers(1, G))
    shared = draw(st.integers(0, 2))
    k_routed = draw(st.integers(1, min(32 - shared, topk_group * GS)))
    scoring = draw(st.sampled_from(["sigmoid", "sqrtsoftplus", "softmax"]))
    return dict(
        M=draw(st.integers(1, 9)),
        E=E,
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        mean=draw(st.sampled_from([0.0, -14.0, 5.0])),
        bias=draw(st.booleans()),
        opts=dict(
            topk=k_routed + shared,
            scoring_func=scoring,
            num_fused_shared_experts=shared,
            renormalize=draw(st.booleans()),
            routed_scaling_factor=draw(st.sampled_from([1.0, 2.5, 0.3])),
            apply_routed_scaling_factor_on_output=draw(st.booleans()),
            num_expert_group=G,
            topk_group=topk_group,
            moe_softcapping=draw(st.sampled_from([0.0, 5.0])) if scoring == "softmax" else 0.0,
        ),
    )


@settings(max_examples=25, deadline=None)
@given(problem=_problems(), seed=st.integers(0, 2**31 - 1))
def test_kernel_property(problem, seed):
    """Any valid problem: distinct in-range ids, float64's experts up to near ties, weights within 1e-5."""
    gen = torch.Generator().manual_seed(seed)
    scores, bias = _inputs(gen, problem["M"], problem["E"], dtype=problem["dtype"], mean=problem["mean"],
                           bias=problem["bias"], device=DEVICE)
    _route_and_judge(scores, bias, **problem["opts"])


@settings(max_examples=15, deadline=None)
@given(problem=_problems(), runs=st.integers(1, 5), unit=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_runs_and_unit_shared_weight_property(problem, runs, unit, seed):
    """Any valid problem with its logits given as ``runs`` fp32 partial sums: the bits of the gate on their in-order
    sum (judged against float64 there), and with ``unit_shared_weight`` the same routed slots and shared slots at
    exactly 1."""
    gen = torch.Generator().manual_seed(seed)
    parts = torch.stack([_inputs(gen, problem["M"], problem["E"], mean=problem["mean"] / runs, bias=False,
                                 device=DEVICE)[0] for _ in range(runs)])
    bias = _inputs(gen, 1, problem["E"], device=DEVICE)[1] if problem["bias"] else None
    logits = summed_runs(parts)
    want = _route_and_judge(logits, bias, **problem["opts"])
    got = moe_fused_gate(parts, bias, **problem["opts"], backend="triton", unit_shared_weight=unit)
    routed = problem["opts"]["topk"] - problem["opts"]["num_fused_shared_experts"]
    assert torch.equal(got[1], want[1]) and torch.equal(got[0][:, :routed], want[0][:, :routed])
    shared = want[0][:, routed:] if not unit else torch.ones_like(want[0][:, routed:])
    assert torch.equal(got[0][:, routed:], shared)


# ---- errors ----------------------------------------------------------------------------------------------------

def _pair(weights_dtype=torch.float32, ids_dtype=torch.int32, shape=(4, 2)):
    return lambda d: (torch.empty(shape, dtype=weights_dtype, device=d), torch.empty(shape, dtype=ids_dtype, device=d))


def _tensor(*shape, dtype=torch.float32, device=None):
    return lambda d: torch.zeros(shape, dtype=dtype, device=device or d)


ERRORS = {
    # name: (arguments changed from scores=zeros(4, 16), bias=None, topk=2, backend="triton"; a callable value is
    #        built on the test device), exception, text the message must contain
    "scores-not-tensor": (dict(scores=[[0.0]]), TypeError, "scores"),
    "scores-int-dtype": (dict(scores=_tensor(4, 16, dtype=torch.int32)), TypeError, "scores"),
    "scores-fp64": (dict(scores=_tensor(4, 16, dtype=torch.float64)), TypeError, "scores"),
    "scores-1d": (dict(scores=_tensor(16)), ValueError, "scores"),
    "scores-no-experts": (dict(scores=_tensor(4, 0)), ValueError, "scores"),
    "bias-wrong-E": (dict(bias=_tensor(15)), ValueError, "bias"),
    "bias-bf16": (dict(bias=_tensor(16, dtype=torch.bfloat16)), TypeError, "bias"),
    "bias-2d": (dict(bias=_tensor(1, 16)), ValueError, "bias"),
    "bias-other-device": (dict(bias=_tensor(16, device="meta")), ValueError, "bias"),
    "topk-zero": (dict(topk=0), ValueError, "topk"),
    "topk-float": (dict(topk=2.0), TypeError, "topk"),
    "topk-not-above-shared": (dict(topk=2, num_fused_shared_experts=2), ValueError, "num_fused_shared_experts"),
    "shared-negative": (dict(num_fused_shared_experts=-1), ValueError, "num_fused_shared_experts"),
    "routed-more-than-E": (dict(topk=17), ValueError, "experts"),
    "routed-more-than-kept-groups": (dict(topk=9, num_expert_group=4, topk_group=2), ValueError, "topk_group"),
    "groups-not-dividing-E": (dict(num_expert_group=3), ValueError, "num_expert_group"),
    "topk-group-above-groups": (dict(num_expert_group=4, topk_group=5), ValueError, "topk_group"),
    "topk-group-zero": (dict(num_expert_group=4, topk_group=0), ValueError, "topk_group"),
    "unknown-scoring": (dict(scoring_func="relu"), ValueError, "scoring_func"),
    "scale-zero": (dict(routed_scaling_factor=0.0), ValueError, "routed_scaling_factor"),
    "scale-negative": (dict(routed_scaling_factor=-1.0), ValueError, "routed_scaling_factor"),
    "scale-nan": (dict(routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor"),
    "scale-inf": (dict(routed_scaling_factor=float("inf")), ValueError, "routed_scaling_factor"),
    "scale-none": (dict(routed_scaling_factor=None), TypeError, "routed_scaling_factor"),
    "softcap-negative": (dict(scoring_func="softmax", moe_softcapping=-1.0), ValueError, "moe_softcapping"),
    "softcap-inf": (dict(scoring_func="softmax", moe_softcapping=float("inf")), ValueError, "moe_softcapping"),
    "softcap-with-sigmoid": (dict(moe_softcapping=30.0), ValueError, "moe_softcapping"),
    "renormalize-not-bool": (dict(renormalize=1), TypeError, "renormalize"),
    "triton-E-above-1024": (dict(scores=_tensor(2, 1040)), ValueError, "1024"),
    "triton-topk-above-32": (dict(scores=_tensor(2, 64), topk=33), ValueError, "topk"),
    "ntnp-float": (dict(num_token_non_padded=2.0), TypeError, "num_token_non_padded"),
    "ntnp-1d-tensor": (dict(num_token_non_padded=_tensor(1, dtype=torch.int32)), ValueError, "num_token_non_padded"),
    "ntnp-float-tensor": (dict(num_token_non_padded=_tensor()), TypeError, "num_token_non_padded"),
    "ntnp-other-device": (dict(num_token_non_padded=_tensor(dtype=torch.int32, device="meta")), ValueError,
                          "num_token_non_padded"),
    "out-not-pair": (dict(out=_tensor(4, 2)), TypeError, "out"),
    "out-weights-dtype": (dict(out=_pair(weights_dtype=torch.float16)), TypeError, "out[0]"),
    "out-ids-dtype": (dict(out=_pair(ids_dtype=torch.int64)), TypeError, "out[1]"),
    "out-wrong-shape": (dict(out=_pair(shape=(4, 3))), ValueError, "out[0]"),
    "out-not-contiguous": (dict(out=lambda d: (torch.empty(2, 4, device=d).t(), torch.empty(4, 2, dtype=torch.int32,
                                                                                          device=d))),
                           ValueError, "out[0]"),
    "unknown-backend": (dict(backend="cuda"), ValueError, "backend"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_name_the_argument(name, device):
    """Each bad argument raises before any launch, with a message naming it."""
    changes, exc, text = ERRORS[name]
    call = {"scores": _tensor(4, 16), "bias": None, "topk": 2, "backend": "triton", **changes}
    call = {k: v(device) if callable(v) else v for k, v in call.items()}
    with pytest.raises(exc) as info:
        moe_fused_gate(call.pop("scores"), call.pop("bias"), call.pop("topk"), **call)
    assert text in str(info.value), str(info.value)


def test_no_limits_on_the_reference_backend(device):
    """E > 1024 and topk > 32 are kernel limits only; the reference routes them."""
    scores = torch.randn(3, 2048, device=device)
    weights, ids = moe_fused_gate(scores, None, 40, backend="reference")
    assert ids.shape == (3, 40) and math.isclose(weights.sum(1)[0].item(), 1.0, rel_tol=1e-5)
