"""The persistent warp-specialized prefill GEMMs (``experts/persistent.py``, Gluon, sm_90 only). 16-bit: against the
float64 reference within bf16's and fp16's tolerances (``tests/tolerances.py``, tall tiles), and bit for bit against the
``tl`` kernels on the same plan: the spec does not require it, but both sum the same products in fp32 in the same
64-deep K order on wgmma, and one H200 gave equal bits on every case here, so a difference is a finding. Ragged, skewed
and empty experts, the clamp, NaN, odd expert counts, widths that are not powers of two. fp8 block-scale: against
the float64 emulation of SPEC §5 within fp8's tolerance. CI compiles these kernels
for sm_90 (``tests/test_sm90.py``); they run here only on a Hopper GPU."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import experts_tolerance

from moefuse import _runtime
from moefuse.dispatch import moe_dispatch
from moefuse.experts import moe_experts, moe_experts_torch, persistent
from moefuse.experts.reference import moe_experts_fp8_torch
from moefuse.formats import BlockFP8
from moefuse.testing import rel_error, rms_rel_error

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or _runtime.interpreting() or _runtime.capability(torch.device("cuda")) != (9, 0),
    reason="the persistent kernels are Gluon for sm_90: compiled in CI (test_sm90), run on a Hopper GPU")

# (E, H, I, top_k, M, routing, limit): routing "uniform", "skewed" (a few experts take most rows: several tiles
# per expert, remainders of every height), "empty" (half the experts get nothing, a quarter of the slots are -1)
CASES = [
    (9, 256, 128, 2, 1, "uniform", None),
    (9, 256, 128, 2, 37, "uniform", 0.5),
    (77, 512, 384, 6, 1000, "skewed", 0.5),
    (300, 768, 256, 8, 513, "uniform", None),
    (16, 1024, 256, 4, 300, "empty", None),
    (8, 2048, 768, 2, 700, "skewed", None),
]
# (programs, dynamic): the default, then each experiment of ``persistent.launch`` (3 programs: many items each, so
# the dynamic claims' ring wraps)
SCHEDULES = [(None, True), (3, True), (None, False), (1 << 30, False), (3, False)]


def _inputs(E, H, I, K, M, routing, dtype, gen):
    x = torch.randn(M, H, generator=gen).to("cuda", dtype)
    w1 = (torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H)).to("cuda", dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / math.sqrt(I)).to("cuda", dtype)
    logits = torch.randn(M, E, generator=gen)
    if routing == "skewed":
        logits += 3.0 * torch.log(1.0 / torch.arange(1, E + 1))
    ids = logits.topk(K, dim=1).indices.int()
    if routing == "empty":
        ids = torch.where(ids >= E // 2, ids - E // 2, ids)
        ids[::4, 0] = -1
    return x, w1, w2, ids.cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}-H{c[1]}-I{c[2]}-K{c[3]}-M{c[4]}-{c[5]}-{c[6]}")
def test_persistent_matches_float64_and_tl(case, dtype, gen):
    E, H, I, K, M, routing, limit = case
    x, w1, w2, ids = _inputs(E, H, I, K, M, routing, dtype, gen)
    plan = moe_dispatch(ids, E, persistent.BLOCK_M)
    n = int(plan.expert_offsets[-1])
    out = torch.full((plan.num_rows, H), float("nan"), dtype=dtype, device="cuda")
    assert persistent.eligible(x, w1, w2, plan, out)
    persistent.experts_persistent(x, w1, w2, plan, out, limit)
    ref = moe_experts_torch(x, w1, w2, plan, swiglu_limit=limit, dtype=torch.float64)
    max_tol, rms_tol = experts_tolerance("bf16" if dtype == torch.bfloat16 else "fp16", persistent.BLOCK_M)
    assert rel_error(out[:n], ref[:n]) <= max_tol
    assert rms_rel_error(out[:n], ref[:n]) <= rms_tol
    assert out[n:].isnan().all(), "rows with no token must be left unwritten"
    tl_out = moe_experts(x, w1, w2, plan, swiglu_limit=limit)
    assert torch.equal(out[:n], tl_out[:n])


def test_nan_stays_in_its_token(gen):
    x, w1, w2, ids = _inputs(9, 256, 128, 2, 200, "uniform", torch.bfloat16, gen)
    x[5, 17] = float("nan")
    plan = moe_dispatch(ids, 9, persistent.BLOCK_M)
    out = torch.empty(plan.num_rows, 256, dtype=torch.bfloat16, device="cuda")
    persistent.experts_persistent(x, w1, w2, plan, out, 0.5)
    rows = plan.expanded_to_permuted.view(200, 2)
    nan_rows = out[rows[5].long()].isnan().all(dim=1)
    others = torch.cat([rows[:5], rows[6:]]).flatten().long()
    assert nan_rows.all() and not out[others].isnan().any()


def test_op_runs_them_when_asked(gen, monkeypatch):
    """``persistent="all"`` (argument, or the process default ``MOEFUSE_PERSISTENT=1``): ``moe_experts`` on a 128-row
    plan takes the persistent path (same bits)."""
    x, w1, w2, ids = _inputs(9, 256, 128, 2, 300, "uniform", torch.bfloat16, gen)
    plan = moe_dispatch(ids, 9, persistent.BLOCK_M)
    calls = []
    real = persistent.experts_persistent
    monkeypatch.setattr(persistent, "experts_persistent", lambda *a: calls.append(1) or real(*a))
    expected = moe_experts(x, w1, w2, plan)
    got = moe_experts(x, w1, w2, plan, persistent="all")
    n = int(plan.expert_offsets[-1])
    assert len(calls) == 1 and torch.equal(got[:n], expected[:n])
    monkeypatch.setattr(_runtime.DEFAULTS, "persistent", "all")
    assert torch.equal(moe_experts(x, w1, w2, plan)[:n], expected[:n]) and len(calls) == 2


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", [c for c in CASES if c[5] != "uniform"], ids=lambda c: f"E{c[0]}-M{c[4]}-{c[5]}")
def test_item_orders_and_schedules_give_the_same_bits(case, fp8, gen):
    """The experiment switches of ``persistent.launch`` (one item a program; items claimed from a counter) change
    which program computes an item, never what it computes; bf16 and fp8 block-scale weights."""
    E, H, I, K, M, routing, limit = case
    x, w1, w2, ids = _inputs(E, H, I, K, M, routing, torch.bfloat16, gen)
    run, weights = ((persistent.experts_persistent_fp8, (BlockFP8.quantize(w1), BlockFP8.quantize(w2))) if fp8
                    else (persistent.experts_persistent, (w1, w2)))
    plan = moe_dispatch(ids, E, persistent.BLOCK_M)
    n = int(plan.expert_offsets[-1])
    outs = []
    for programs, dynamic in SCHEDULES:
        out = torch.full((plan.num_rows, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        run(x, *weights, plan, out, limit, programs=programs, dynamic=dynamic)
        outs.append(out[:n])
    assert all(torch.equal(outs[0], other) for other in outs[1:])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}-H{c[1]}-I{c[2]}-K{c[3]}-M{c[4]}-{c[5]}-{c[6]}")
def test_persistent_fp8_matches_the_spec(case, gen):
    """fp8 block-scale (SPEC §5): against the float64 emulation of the spec within fp8's tall-tile tolerance
    (wgmma's fp8 sums, as the ``tl`` kernels' 64- and 128-row tiles), and against the ``tl`` kernels within the
    same (they may differ by the e4m3 roundings of the intermediate that those sums flip)."""
    E, H, I, K, M, routing, limit = case
    x, w1, w2, ids = _inputs(E, H, I, K, M, routing, torch.bfloat16, gen)
    q1, q2 = BlockFP8.quantize(w1), BlockFP8.quantize(w2)
    plan = moe_dispatch(ids, E, persistent.BLOCK_M)
    n = int(plan.expert_offsets[-1])
    out = torch.full((plan.num_rows, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert persistent.eligible_fp8(x, q1, q2, plan, out)
    persistent.experts_persistent_fp8(x, q1, q2, plan, out, limit)
    ref = moe_experts_fp8_torch(x, q1, q2, plan, swiglu_limit=limit, dtype=torch.float64)
    max_tol, rms_tol = experts_tolerance("fp8", persistent.BLOCK_M, n)
    assert rel_error(out[:n], ref[:n]) <= max_tol
    assert rms_rel_error(out[:n], ref[:n]) <= rms_tol
    assert out[n:].isnan().all(), "rows with no token must be left unwritten"
    tl_out = moe_experts(x, q1, q2, plan, swiglu_limit=limit)
    assert rel_error(out[:n], tl_out[:n]) <= max_tol


def test_fp8_nan_stays_in_its_token(gen):
    x, w1, w2, ids = _inputs(9, 256, 128, 2, 200, "uniform", torch.bfloat16, gen)
    x[5, 17] = float("nan")
    q1, q2 = BlockFP8.quantize(w1), BlockFP8.quantize(w2)
    plan = moe_dispatch(ids, 9, persistent.BLOCK_M)
    out = torch.empty(plan.num_rows, 256, dtype=torch.bfloat16, device="cuda")
    persistent.experts_persistent_fp8(x, q1, q2, plan, out, 0.5)
    rows = plan.expanded_to_permuted.view(200, 2)
    others = torch.cat([rows[:5], rows[6:]]).flatten().long()
    assert out[rows[5].long()].isnan().all() and not out[others].isnan().any()
