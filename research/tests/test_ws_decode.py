"""``research/ws_decode.py`` (the warp-specialized fp8 decode candidate, Gluon for sm_90): its item table is
``fused_decode``'s order, its runs are the op's split, its arguments are checked before any launch; and on an
sm_90 GPU its output is within the wgmma tiles' fp8 tolerance of the float64 spec emulation, with no row written
past the plan and no wait given up, over shapes that make its programs wait, wrap their rings and split unevenly.

The interpreter cannot run Gluon, so on the CPU only the host side runs here; ``tests/test_sm90.py`` compiles the
kernel for sm_90 (``research/sass_decode.py``, run by ``test_sm90_decode.py``).
"""
import pytest
import torch
import triton
import triton.language as tl

from moefuse import _runtime
from moefuse.experts.fp8.kernels import _split_range
from moefuse.experts.reference import moe_experts_fp8_torch
from moefuse.testing import assert_rel_close, rel_error, rms_rel_error
from research import ws_decode as ws
from research.tests.cases import DEVICE, fp8_case, fp8_tolerance, fused_order

ON_SM90 = DEVICE.type == "cuda" and _runtime.capability(DEVICE) == (9, 0)


def _case(E, H, I, M, K, gen, dtype=torch.bfloat16, dropped=0, block_m=16):
    """As ``fp8_case``, on ``block_m``-row tiles: the kernel takes 16, and a caller building a plan for it asks for
    them, whatever ``plan_block_m`` would pick for the op."""
    return fp8_case(E, H, I, M, K, gen, dtype, dropped, block_m)


