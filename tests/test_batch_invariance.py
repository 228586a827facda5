"""Batch invariance: with ``batch_invariant=True`` a token's output is bitwise the same alone and inside any batch.

Every stage must sum a row in one order at every batch size: the router linear on one launch, the fused gate one row
a program, the grouped GEMMs on wgmma at every size (16-bit: tiles of 64 rows or more; fp8: shorter tiles swapped,
the weights as the MMA's M; MXFP4 W4A16 gives a row the same bits on every tile height), fp8 GEMM1 never split
along K, the shared expert as one more slot of the grouped GEMMs at every size (where the layer cannot, on the side
stream through kernels of one order). The batches below cross the sizes where the plans change tile height (16 -> 64
-> 128 rows, the fp8 persistent kernels from 2,048 tokens on a GPU)
and primes around them, with the token at the first, a middle and the last position, among adversarial neighbours
(huge and tiny rows). Kernels run compiled on a GPU and through Triton's interpreter on the CPU (smaller batches
there: the interpreter runs programs one by one).

Without the switch the default kernels are only within tolerance of each other (``test_default_is_within_tolerance``):
a token alone runs 16-row mma.sync tiles, in a large batch 128-row wgmma tiles.
"""

from __future__ import annotations

import pytest
import torch
from hf_blocks import block as hf_block
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import ROUTER_TOL, experts_tolerance, router_error

import moefuse
from moefuse import MoELayer, _runtime
from moefuse.config import MoEConfig
from moefuse.dispatch import moe_dispatch
from moefuse.experts import moe_experts, plan_block_m, rows_linear
from moefuse.experts.common import rows_swiglu
from moefuse.experts.op import rows_linear_tiles
from moefuse.reference import moe_layer_torch
from moefuse.route import moe_fused_gate, router_logits
from moefuse.route.reference import summed_runs
from moefuse.testing import rel_error

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
HOPPER = GPU and torch.cuda.get_device_capability() == (9, 0)
# Plan heights switch where the rows per expert pass 64 (E = 8, top-2: 257 tokens) and, for fp8 on a GPU without a
# tuned table for this shape, at 2,048 tokens (the persistent kernels); primes around each.
BATCHES = (2, 15, 17, 63, 65, 127, 131, 255, 257, 263, 509, 1021, 2039, 2053) if GPU else (3, 67)
CONFIG = MoEConfig(256, 128, 8, 2, num_shared_experts=1, routed_scaling_factor=1.5, swiglu_limit=7.0)
FORMATS = [
    pytest.param(None, "default", torch.bfloat16, "bf16", id="bf16"),
    pytest.param(None, "default", torch.float16, "fp16", id="fp16"),
    pytest.param(None, "default", torch.float32, "fp32", id="fp32"),
    pytest.param("fp8", "default", torch.bfloat16, "fp8", id="fp8"),
    pytest.param("mxfp4", "default", torch.bfloat16, "mxfp4", id="mxfp4-w4a16"),
    pytest.param("mxfp4", "fp8", torch.bfloat16, "w4a8", id="mxfp4-w4a8",
                 marks=pytest.mark.skipif(not HOPPER, reason="W4A8 runs on sm_90 only")),
]


def _layer(quant, activation_quant, dtype, device, invariant=True, **kwargs) -> MoELayer:
    layer = MoELayer(CONFIG, dtype=dtype, quant=quant, activation_quant=activation_quant, device=device,
                     backend="triton", batch_invariant=invariant, **kwargs)
    return layer.init_random_(seed=5, std=0.08)


def _neighbours(M: int, dtype: torch.dtype, device, gen: torch.Generator) -> torch.Tensor:
    """A batch of random rows with some huge and some tiny ones (finite: the token's own output must not care)."""
    batch = torch.randn(M, CONFIG.hidden_size, generator=gen)
    scale = torch.ones(M, 1)
    scale[::3] = 300.0 if dtype != torch.float16 else 30.0
    scale[1::5] = 1e-4
    return (batch * scale).to(dtype).to(device)


