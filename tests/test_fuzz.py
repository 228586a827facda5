"""Property-based tests (hypothesis) of ``moe_experts`` and ``MoELayer`` against their float64 oracles.

Why: MXFP4 experts with E = 77, H = 2080, I = 224 and hidden states of inner stride 2 crashed the Triton
compiler, a shape and layout no hand-written case had (this test, with that fix undone, found it on an H200 within
a minute and shrank it to E = 1, H = 32, I = 64, one token). Per weight format (a test parameter: plain bf16, fp16
or fp32 weights; ``BlockFP8`` with bf16 or fp16 activations and fp32 scales or ue8m0 exponents through
``BlockFP8.from_checkpoint``; ``MXFP4`` with bf16 activations), each example of ``moe_experts`` draws:

- E in {1, 2, 3, 5, 7, 8, 77, 257, 300} (odd, and past 256), H and I of any width the format takes (MXFP4:
  multiples of 32), often a multiple of 128 or next to one, smaller when E is large;
- top-k in 1..min(E, 8), the tile height ``block_m`` in {16, 32, 64, 128} (the plan is ``moe_dispatch(ids, E,
  block_m)``), M: 0, 1, within 2 of a tile height, or anywhere up to the device's limit;
- routing uniform, skewed, or all on experts 0..K-1 (rows per expert on both sides of the tile heights), a fraction
  of -1 slots (none to all), int32 or int64 ids;
- hidden contiguous, row-padded ``randn(M, H + pad)[:, :H]``, of inner stride 2 ``randn(M, 2H)[:, ::2]`` or
  column-major; ``swiglu_limit`` None or in [0.1, 20]; ``out`` not given, or given contiguous, row-padded or of inner
  stride 2 and filled with NaN; ``activation_quant`` "default", None or "fp8" (MXFP4 with "fp8" is W4A8; on a GPU
  half the MXFP4 examples have H and I multiples of 128, which Hopper runs on Gluon kernels, and most W4A8 ones,
  on 128-row tiles; a combination refused, one time in seven); on Hopper, half the bf16, fp16 and fp8 examples run
  the persistent prefill GEMMs (``MOEFUSE_PERSISTENT=1``) at the widths and tile height they take;
- for BlockFP8, GEMM1's split along K (``experts_fp8``'s ``split_k``, which the op takes from
  ``fp8.kernels.default_split_k``): the default (1 under the interpreter, ``configs.fp8_split_k`` on a GPU) two
  times in five, else 2, 3 or 4 runs of steps, on any K, so runs can be short or empty;
- a workspace (``experts_workspace``) given or not, for every format: where given it must be left zeroed.

The plan must equal the reference dispatch's; the rows a plan computes (``n_valid = plan.expert_offsets[-1]``) are
compared in max and RMS relative error with the float64 oracle of the numerics that ran (plain and MXFP4 W4A16:
``moe_experts_torch``; BlockFP8: ``moe_experts_fp8_torch``; MXFP4 W4A8 on Hopper: ``moe_experts_w4a8_torch``), and
every element of ``out`` outside them (rows past n_valid, padding columns) must still be NaN. A combination the op
refuses (``activation_quant``) must raise a ValueError naming it.

The layer test draws small configs (E, K, groups, scoring, renormalize, scaling, bias, clamp, 0-2 shared experts),
``quant`` None, "fp8" or "mxfp4" (a test parameter) at widths each takes, the shared expert's format
(``shared_quant``: what ``quant`` implies, None or "fp8": every mix), on Hopper MXFP4 with ``activation_quant="fp8"``
(W4A8) half the time, the shared-slot limit, a batch of 0 to 12
tokens (300 on a GPU) in the same layouts (2-D or 3-D), ``num_token_non_padded`` or not, and compares
``MoELayer(...)(x)`` with ``moe_layer_torch`` in float64 (routing in fp32 for 16-bit layers, as
tests/test_layer_fp8.py and test_layer_mxfp4.py do, so a near-tie in fp32 logits cannot pick another expert).

Tolerances come from ``tests/tolerances.py`` (the largest errors ``scripts/error_table.py`` measured on an H200 per
format and tile path, with headroom); none is set here. fp16 results are measured against at least fp16's
smallest normal (``check_experts``): below it fp16 rounds to absolute steps. A sum whose terms cancel errs more,
relative to its result, than any fixed tolerance allows, so fp32 results (no rounding below fp32) may also err by
what their sums' conditioning predicts: the experts up to ``FP32_SPREADS`` times the RMS rounding error that
``moefuse.testing.fp32_spread`` predicts for each output, the layers up to ``SUM_ORDER`` times what the oracle
computed in fp32 errs on the same instance.

Budget (``EXAMPLES``, ``LAYER_EXAMPLES`` per parameter): on an H200 about 2 min 45 s from a cold Triton cache (163 s
measured); on one CPU core about 70 s (68-74 s measured, 2026-12-03; Triton's interpreter runs each kernel program in
Python, so CPU shapes are small). ``MOEFUSE_FUZZ_EXAMPLES=n`` runs n examples of each parameter instead. A failure
prints the drawn case (in the assertion message, and as hypothesis's falsifying example ``check_experts(c={...})``:
that call, pasted, runs it again; its ``seed`` makes the same tensors).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tolerances import FP32_SPREADS, experts_tolerance

from moefuse import MoEConfig, MoELayer, moe_layer_torch
from moefuse._runtime import defaults
from moefuse.config import SCORING_FUNCS
from moefuse.dispatch import moe_dispatch
from moefuse.experts import experts_workspace, moe_experts, pick_block_m
from moefuse.experts.fp8 import kernels as fp8_kernels
from moefuse.experts.mxfp4 import w4a8 as mxfp4_w4a8
from moefuse.experts.mxfp4 import w4a8_decode as mxfp4_w4a8_decode
from moefuse.experts.mxfp4 import ws as mxfp4_ws
from moefuse.experts.reference import moe_experts_fp8_torch, moe_experts_torch, moe_experts_w4a8_torch
from moefuse.formats import MXFP4, BlockFP8, tile_dtype, ue8m0_to_float
from moefuse.testing import fp32_spread, rel_error, rms_rel_error

GPU = torch.cuda.is_available()
HOPPER = GPU and torch.cuda.get_device_capability() == (9, 0)
DEVICE = torch.device("cuda" if GPU else "cpu")  # a module constant: hypothesis warns on function-scoped fixtures
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Shapes per device. Under the interpreter a kernel costs about its programs x K steps in Python (0.2-5 s an
# example here), and BlockFP8's quantizer reduces with a custom combine, element by element: about 10 s for one
# 128-row tile, so the CPU draws fp8 tiles of 16 and 32 rows only (the GPU draws every height).
if GPU:
    WIDTH, WIDTH_MANY = 3072, 2304  # largest H, I with E <= 8, and with more experts
    WEIGHTS = 40_000_000  # largest E·H·I (the shape that once crashed the compiler is 3.6e7)
    TOKENS, TOKENS_MANY = 700, 700  # M: several 128-row tiles
    ROWS, ROWS_FP8 = 700 * 8, 700 * 8  # M·K
    FP8_TILES = (16, 32, 64, 128)
    LAYER_WIDTH, LAYER_TOKENS = 1024, 300
    # 150 and 42 examples: 110 s and 50 s from a cold Triton cache
    EXAMPLES = {"bf16": 30, "fp16": 30, "fp32": 30, "fp8": 30, "mxfp4": 30}
    LAYER_EXAMPLES = {None: 14, "fp8": 14, "mxfp4": 14}
    EXPERTS = (1, 2, 3, 5, 7, 8, 77, 257, 300)
else:
    WIDTH, WIDTH_MANY = 160, 32
    WEIGHTS = 1 << 62
    TOKENS, TOKENS_MANY = 40, 6
    ROWS, ROWS_FP8 = 96, 32
    FP8_TILES = (16, 32)
    LAYER_WIDTH, LAYER_TOKENS = 96, 12
    # fewer where an example costs more (fp8 about 1.5 s, bf16 0.2 s); 113 and 19 examples: about 70 s
    EXAMPLES = {"bf16": 24, "fp16": 24, "fp32": 24, "fp8": 12, "mxfp4": 20}
    LAYER_EXAMPLES = {None: 9, "fp8": 4, "mxfp4": 6}
    EXPERTS = (1, 2, 3, 5, 7, 8) * 2 + (77, 257, 300)  # many experts one time in five, with tiny H and I
TILES = (16, 32, 64, 128)
W4A8_TILES = (*sorted(mxfp4_w4a8_decode.LAUNCH), mxfp4_w4a8.BLOCK_M)  # its decode kernels' and the 128-row ones'


def _fuzz(check: Callable[[dict], None], cases: st.SearchStrategy[dict], examples: int) -> None:
    """Run ``check`` on ``examples`` cases drawn from ``cases`` (a budget per test parameter, which a decorator
    cannot give). A failure prints ``check(c={...})``: that call, pasted, runs the case again."""
    env = os.environ.get("MOEFUSE_FUZZ_EXAMPLES")
    # No explain phase: it reruns a failing case many times over (minutes on the GPU), to say less than its message
    run = settings(max_examples=int(env) if env else examples, deadline=None, derandomize=False,
                   phases=[p for p in Phase if p != Phase.explain],
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.filter_too_much])(given(c=cases)(check))
    run()


# --- strategies ----------------------------------------------------------------------------------------------------

def _width(step: int, most: int, least: int = 1) -> st.SearchStrategy[int]:
    """A width in multiples of ``step`` within [``least``, ``most``] (at least one step): anywhere, a multiple of
    128 (whole K steps and column blocks: the widths of the Hopper-only MXFP4 kernels), or one step either side of
    one."""
    most = max(most, step)
    low = -(-least // step)
    options = [st.integers(low, max(low, most // step)).map(lambda n: n * step)]
    if most >= 128:
        options.append(st.integers(1, most // 128).map(lambda n: 128 * n))
        near = [w for n in range(1, most // 128 + 1) for w in (128 * n - step, 128 * n + step)
                if least <= w <= most and w % 128]
        if near:
            options.append(st.sampled_from(near))
    return st.one_of(options)


def _tokens(most: int) -> st.SearchStrategy[int]:
    """M: 0, 1, anywhere up to ``most``, or within 2 of a tile height."""
    edges = [t for t in TILES if t + 2 <= most]
    options = [st.integers(2, max(2, most))]
    if edges:
        options.append(st.sampled_from(edges).flatmap(lambda t: st.integers(t - 2, t + 2)))
    return st.one_of(*options, st.sampled_from((1, 1, 1, 0)))  # 0 rarely: it computes nothing


def _layout(draw: st.DrawFn, what: tuple[str, ...]) -> tuple[str, int]:
    layout = draw(st.sampled_from(what))
    return layout, draw(st.integers(1, 17)) if layout == "padded" else 0


@st.composite
def experts_cases(draw: st.DrawFn, fmt: str) -> dict:
    act = draw(st.sampled_from(("bf16", "fp16"))) if fmt == "fp8" else "bf16" if fmt == "mxfp4" else fmt
    scales = draw(st.sampled_from(("fp32", "ue8m0"))) if fmt == "fp8" else None
    # "default": the format's own (fp8 for BlockFP8, none otherwise); None: none; "fp8": e4m3 per 128 columns.
    # A combination refused (which costs nothing) one time in seven; W4A8 runs on GPUs only (Hopper's).
    takes, refused = {"fp8": (("default", "fp8"), (None,)),
                      "mxfp4": (("default", None, "fp8"), ()) if GPU else (("default", None), ("fp8",))}.get(
        fmt, (("default", None), ("fp8",)))
    aq = draw(st.sampled_from(takes * 3 + refused))
    # On Hopper, MXFP4 runs on Gluon kernels where H and I are multiples of 128 (W4A16 at every tile height, W4A8 on
    # W4A8_TILES): on a GPU, half the MXFP4 examples have such widths, most W4A8 ones (else the refusal)
    whole = GPU and fmt == "mxfp4" and draw(st.sampled_from((True, True, True, False)) if aq == "fp8" else
                                           st.booleans())
    w4a8 = whole and aq == "fp8"
    # On Hopper the persistent prefill GEMMs (MOEFUSE_PERSISTENT=1) take 16-bit and fp8 block-scale weights on
    # 128-row plans with H a multiple of 256 and I of 128: half of those formats' examples there run them
    persistent = HOPPER and fmt in ("bf16", "fp16", "fp8") and draw(st.booleans())
    E = draw(st.sampled_from(EXPERTS))
    many = E > 8
    step = 128 if whole or persistent else 32 if fmt == "mxfp4" else 1
    most = WIDTH_MANY if many else WIDTH
    if persistent:  # whole 256-column items of GEMM2
        H = draw(st.integers(1, max(1, min(most, WEIGHTS // (E * step)) // 256)).map(lambda n: 256 * n))
    else:
        H = draw(_width(step, min(most, WEIGHTS // (E * step))))
    I = draw(_width(step, min(most, WEIGHTS // (E * H))))
    block_m = (128 if persistent else draw(st.sampled_from(W4A8_TILES if w4a8 else FP8_TILES if fmt == "fp8"
                                                           else TILES)))
    M = draw(_tokens(TOKENS_MANY if many else TOKENS))
    rows = ROWS_FP8 if fmt == "fp8" else ROWS
    K = draw(st.integers(1, max(1, min(E, 8, rows // max(M, 1)))))
    hidden, hidden_pad = _layout(draw, ("contiguous", "padded", "strided", "column-major"))
    out, out_pad = _layout(draw, ("none", "contiguous", "padded", "strided"))
    return dict(
        fmt=fmt, act=act, scales=scales, E=E, H=H, I=I, K=K, M=M, block_m=block_m,
        # 0: uniform; 0.05: popular experts; 10: every token on experts 0..K-1 (M rows each)
        skew=draw(st.sampled_from((0.0, 0.05, 10.0))),
        invalid=draw(st.sampled_from((0.0, 0.0, 0.0, 0.1, 0.1, 0.1, 0.5, 1.0))),  # of -1 slots; all, rarely
        ids=draw(st.sampled_from(("int32", "int64"))),
        hidden=hidden, hidden_pad=hidden_pad, out=out, out_pad=out_pad,
        limit=draw(st.one_of(st.none(), st.floats(0.1, 20.0))),
        activation_quant=aq, persistent=persistent,
        # GEMM1 split along K in 2-4 runs, or into gate and up halves (where I allows: whole 128-column blocks)
        split_k=draw(st.sampled_from((None, None, 2, 3, 4, "halves"))) if fmt == "fp8" else None,
        workspace=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


# --- inputs --------------------------------------------------------------------------------------------------------

def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEVICE)


def _hidden(gen: torch.Generator, M: int, H: int, dtype: torch.dtype, layout: str, pad: int) -> torch.Tensor:
    if layout == "padded":
        return _randn(gen, M, H + pad).to(dtype)[:, :H]
    if layout == "strided":  # the layout that once crashed the compiler
        return _randn(gen, M, 2 * H).to(dtype)[:, ::2]
    if layout == "column-major":
        return _randn(gen, H, M).to(dtype).t()
    return _randn(gen, M, H).to(dtype)


def _out(rows: int, H: int, dtype: torch.dtype, layout: str, pad: int) -> torch.Tensor:
    """NaN-filled storage for ``out`` in ``layout`` (:func:`_view` is ``out``)."""
    width = {"padded": H + pad, "strided": 2 * H}.get(layout, H)
    return torch.full((rows, width), float("nan"), dtype=dtype, device=DEVICE)


def _view(storage: torch.Tensor, H: int, layout: str) -> torch.Tensor:
    return storage[:, ::2] if layout == "strided" else storage[:, :H]


def _fp8(w: torch.Tensor, ue8m0: bool) -> BlockFP8:
    """Block-quantized ``w``; with ``ue8m0``, against power-of-two scales given as uint8 exponents (DeepSeek-V3.1)."""
    q = BlockFP8.quantize(w)
    if not ue8m0:
        return q
    exps = (torch.log2(q.scales).ceil() + 127).to(torch.uint8)
    N, K = w.shape[1:]
    blocks = ue8m0_to_float(exps).repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :N, :K]
    return BlockFP8.from_checkpoint((w / blocks).clamp(-448, 448).to(torch.float8_e4m3fn), exps)


def _weights(gen: torch.Generator, c: dict) -> tuple:
    E, H, I = c["E"], c["H"], c["I"]
    w1 = _randn(gen, E, 2 * I, H) * (2 / math.sqrt(H))  # gate and up ~ N(0, 4): the clamp bites
    w2 = _randn(gen, E, H, I) / math.sqrt(I)
    if c["fmt"] == "fp8":
        return _fp8(w1, c["scales"] == "ue8m0"), _fp8(w2, c["scales"] == "ue8m0")
    if c["fmt"] == "mxfp4":
        return MXFP4.quantize(w1), MXFP4.quantize(w2)
    return w1.to(DTYPES[c["fmt"]]), w2.to(DTYPES[c["fmt"]])


def _ids(gen: torch.Generator, c: dict) -> torch.Tensor:
    """Top-K distinct experts per token by random keys, tilted towards low ids by ``skew``; some slots -1."""
    M, E, K = c["M"], c["E"], c["K"]
    keys = torch.rand(M, E, generator=gen, device=DEVICE) - c["skew"] * torch.arange(E, device=DEVICE)
    ids = keys.argsort(dim=1, descending=True)[:, :K]
    ids = torch.where(torch.rand(M, K, generator=gen, device=DEVICE) < c["invalid"], -1, ids)
    return ids.to(torch.int32 if c["ids"] == "int32" else torch.int64)


def _refused(c: dict, x: torch.Tensor, w1: object, w2: object, plan: object) -> bool:
    """Whether ``activation_quant`` asks for numerics the op has no kernels for here: fp8 activations on plain
    weights, none on BlockFP8 (W8A8 only), W4A8 off Hopper's Gluon kernels (``ws_eligible``: sm_90, compiled, H and
    I multiples of 128) or on tiles of a height it has no kernels of (``W4A8_TILES``)."""
    aq = c["activation_quant"]
    if aq == "fp8":
        if c["fmt"] == "mxfp4":
            return not (mxfp4_ws.ws_eligible(x, w1, w2, plan) and c["block_m"] in W4A8_TILES)
        return c["fmt"] != "fp8"
    return aq is None and c["fmt"] == "fp8"


def _oracle(c: dict) -> tuple:
    """(float64 reference of the numerics that run, tolerance key)."""
    if c["fmt"] == "fp8":
        return moe_experts_fp8_torch, "fp8"
    if c["fmt"] == "mxfp4" and c["activation_quant"] == "fp8":
        return moe_experts_w4a8_torch, "w4a8"
    return moe_experts_torch, c["fmt"]  # plain, and MXFP4 W4A16 (exact weights): the same oracle


# fp32 numerics (no rounding below fp32 anywhere) err by one rounding of the terms a sum adds, so a sum of a few
# terms that cancel errs far more, relative to the result, than the sums of H = 7,168 random terms the tolerance was
# measured on. Found by 300 examples a parameter (MOEFUSE_FUZZ_EXAMPLES=300, interpreter): E = 300, H = 1, I = 13
# summed 13 terms of 6.9 in magnitude to -0.0155 and a correct kernel erred 2.0e-5 of the largest output (seed
# 1128); a layer of H = 91, I = 1 erred 1.5e-5, its gate a cancelled sum (seed 881). Each was 2.2 and 1.2 times
# what the same oracle in fp32 errs on the instance (its sums in another order). So a layer's fp32 result may also
# err up to SUM_ORDER times that. Measured on the interpreter over examples drawn as these tests draw them (two
# draws each), a layer's error over the fp32 oracle's was 1.0 at the median and 2.9 at most (160 examples).
#
# That allowance is itself a rounding error, small by chance now and then: on an H100 (2026-12-07) the GPU's
# sequential fp32 sums erred 1.06e-5 of the one output of E = 1, H = 1, I = 1,919 (1,919 terms that cancel), more
# than 8 times what torch's fp32 oracle erred there. So the experts' fp32 outputs may instead err up to FP32_SPREADS
# times the RMS rounding error that ``moefuse.testing.fp32_spread`` predicts for the instance (tests/tolerances.py).
# The layers keep SUM_ORDER: their outputs are at least 32 wide, so the oracle's largest error over them is not small
# by chance the way one output's can be.
SUM_ORDER = 8


def _within_spread(got: torch.Tensor, ref: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """``got`` with each output within FP32_SPREADS predicted RMS rounding errors of ``ref`` replaced by ``ref``'s
    value: those count as exact, the rest are measured as any result is."""
    return torch.where((got.double() - ref).abs() <= FP32_SPREADS * spread, ref.to(got.dtype), got)


def test_fp32_allowance_still_fails_a_rounding_below_fp32():
    """The allowance for cancelling sums must not pass an intermediate rounded to fp16 (the oracle rounds it to
    hidden's dtype) on a shape of many terms, nor an output off by 1e-4 of its scale."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    c = dict(E=4, H=256, I=192, M=6, K=2, skew=0.0, invalid=0.0, ids="int32", fmt="fp32")
    w1, w2 = _weights(gen, c)
    x = _randn(gen, c["M"], c["H"]).half().float()  # fp16 values: below, only the intermediate rounds to fp16
    plan = moe_dispatch(_ids(gen, c), c["E"], 16, backend="reference")
    ref = moe_experts_torch(x.double(), w1, w2, plan, dtype=torch.float64)
    spread = fp32_spread(x, w1, w2, plan)
    half = moe_experts_torch(x.half(), w1, w2, plan, dtype=torch.float64).float()  # fp16 intermediate
    assert rel_error(_within_spread(half, ref, spread), ref) > 1e-5
    off = (ref * (1 + 1e-4)).float()
    assert rel_error(_within_spread(off, ref, spread), ref) > 1e-5
    fp32 = moe_experts_torch(x, w1, w2, plan, dtype=torch.float32)  # fp32 sums in torch's order: within it
    assert rel_error(_within_spread(fp32, ref, spread), ref) < 2**-24  # ref's own rounding to fp32


def _sum_order_floors(ref: torch.Tensor, ref32: torch.Tensor, tol: float, rms_tol: float) -> tuple[float, float]:
    """The ``floor`` arguments of ``rel_error`` and ``rms_rel_error`` that let an fp32 result err up to
    ``SUM_ORDER`` times as much as ``ref32`` (the oracle in fp32) errs from ``ref`` (float64), in max and RMS."""
    diff = (ref32.double() - ref).abs()
    return (SUM_ORDER * diff.max().item() / tol if diff.numel() else 0.0,
            SUM_ORDER * diff.norm().item() / (rms_tol * max(diff.numel(), 1) ** 0.5))


# --- the experts op ------------------------------------------------------------------------------------------------

# The format is a parameter, not a draw: each gets its own examples (hypothesis's choices are far from uniform)
@pytest.mark.parametrize("fmt", list(EXAMPLES))
def test_experts_match_float64(fmt):
    _fuzz(check_experts, experts_cases(fmt), EXAMPLES[fmt])


def check_experts(c: dict) -> None:
    """One example: dispatch (against the reference's plan), the experts on the Triton backend, the oracle."""
    gen = torch.Generator(DEVICE).manual_seed(c["seed"])
    M, H, K, E, block_m = c["M"], c["H"], c["K"], c["E"], c["block_m"]
    dtype = DTYPES[c["act"]]
    w1, w2 = _weights(gen, c)
    x = _hidden(gen, M, H, dtype, c["hidden"], c["hidden_pad"])
    ids = _ids(gen, c)
    plan = moe_dispatch(ids, E, block_m, backend="triton")
    want = moe_dispatch(ids, E, block_m, backend="reference")
    for name in ("expert_offsets", "permuted_to_expanded", "expanded_to_permuted", "tile_expert", "tile_row_start"):
        assert torch.equal(getattr(plan, name), getattr(want, name)), f"{c}: plan.{name} differs from the reference"
    workspace = experts_workspace(DEVICE) if c.get("workspace") else None
    kwargs = dict(swiglu_limit=c["limit"], activation_quant=c["activation_quant"], backend="triton",
                  workspace=workspace)
    if _refused(c, x, w1, w2, plan):
        with pytest.raises(ValueError, match="activation_quant"):
            moe_experts(x, w1, w2, plan, **kwargs)
        return
    storage = None if c["out"] == "none" else _out(M * K, H, dtype, c["out"], c["out_pad"])
    out = None if storage is None else _view(storage, H, c["out"])
    split = c.get("split_k")  # the op has no split_k argument: its defaults are replaced for the call
    splitting = contextlib.ExitStack()
    if split == "halves":  # the rule's own condition on I, as on a GPU where the grid leaves SMs idle
        splitting.enter_context(
            mock.patch.object(fp8_kernels, "default_halves", lambda _, width, *__: width % 128 == 0))
    elif split:
        splitting.enter_context(mock.patch.object(fp8_kernels, "default_split_k", lambda *_: split))
    with defaults(persistent="all" if c.get("persistent") else "none"), splitting:
        got = moe_experts(x, w1, w2, plan, out=out, **kwargs)
    assert got.shape == (M * K, H) and got.dtype == dtype and got.device == x.device, c
    assert out is None or got is out, c
    assert workspace is None or not workspace.any(), f"{c}: the workspace was not left zeroed"
    oracle, key = _oracle(c)
    ref = oracle(x, w1, w2, plan, swiglu_limit=c["limit"], dtype=torch.float64,
                 out=torch.zeros(M * K, H, dtype=torch.float64, device=DEVICE))
    n_valid = int(plan.expert_offsets[-1])
    # fp16 below its smallest normal rounds to steps of 2^-24 (up to 2^-25 off): relative to a tiny output that is
    # more than any relative tolerance (H = I = 1 with one output of 3.0e-6 erred 1.96e-3, over fp16's 1e-3 RMS), so
    # fp16 is measured against at least its smallest normal (2^-11 at most), where an O(1) error still fails
    floor = torch.finfo(dtype).tiny if dtype == torch.float16 else 0.0
    tol, rms_tol = experts_tolerance(key, block_m, n_valid)
    got, ref = got[:n_valid], ref[:n_valid]
    if key == "fp32":
        got = _within_spread(got, ref, fp32_spread(x, w1, w2, plan, c["limit"])[:n_valid])
    err = rel_error(got, ref, floor)
    rms = rms_rel_error(got, ref, floor)
    assert err <= tol and rms <= rms_tol, (f"{c}: {key} on {block_m}-row tiles, {n_valid} rows: relative error "
                                           f"{err:.3e} (max {tol:.0e}), RMS {rms:.3e} (max {rms_tol:.0e})")
    if storage is not None:  # nothing but the n_valid rows of the view may be written
        written = torch.zeros_like(storage, dtype=torch.bool)
        _view(written, H, c["out"])[:n_valid] = True
        assert storage[~written].isnan().all(), f"{c}: wrote outside the {n_valid} rows the plan computes"


# --- the layer -----------------------------------------------------------------------------------------------------

@st.composite
def layer_cases(draw: st.DrawFn, quant: str | None) -> dict:
    shared = draw(st.integers(0, 2 if quant is None else 1))
    # The shared expert's own format (any mix of routed and shared formats): what quant implies, or either
    shared_quant = draw(st.sampled_from(("default", None, "fp8"))) if shared else "default"
    fp8_shared = shared and (shared_quant == "fp8" or (shared_quant == "default" and quant is not None))
    dtype = {None: ("bf16", "fp16", "fp32"), "fp8": ("bf16", "fp16"), "mxfp4": ("bf16",)}[quant]
    if fp8_shared:
        dtype = tuple(d for d in dtype if d != "fp32")
    # W4A8 (MXFP4 with fp8 activations) runs on Hopper's Gluon kernels only, at widths of 128s
    w4a8 = quant == "mxfp4" and HOPPER and draw(st.booleans())
    step = 128 if w4a8 else 32 if quant == "mxfp4" else 1
    # H >= 32: the output sums K + 1 rows rounded each (and the shared expert's), so with one or two columns a
    # token's sum can cancel to far below its terms' size, which no relative tolerance over so few values survives
    H = draw(_width(step, LAYER_WIDTH, least=32))
    # an fp8 shared expert keeps its gate and up blocks apart: I a multiple of 128
    I = draw(_width(128, LAYER_WIDTH) if fp8_shared else _width(step, LAYER_WIDTH))
    E = draw(st.sampled_from((1, 2, 3, 5, 8, 16, 77, 257) if GPU else (1, 2, 3, 5, 8)))
    M = draw(_tokens(LAYER_TOKENS))
    K = draw(st.integers(1, max(1, min(E, 8, (ROWS_FP8 if quant == "fp8" else ROWS) // max(M, 1)))))
    groups = draw(st.sampled_from([g for g in range(1, 9) if E % g == 0]))
    per_group = E // groups
    scoring = draw(st.sampled_from(SCORING_FUNCS))
    hidden, pad = _layout(draw, ("contiguous", "padded", "strided", "column-major"))
    return dict(
        quant=quant, shared_quant=shared_quant, activation_quant="fp8" if w4a8 else "default",
        dtype=draw(st.sampled_from(dtype)), H=H, I=I, E=E, K=K, shared=shared,
        groups=groups, topk_group=draw(st.integers(-(-K // per_group), groups)), scoring=scoring,
        softcap=draw(st.sampled_from((0.0, 30.0))) if scoring == "softmax" else 0.0,
        renormalize=draw(st.booleans()), scaling=draw(st.sampled_from((1.0, 2.5))), bias=draw(st.booleans()),
        limit=draw(st.one_of(st.none(), st.floats(0.1, 20.0))),
        slot=draw(st.sampled_from((None, 0, 1 << 20))),  # shared_slot_max_tokens: the table's, never, always
        invariant=draw(st.booleans()),  # batch_invariant: then a row alone is checked for the same bits too
        M=M, batch=draw(st.sampled_from((1, 2))) if M % 2 == 0 else 1,
        hidden=hidden, hidden_pad=pad,
        non_padded=draw(st.one_of(st.none(), st.integers(0, M).map(lambda n: M - n))),  # hypothesis favours 0
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _layer_formats(c: dict, layer: MoELayer) -> list[str]:
    """The tolerance keys of the routed experts' numerics and the shared expert's."""
    routed = "w4a8" if layer.activation_quant == "fp8" and c["quant"] == "mxfp4" else c["quant"] or c["dtype"]
    return [routed, "fp8" if layer.shared_quant == "fp8" else c["dtype"]]


def _layer_tolerance(c: dict, layer: MoELayer) -> float:
    """The largest (max relative) tolerance of any tile height the layer's grouped GEMMs pick: the routed experts
    with or without the shared slot, and the shared expert as a one-expert GEMM. Max only, as tests/test_layer*.py
    compare: an RMS over the few values of a small batch says little."""
    M, H, I, E, K = c["M"], c["H"], c["I"], c["E"], c["K"]
    weight = layer.experts.weights()[0]
    fmts = _layer_formats(c, layer)
    routed = fmts[0]
    heights = {pick_block_m(M, E + s, H, I, K + s, tile_dtype(weight, DTYPES[c["dtype"]])) for s in (0, 1)}
    heights |= {128} if routed == "w4a8" else set()
    # batch-invariant 16-bit and fp8 experts sum on wgmma at every height (fp8 swapped below 64 rows)
    heights |= {32 if routed == "fp32" else 64} if c["invariant"] and routed not in ("mxfp4", "w4a8") else set()
    heights.add(pick_block_m(M, 1, H, I * max(c["shared"], 1), 1, torch.float8_e4m3fn if layer.shared_quant else
                             DTYPES[c["dtype"]]))
    return max(experts_tolerance(f, h)[0] for f in fmts for h in heights)


@pytest.mark.parametrize("quant", list(LAYER_EXAMPLES), ids=["plain", "fp8", "mxfp4"])
def test_layer_matches_float64(quant):
    _fuzz(check_layer, layer_cases(quant), LAYER_EXAMPLES[quant])


def check_layer(c: dict) -> None:
    """One example: the layer on the Triton backend against ``moe_layer_torch``."""
    config = MoEConfig(c["H"], c["I"], c["E"], c["K"], num_shared_experts=c["shared"], num_expert_group=c["groups"],
                       topk_group=c["topk_group"], routed_scaling_factor=c["scaling"], scoring_func=c["scoring"],
                       renormalize=c["renormalize"], expert_bias=c["bias"], swiglu_limit=c["limit"],
                       moe_softcapping=c["softcap"])
    dtype = DTYPES[c["dtype"]]
    layer = MoELayer(config, dtype=dtype, device=DEVICE, backend="triton", quant=c["quant"],
                     shared_quant=c["shared_quant"], activation_quant=c["activation_quant"],
                     shared_slot_max_tokens=c["slot"], batch_invariant=c["invariant"],
                     ).init_random_(c["seed"], std=1 / math.sqrt(c["H"]))
    gen = torch.Generator(DEVICE).manual_seed(c["seed"])
    M, H = c["M"], c["H"]
    x = _hidden(gen, M, H, dtype, c["hidden"], c["hidden_pad"]).reshape(c["batch"], M // c["batch"], H)
    x = x[0] if c["batch"] == 1 else x  # [M, H], or [2, M/2, H] (a view even when strided)
    with torch.no_grad():
        got = layer(x, num_token_non_padded=c["non_padded"])
    assert got.shape == x.shape and got.dtype == dtype and got.device == x.device, c
    # 16-bit layers route in fp32 (their router does): float64 routing could break a near-tie the other way
    route = None if dtype == torch.float32 else torch.float32
    want = moe_layer_torch(layer, x, c["non_padded"], route_dtype=route)
    tol, floor = _layer_tolerance(c, layer), 0.0
    if _layer_formats(c, layer) == ["fp32", "fp32"]:  # routed as ``want`` is, so that only the sums' order differs
        want32 = moe_layer_torch(layer, x, c["non_padded"], dtype=torch.float32, route_dtype=torch.float64)
        floor = _sum_order_floors(want, want32, tol, tol)[0]
    err = rel_error(got, want, floor)
    assert err <= tol, f"{c}: relative error {err:.3e} (max {tol:.0e})"
    if c["invariant"] and M and (c["non_padded"] is None or c["non_padded"] > 0):  # the first token, alone
        with torch.no_grad():
            alone = layer(x.reshape(M, H)[:1])
        assert torch.equal(alone[0], got.reshape(M, H)[0]), f"{c}: a token alone is not the bits it gets in its batch"