def _table(plan, H, I, split, lag):
    runs, _ = ws.runs_of(H, split)
    return ws.item_table(plan.tile_expert.numel(), lag, (I // 128) * runs, H // 128, DEVICE)


@pytest.mark.parametrize("num_tiles,g1n,g2n", [(1, 3, 2), (9, 32, 56), (40, 224, 56)])
@pytest.mark.parametrize("lag", [0, 1, 3, 100])
def test_item_table_is_the_fused_order(num_tiles, g1n, g2n, lag):
    """Each entry decodes (as the kernel's ``_decode`` does) to ``fused_decode._item_at``'s item at that place,
    whose order ``tests/test_fused_decode.py`` checks: every item once, a tile's GEMM1 items before its GEMM2."""
    gemm1, tile, sub = fused_order(num_tiles, lag, g1n, g2n)
    table = ws.item_table(num_tiles, lag, g1n, g2n, DEVICE)
    assert table.dtype == torch.int32 and table.numel() == num_tiles * (g1n + g2n)
    assert torch.equal(table & 1, gemm1)
    assert torch.equal((table >> 1) & 0x7FFF, tile)
    assert torch.equal(table >> 16, sub)


def test_item_table_refuses_what_does_not_pack():
    with pytest.raises(ValueError, match="15 bits"):
        ws.item_table(1 << 15, 0, 1, 1, DEVICE)
    with pytest.raises(ValueError, match="15 bits"):
        ws.item_table(1, 0, 1 << 15, 1, DEVICE)


@triton.jit
def _range_kernel(out_ptr, K, SPLIT: tl.constexpr):
    run = tl.program_id(0)
    k_begin, k_end = _split_range(K, run, 128, SPLIT)
    tl.store(out_ptr + 2 * run, k_begin)
    tl.store(out_ptr + 2 * run + 1, k_end)


@pytest.mark.parametrize("H", [128, 384, 640, 2048, 7168])
@pytest.mark.parametrize("split", [1, 2, 3, 4, 7, 14, 100])
def test_runs_are_the_op_split_without_its_empty_runs(H, split):
    """``runs_of``: the runs of ``fp8.kernels._split_range`` (the op's GEMM1 split) that hold a step, in order."""
    bounds = torch.empty(2 * split, dtype=torch.int32, device=DEVICE)
    _range_kernel[(split,)](bounds, H, SPLIT=split)
    op_runs = [(b, e) for b, e in zip(bounds[0::2].tolist(), bounds[1::2].tolist()) if e > b]
    runs, per = ws.runs_of(H, split)
    assert [(r * per * 128, min((r + 1) * per, H // 128) * 128) for r in range(runs)] == op_runs


BAD = [
    ({"split": 0}, ValueError, "split"),
    ({"programs": 0}, ValueError, "programs"),
    ({"stages": 0}, ValueError, "stages"),
    ({"maxnreg": 0}, ValueError, "maxnreg"),
    ({"table": "short"}, ValueError, "table"),
    ({"out_dtype": torch.float32}, TypeError, "out"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD)
def test_bad_arguments_raise_before_launch(kwargs, error, message, gen):
    x, w1, w2, plan = _case(2, 256, 128, 1, 1, gen)
    out = torch.empty(plan.num_rows, 256, dtype=kwargs.pop("out_dtype", torch.bfloat16), device=DEVICE)
    args = {"split": 2, "programs": 1, **kwargs}
    table = _table(plan, 256, 128, 2, 1)
    if args.pop("table", None) == "short":
        table = table[:-1]
    with pytest.raises(error, match=message):
        ws.ws_experts_fp8(x, w1, w2, plan, out, table, **args)


def test_widths_and_tiles_it_cannot_take_are_refused(gen):
    x, w1, w2, plan = _case(2, 160, 128, 1, 1, gen)
    with pytest.raises(ValueError, match="multiples of 128"):
        ws.ws_experts_fp8(x, w1, w2, plan, torch.empty(plan.num_rows, 160, device=DEVICE), plan.tile_expert,
                          split=1, programs=1)
    x, w1, w2, plan = _case(2, 128, 128, 1, 1, gen, block_m=64)
    with pytest.raises(ValueError, match="block_m"):
        ws.ws_experts_fp8(x, w1, w2, plan, torch.empty(plan.num_rows, 128, dtype=torch.bfloat16, device=DEVICE),
                          plan.tile_expert, split=1, programs=1)


@pytest.mark.skipif(ON_SM90, reason="runs where the kernel cannot")
def test_off_sm90_it_says_so_before_any_launch(gen):
    x, w1, w2, plan = _case(2, 256, 128, 1, 1, gen)
    out = torch.empty(plan.num_rows, 256, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="sm_90"):
        ws.ws_experts_fp8(x, w1, w2, plan, out, _table(plan, 256, 128, 2, 1), split=2, programs=1)


# (E, H, I, M, K, split, lag, programs, stages, dtype, -1 slots, clamp): one token and a few; runs uneven or empty
# (H = 384: 3 steps in 2 or 4 runs); GEMM2 after each tile, a few tiles later or after all of GEMM1; one program
# (every item in turn, every GEMM2 wait against its own earlier items) and more programs than items; rings of 2
# slots (wrapping every step) and 8; fp16; the clamp
CASES = [
    (4, 256, 256, 1, 2, 2, 1, 3, 4, torch.bfloat16, 0, None),
    (6, 384, 128, 1, 3, 4, 0, 2, 2, torch.bfloat16, 0, 7.0),
    (5, 384, 256, 3, 2, 2, 2, 4, 8, torch.float16, 1, None),
    (3, 128, 128, 2, 3, 1, 10, 1, 2, torch.bfloat16, 2, None),
    (8, 512, 384, 4, 4, 3, 1, 64, 4, torch.bfloat16, 0, None),
    (16, 1024, 256, 1, 8, 7, 1, 12, 6, torch.bfloat16, 0, None),
    (16, 1024, 256, 2, 8, 7, 1, 12, 6, torch.bfloat16, 1, 5.0),
]


@pytest.mark.skipif(not ON_SM90, reason="Gluon for sm_90: the interpreter cannot run it")
@pytest.mark.parametrize("E,H,I,M,K,split,lag,programs,stages,dtype,dropped,limit", CASES)
def test_within_the_wgmma_tolerance_of_the_spec(E, H, I, M, K, split, lag, programs, stages, dtype, dropped, limit,
                                               gen):
    """GEMM1 on wgmma sums fp8 products as the 64-row tiles do, so the output is held to their tolerance
    (``fp8_tolerance(64)``, measured in results/errors.md); rows past the plan keep their NaN."""
    x, w1, w2, plan = _case(E, H, I, M, K, gen, dtype, dropped)
    n = int(plan.expert_offsets[-1])
    got = torch.full((plan.num_rows, H), float("nan"), dtype=dtype, device=DEVICE)
    gave_up = ws.ws_experts_fp8(x, w1, w2, plan, got, _table(plan, H, I, split, lag), split=split,
                                programs=programs, stages=stages, swiglu_limit=limit)
    assert int(gave_up) == 0, "a wait gave up: the items' order or counts are wrong"
    assert got[n:].isnan().all(), "a row past the plan's valid ones was written"
    ref = moe_experts_fp8_torch(x, w1, w2, plan, swiglu_limit=limit, dtype=torch.float64,
                                out=torch.zeros(plan.num_rows, H, dtype=torch.float64, device=DEVICE))[:n]
    max_err, rms_err = fp8_tolerance(64, n)
    assert rel_error(got[:n], ref) < max_err and rms_rel_error(got[:n], ref) < rms_err


@pytest.mark.skipif(not ON_SM90, reason="Gluon for sm_90: the interpreter cannot run it")
def test_repeated_launches_give_the_same_bits(gen):
    """The split's last arriver adds the runs in run order, so the bits do not depend on which program arrives
    last, nor on which program takes which item: many launches on many programs, one output."""
    x, w1, w2, plan = _case(16, 1024, 256, 1, 8, gen)
    table = _table(plan, 1024, 256, 8, 1)
    outs = []
    for programs in (1, 5, 132, 264):
        out = torch.empty(plan.num_rows, 1024, dtype=torch.bfloat16, device=DEVICE)
        assert int(ws.ws_experts_fp8(x, w1, w2, plan, out, table, split=8, programs=programs)) == 0
        outs.append(out[: int(plan.expert_offsets[-1])])
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.skipif(not ON_SM90, reason="Gluon for sm_90: the interpreter cannot run it")
def test_nan_stays_in_its_token_and_strided_rows(gen):
    """A NaN in one token's hidden state makes that token's rows NaN (SPEC §5), through the split's last arriver and
    the clamp, and only those; ``hidden`` is a column slice of a wider tensor (its row stride is not H)."""
    x, w1, w2, plan = _case(6, 384, 256, 3, 2, gen, dropped=1)
    wide = torch.randn(3, 2 * 384, generator=gen).to(DEVICE, torch.bfloat16)
    wide[:, 128:512] = x
    x = wide[:, 128:512]
    x[1, 200] = float("nan")
    n = int(plan.expert_offsets[-1])
    got = torch.full((plan.num_rows, 384), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    gave_up = ws.ws_experts_fp8(x, w1, w2, plan, got, _table(plan, 384, 256, 2, 1), split=2, programs=5,
                                stages=3, swiglu_limit=1.5)
    assert int(gave_up) == 0, "a wait gave up: the items' order or counts are wrong"
    ref = moe_experts_fp8_torch(x, w1, w2, plan, swiglu_limit=1.5, dtype=torch.float64,
                                out=torch.zeros(plan.num_rows, 384, dtype=torch.float64, device=DEVICE))[:n]
    finite = ref.isfinite().all(dim=1)
    max_err, rms_err = fp8_tolerance(64, int(finite.sum()))
    assert_rel_close(got[:n], ref, max_err, "ws decode")
    assert not finite.all() and rms_rel_error(got[:n][finite], ref[finite]) < rms_err
    assert got[n:].isnan().all()