@pytest.mark.parametrize("quant, activation_quant, dtype, fmt", FORMATS)
def test_token_is_bitwise_the_same_in_any_batch(quant, activation_quant, dtype, fmt, device, gen):
    layer = _layer(quant, activation_quant, dtype, device, graph_max_tokens=0)
    token = torch.randn(1, CONFIG.hidden_size, generator=gen).to(dtype).to(device)
    with torch.no_grad():
        alone = layer(token)[0]
        for M in BATCHES:
            batch = _neighbours(M, dtype, device, gen)
            for at in sorted({0, M // 2, M - 1}):
                batch[at] = token[0]
                got = layer(batch)[at]
                assert torch.equal(got, alone), (
                    f"{fmt}: token at {at} of {M}: max difference {(got.float() - alone.float()).abs().max():.3e}")
                batch[at] = _neighbours(1, dtype, device, gen)[0]
        # Accurate too: within the format's tolerance of the float64 reference (tall tiles' row, the invariant path).
        want = moe_layer_torch(layer, token, route_dtype=torch.float32)[0]
        tol = experts_tolerance(fmt, 128)[0]
        assert rel_error(alone, want) <= tol, f"{fmt}: {rel_error(alone, want):.2e} from float64 > {tol:.0e}"


@pytest.mark.parametrize("quant, activation_quant, dtype, fmt", FORMATS[:1] + FORMATS[3:5])
def test_padded_rows_and_decode_graphs_change_nothing(quant, activation_quant, dtype, fmt, device, gen):
    """A token among padded rows (``num_token_non_padded``), and through the layer's own decode graphs (a batch of at
    most ``graph_max_tokens`` replays one), is the same bits as alone and eager."""
    layer = _layer(quant, activation_quant, dtype, device, graph_max_tokens=8)
    token = torch.randn(1, CONFIG.hidden_size, generator=gen).to(dtype).to(device)
    with torch.no_grad():
        alone = layer(token, num_token_non_padded=1)[0]
        for M, real in ((5, 3), (40, 21)):
            batch = _neighbours(M, dtype, device, gen)
            batch[1] = token[0]
            assert torch.equal(layer(batch, num_token_non_padded=real)[1], alone), (fmt, M, "padded")
            assert torch.equal(layer(batch)[1], alone), (fmt, M, "graph" if M <= 8 else "eager")
        assert torch.equal(layer(token)[0], alone)  # one token: a graph replay on a GPU


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "default"])
def test_shared_expert_stays_where_every_routed_weight_underflows(invariant, device, gen):
    """A token whose router logits all lie far below zero (its sigmoid activations underflow to 0: every routed
    weight is 0) still gets its shared expert whole, as the reference adds it, through the shared slot (the
    invariant layer's at every size) or on the side stream. Huge rows of random batches hit this now and then."""
    layer = _layer(None, "default", torch.bfloat16, device, invariant=invariant)
    with torch.no_grad():
        layer.gate.weight.abs_()
        x = _neighbours(9, torch.bfloat16, device, gen)
        x[4] = -300 * x[4].abs().clamp_min(0.5)  # logits below -300 · 0.5 · sum |w| for every expert
        got = layer(x)
        want = moe_layer_torch(layer, x, route_dtype=torch.float32)
    assert (layer.gate.logits(x)[4] < -200).all()
    assert rel_error(got, want) <= experts_tolerance("bf16", 128)[0] and got[4].abs().max() > 0


@pytest.mark.parametrize("quant, activation_quant, dtype, fmt", FORMATS[:1] + FORMATS[3:4])  # MXFP4: bf16 shared
def test_shared_slot_at_every_size_padded_rows_keep_it(quant, activation_quant, dtype, fmt, device, gen):
    """The shared expert runs as a slot of the grouped GEMMs at every size, padded or not (one path; on the side
    stream a small batch's launches trail the routed GEMMs), unless ``shared_slot_max_tokens=0``. Padded rows get the
    shared expert alone, as the side stream gives them: within the format's tolerance of float64."""
    layer = _layer(quant, activation_quant, dtype, device)
    assert all(layer.uses_shared_slot(M, device, n) for M in (1, 7, 10**5) for n in (None, 3))
    x = _neighbours(9, dtype, device, gen)
    with torch.no_grad():
        got = layer(x, num_token_non_padded=torch.tensor(5, device=device))
        assert torch.equal(got[:5], layer(x)[:5])
        want = moe_layer_torch(layer, x, 5, route_dtype=torch.float32)
        tol = experts_tolerance(fmt, 128)[0]
        assert rel_error(got[5:], want[5:]) <= tol and rel_error(got[:5], want[:5]) <= tol
    layer.shared_slot_max_tokens = 0
    assert not layer.uses_shared_slot(1, device)


@pytest.mark.parametrize("quant, activation_quant, dtype, fmt", FORMATS[:1] + FORMATS[3:4])
def test_same_batch_twice_is_the_same_bits(quant, activation_quant, dtype, fmt, device, gen):
    """Run to run, with the persistent kernels' dynamic schedule (items claimed as programs free up) on a GPU."""
    layer = _layer(quant, activation_quant, dtype, device, persistent="all")
    M = 2053 if GPU else 67
    batch = _neighbours(M, dtype, device, gen)
    with torch.no_grad():
        first = layer(batch)
        for _ in range(2):
            assert torch.equal(layer(batch), first), fmt


# fp32: the slot (and on the CPU the format whose default sums follow the batch's shape); MXFP4: its fp8 shared expert
# on the side stream
@pytest.mark.parametrize("quant, activation_quant, dtype, fmt", FORMATS[2:3] + FORMATS[4:5])
def test_combine_deferred_or_not_or_by_the_caller(quant, activation_quant, dtype, fmt, device, gen):
    """A token's bits alone and in a batch whether the layer defers its combine or not (``deferred_finalize``), and
    where the caller combines the deferred pieces itself (``forward_deferred_finalize``, the shared expert and
    ``finalize_deferred_output``, as an engine fusing the combine into its next step does)."""
    token = torch.randn(1, CONFIG.hidden_size, generator=gen).to(dtype).to(device)
    M = 131 if GPU else 67
    batch = _neighbours(M, dtype, device, gen)
    batch[M // 2] = token[0]
    for deferred in (False, True):
        layer = _layer(quant, activation_quant, dtype, device, graph_max_tokens=0, deferred_finalize=deferred)
        with torch.no_grad():
            own = layer(token)[0]
            assert torch.equal(layer(batch)[M // 2], own), (fmt, deferred)
    assert layer.shared_experts is not None

    def by_the_caller(x: torch.Tensor) -> torch.Tensor:
        pieces = layer.forward_deferred_finalize(x, *layer.gate(x))
        return moefuse.finalize_deferred_output(pieces, layer.shared_experts(x), backend="triton")

    with torch.no_grad():
        alone = by_the_caller(token)[0]
        assert torch.equal(by_the_caller(batch)[M // 2], alone), fmt
    if layer.uses_shared_slot(1, device):  # the layer sums the shared expert as a slot: another order
        assert rel_error(alone, own) <= experts_tolerance(fmt, 128)[0], fmt
    else:  # the deferring layer's own combine: the same launches
        assert torch.equal(alone, own), fmt


def test_transformers_block_alone_and_batched(device, gen):
    """``moefuse.from_hf(block, batch_invariant=True)`` on a transformers block: a token alone and in a batch."""
    block = hf_block("deepseek-v3", gen).to(device, torch.bfloat16)
    layer = moefuse.from_hf(block, backend="triton", batch_invariant=True)
    token = torch.randn(1, 48, generator=gen).to(device, torch.bfloat16)
    with torch.no_grad():
        alone = layer(token)[0]
        for M in (2, 37, 131) if GPU else (2, 37):
            batch = torch.randn(M, 48, generator=gen).to(device, torch.bfloat16) * 4
            batch[M // 2] = token[0]
            assert torch.equal(layer(batch)[M // 2], alone), M
        assert rel_error(alone, block(token[None])[0, 0]) <= 2e-2  # still the block's function


def test_default_is_within_tolerance_not_bitwise(device, gen):
    """Without the switch the tile path follows the batch: a token alone and in a large batch agree to the format's
    tolerance (this is what batch_invariant=True tightens to bitwise)."""
    layer = _layer(None, "default", torch.bfloat16, device, invariant=False)
    token = torch.randn(1, CONFIG.hidden_size, generator=gen).bfloat16().to(device)
    heights = {plan_block_m(M, layer.experts.weights()[0], CONFIG.top_k, token.dtype, arch=None if not GPU else "auto")
               for M in (1, BATCHES[-1])}
    assert len(heights) > 1, "the batches should take different tile heights"
    with torch.no_grad():
        alone = layer(token)[0]
        batch = _neighbours(BATCHES[-1], torch.bfloat16, device, gen)
        batch[3] = token[0]
        assert rel_error(layer(batch)[3], alone) <= experts_tolerance("bf16", 128)[0]


def test_process_default(device, gen, monkeypatch):
    """``MOEFUSE_BATCH_INVARIANT=1`` (read once, at import) and ``moefuse.set_defaults`` switch every layer and op
    left at None."""
    assert _runtime.read_environment({"MOEFUSE_BATCH_INVARIANT": "1"}).batch_invariant
    assert not _runtime.read_environment({}).batch_invariant
    with pytest.raises(ValueError, match="MOEFUSE_BATCH_INVARIANT"):
        _runtime.read_environment({"MOEFUSE_BATCH_INVARIANT": "yes"})
    weight = _layer(None, "default", torch.float32, device).experts.weights()[0]
    assert plan_block_m(1, weight, 2, torch.float32, arch=None) < 32
    with _runtime.defaults(batch_invariant=True):
        assert plan_block_m(1, weight, 2, torch.float32, arch=None) == 32
        assert plan_block_m(1, weight, 2, torch.float32, arch=None, batch_invariant=False) < 32
    with pytest.raises(TypeError, match="batch_invariant"):
        moefuse.set_defaults(batch_invariant="yes")
    with pytest.raises(TypeError, match="unknown"):
        moefuse.set_defaults(invariance=True)


def test_ops_refuse_a_plan_that_cannot_be_invariant(device, gen):
    """fp32 sums on FMAs, one tile shape at every size: a 16-row plan would sum a row otherwise than 32-row ones."""
    x = torch.randn(3, 64, generator=gen).to(device)
    w1 = torch.randn(4, 64, 64, generator=gen).to(device)
    w2 = torch.randn(4, 64, 32, generator=gen).to(device)
    ids = torch.randint(0, 4, (3, 2), generator=gen).int().to(device)
    plan = moe_dispatch(ids, 4, 16, backend="triton")
    with pytest.raises(ValueError, match="block_m >= 32"):
        moe_experts(x, w1, w2, plan, backend="triton", batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant"):
        moe_experts(x, w1, w2, plan, backend="triton", batch_invariant=1)


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float16, torch.float32), (torch.float32, torch.float32)])
def test_router_stages_alone_and_batched(x_dtype, w_dtype, device, gen):
    """The router linear and the fused gate, and the dense projection of the shared expert (``rows_linear``), on
    their own: a row's outputs alone and at several positions of batches on both sides of the default kernels'
    switches (16 and 1,024 rows for the logits), and accurate."""
    H, E = 320, 72
    weight = torch.randn(E, H, generator=gen).to(w_dtype).to(device)
    row = torch.randn(1, H, generator=gen).to(x_dtype).to(device)
    logits = router_logits(row, weight, backend="triton", batch_invariant=True)
    sizes = (16, 17, 1031) if GPU else (16, 17, 131)
    for M in sizes:
        batch = torch.randn(M, H, generator=gen).to(x_dtype).to(device) * 8
        batch[M - 1] = row[0]
        got = router_logits(batch, weight, backend="triton", batch_invariant=True)
        assert torch.equal(got[M - 1], logits[0]), M
        assert rel_error(got, batch.double() @ weight.double().T) <= 1e-6, M
        weights, ids = moe_fused_gate(got, None, 4, "softmax", backend="triton", batch_invariant=True)
        alone = moe_fused_gate(logits, None, 4, "softmax", backend="triton", batch_invariant=True)
        assert torch.equal(weights[M - 1], alone[0][0]) and torch.equal(ids[M - 1], alone[1][0])
    if x_dtype != torch.float16:
        # 1,024 columns: one row runs 32-column blocks (a program per SM), 1,031 rows wider ones
        proj = torch.randn(1024, H, generator=gen).to(x_dtype).to(device)
        widths = [rows_linear_tiles(M, proj, x_dtype, None).gemm2.block_n for M in (1, 1031)]
        assert widths[0] == 32 < widths[1], widths
        alone = rows_linear(row, proj, backend="triton")
        for M in sizes:
            batch = torch.randn(M, H, generator=gen).to(x_dtype).to(device)
            batch[M // 3] = row[0]
            got = rows_linear(batch, proj, backend="triton")
            assert torch.equal(got[M // 3], alone[0]), M
            # accurate too: one rounding of fp32 sums to the output's dtype (the experts' GEMM2 tolerance)
            fmt = "fp32" if x_dtype == torch.float32 else "bf16"
            assert rel_error(got, batch.double() @ proj.double().T) <= experts_tolerance(fmt, 64)[0], M


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_gate_adds_the_router_runs(scoring, device, gen):
    """``router_logits(..., unsummed=True)``: the invariant router's runs' partial sums, which the gate adds in run
    order itself (the layer's path: one kernel fewer). bf16 rows over H = 1,100 make four runs, whose in-order sum is
    the summed logits' bits; the gate on the runs gives the bits it gives on those logits, with a huge row, a NaN in
    one run's partial sum and grouped experts; fp32 rows, the default router and the reference make one run."""
    H, E, M = 1100, 72, 37
    weight = torch.randn(E, H, generator=gen).to(device)
    x = torch.randn(M, H, generator=gen).bfloat16().to(device)
    x[5] *= 300
    runs = router_logits(x, weight, backend="triton", batch_invariant=True, unsummed=True)
    logits = router_logits(x, weight, backend="triton", batch_invariant=True)
    assert runs.shape == (4, M, E) and runs.is_contiguous()
    assert torch.equal(summed_runs(runs), logits)
    runs[2, 9, 7] = float("nan")
    logits = summed_runs(runs)
    for groups in (1, 8):
        kw = dict(num_fused_shared_experts=1, routed_scaling_factor=2.5, num_expert_group=groups,
                  topk_group=min(groups, 4), backend="triton", batch_invariant=True)
        got = moe_fused_gate(runs, None, 5, scoring, **kw)
        want = moe_fused_gate(logits, None, 5, scoring, **kw)
        assert torch.equal(got[0].nan_to_num(), want[0].nan_to_num()) and torch.equal(got[1], want[1]), groups
        assert torch.equal(got[0].isnan(), want[0].isnan())
        ref = moe_fused_gate(runs, None, 5, scoring, **{**kw, "backend": "reference"})
        ref_summed = moe_fused_gate(logits, None, 5, scoring, **{**kw, "backend": "reference"})
        assert torch.equal(ref[0].nan_to_num(), ref_summed[0].nan_to_num()) and torch.equal(ref[1], ref_summed[1])
    for kw in ({"batch_invariant": False}, {"backend": "reference"}):
        one = router_logits(x, weight, **{"backend": "triton", "batch_invariant": True, **kw}, unsummed=True)
        assert one.shape == (1, M, E)
        assert torch.equal(one[0], router_logits(x, weight, **{"backend": "triton", "batch_invariant": True, **kw}))
    assert router_logits(x.float(), weight, backend="triton", batch_invariant=True, unsummed=True).shape == (1, M, E)


def test_unsummed_logits_and_runs_are_checked(device):
    """The runs' shapes are checked before any launch: ``unsummed`` a bool, its ``out`` [R, M, E] contiguous fp32,
    the gate's 3-D scores fp32 with at least one run."""
    x, weight = torch.randn(3, 600, device=device).bfloat16(), torch.randn(8, 600, device=device)
    with pytest.raises(TypeError, match="unsummed"):
        router_logits(x, weight, unsummed=1)
    with pytest.raises(ValueError, match="out"):  # 600 columns: two runs
        router_logits(x, weight, backend="triton", batch_invariant=True, unsummed=True,
                      out=torch.empty(3, 8, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        router_logits(x, weight, backend="triton", batch_invariant=True, unsummed=True,
                      out=torch.empty(2, 8, 3, device=device).transpose(1, 2))
    for scores, error in ((torch.zeros(2, 3, 8, dtype=torch.bfloat16), TypeError), (torch.zeros(0, 3, 8), ValueError),
                          (torch.zeros(1, 2, 3, 8), ValueError)):
        with pytest.raises(error, match="scores"):
            moe_fused_gate(scores.to(device), None, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_rows_swiglu_alone_and_batched(dtype, limit, device, gen):
    """The invariant shared expert's SwiGLU (the GEMM1 epilogue's, one rounding): a row alone is the bits it gets in
    a batch (PyTorch's CPU silu is not: a vectorised body and a scalar tail differ), and within one rounding of
    float64 (2^-8 relative in bf16, 2^-11 in fp16, a few fp32 ulps)."""
    I = 1100  # two column blocks, the second partial
    gate, up = (torch.randn(37, I, generator=gen).to(dtype).to(device) for _ in range(2))
    got = rows_swiglu(gate, up, limit)
    for row in (0, 17, 36):
        assert torch.equal(rows_swiglu(gate[row:row + 1], up[row:row + 1], limit)[0], got[row])
    g, u = gate.double(), up.double()
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    want = torch.nn.functional.silu(g) * u
    bound = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 1e-6}[dtype]
    assert rel_error(got, want) <= bound


def test_reductions_read_one_layout():
    """``_runtime.laid_out_once``, what the invariant router linear (fp32 path) and gate read their input through:
    Triton specialises a launch on strides and alignment, and the layout it then picks orders a ``tl.sum`` (a strided
    row got other logits than the same row contiguous, on an H100). Contiguous and 16-byte aligned passes as is;
    anything else (a column stride, a size-1 dim's odd stride, an offset start) becomes a contiguous aligned copy."""
    x = torch.randn(6, 8)
    assert _runtime.laid_out_once(x) is x
    aligned = x[2:]  # 64 bytes in: kept
    assert _runtime.laid_out_once(aligned) is aligned
    misaligned = x.reshape(-1)[1:41].view(5, 8)  # 4 bytes in
    for view in (x[:, ::2], x.t(), misaligned, torch.randn(1, 8).as_strided((1, 8), (11, 1))):
        copy = _runtime.laid_out_once(view)
        assert copy is not view and copy.stride() == (copy.shape[1], 1) and copy.data_ptr() % 16 == 0
        assert torch.equal(copy, view)


@settings(max_examples=6 if not GPU else 40, deadline=None)
@given(M=st.integers(1, 90), H=st.integers(1, 300), E=st.integers(1, 80), at=st.integers(0, 89),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), strided=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_invariant_router_linear_over_shapes_and_strides(M, H, E, at, dtype, strided, seed):
    """Property: for any M, H, E, either activation path (bf16: the tensor-core runs; fp32: the row blocks) and x with
    an inner stride of 2, the invariant router linear is within ``ROUTER_TOL`` of float64 and a row's logits are the
    bits it gets alone (an H of 1 or 257 takes a partial K step; E of 1 or 65 a partial column block)."""
    gen = torch.Generator().manual_seed(seed)
    at = at % M
    wide = torch.randn(M, 2 * H if strided else H, generator=gen).to(dtype).to(DEVICE)
    x = wide[:, ::2] if strided else wide
    weight = torch.randn(E, H, generator=gen).to(DEVICE)
    got = router_logits(x, weight, backend="triton", batch_invariant=True)
    assert router_error(got, x, weight) <= ROUTER_TOL
    alone = router_logits(x[at:at + 1].contiguous(), weight, backend="triton", batch_invariant=True)
    assert torch.equal(got[at], alone[0])
