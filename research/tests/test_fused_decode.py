"""``research/fused_decode.py`` (a candidate for fp8 decode: both fp8 GEMMs in one persistent launch): the same
bits as ``experts_fp8`` split the same way, within the fp8 tolerance of the float64 spec emulation, and its
arguments checked before any launch.

Under the interpreter the programs run one after another, so the first takes every item in order and no GEMM2 item
ever waits; on a GPU they run at once, the waits and the split's last arriver happen for real, and the same
comparison holds (the bits do not depend on which program arrives last). A wait that never ends gives up after
about 0.3 s and says so (the launcher's return value), so a wrong order fails here instead of hanging the GPU.
"""
import dataclasses

import pytest
import torch

from moefuse.experts import configs
from moefuse.experts.fp8.kernels import experts_fp8
from moefuse.experts.reference import moe_experts_fp8_torch
from moefuse.formats import tile_dtype
from moefuse.testing import rel_error, rms_rel_error
from research import fused_decode as fused
from research.tests.cases import DEVICE, fp8_tolerance, fused_order
from research.tests.cases import fp8_case as _case

# (E, H, I, M, K, split, lag, block_n2, programs, dtype, -1 slots, clamp, prequant): one token and a few; splits
# whose runs are uneven or empty (H = 384: 3 steps in 2 or 4 runs); GEMM2 after each tile or after all of GEMM1;
# fp16; the activations quantized in GEMM1's loop or by items of their own (prequant)
CASES = [
    (4, 256, 256, 1, 2, 2, 1, 128, 3, torch.bfloat16, 0, None, False),
    (4, 256, 256, 1, 2, 2, 1, 128, 3, torch.bfloat16, 0, None, True),
    (6, 384, 128, 1, 3, 4, 0, 64, 2, torch.bfloat16, 0, 7.0, True),
    (5, 384, 256, 3, 2, 2, 2, 128, 4, torch.float16, 1, None, False),
    (3, 128, 128, 2, 3, 1, 10, 64, 1, torch.bfloat16, 2, None, True),
]


# the next item's lines prefetched (inline PTX): compiled kernels only
PREFETCH = [False, pytest.param(True, marks=pytest.mark.skipif(DEVICE.type != "cuda", reason="inline PTX"))]


@pytest.mark.parametrize("prefetch", PREFETCH, ids=["", "prefetch"])
@pytest.mark.parametrize("E,H,I,M,K,split,lag,block_n2,programs,dtype,dropped,limit,prequant", CASES)
def test_same_bits_as_the_split_op(E, H, I, M, K, split, lag, block_n2, programs, dtype, dropped, limit, prequant,
                                   prefetch, gen):
    x, w1, w2, plan = _case(E, H, I, M, K, gen, dtype, dropped)
    n = int(plan.expert_offsets[-1])
    tiles = configs.pick(M, E, H, I, K, tile_dtype(w1, dtype), block_m=plan.block_m)
    # the op's tile width, and its steps one box deep (so its split's runs are the fused kernel's): the same sums
    gemm1 = dataclasses.replace(tiles.gemm1, block_k=128)
    gemm2 = dataclasses.replace(tiles.gemm2, block_n=block_n2)
    want = torch.full((plan.num_rows, H), float("nan"), dtype=dtype, device=DEVICE)
    experts_fp8(x, w1, w2, plan, want, gemm1, gemm2, limit, split_k=split)
    got = torch.full_like(want, float("nan"))
    gave_up = fused.fused_experts_fp8(x, w1, w2, plan, got, split=split, lag=lag, programs=programs,
                                      block_n2=block_n2, prequant=prequant, prefetch=prefetch, swiglu_limit=limit)
    assert int(gave_up) == 0, "a wait gave up: the items' order or counts are wrong"
    assert torch.equal(got[:n], want[:n])
    assert got[n:].isnan().all(), "a row past the plan's valid ones was written"
    ref = moe_experts_fp8_torch(x, w1, w2, plan, swiglu_limit=limit, dtype=torch.float64,
                                out=torch.zeros(plan.num_rows, H, dtype=torch.float64, device=DEVICE))[:n]
    max_err, rms_err = fp8_tolerance(plan.block_m, n)
    assert rel_error(got[:n], ref) < max_err and rms_rel_error(got[:n], ref) < rms_err


@pytest.mark.parametrize("prequant", [False, True])
def test_swapped_gemm1_within_the_wgmma_tolerance(prequant, gen):
    """``swap1``: GEMM1 on wgmma with the weights as its M sums fp8 products as the taller tiles' wgmmas do, so it is
    held to their tolerance (``fp8_tolerance(64)``), not to the split op's bits."""
    x, w1, w2, plan = _case(5, 384, 256, 2, 3, gen, dropped=1)
    n = int(plan.expert_offsets[-1])
    got = torch.full((plan.num_rows, 384), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    gave_up = fused.fused_experts_fp8(x, w1, w2, plan, got, split=2, lag=1, programs=3, prequant=prequant,
                                      swap1=True)
    assert int(gave_up) == 0, "a wait gave up: the items' order or counts are wrong"
    assert got[n:].isnan().all()
    ref = moe_experts_fp8_torch(x, w1, w2, plan, dtype=torch.float64,
                                out=torch.zeros(plan.num_rows, 384, dtype=torch.float64, device=DEVICE))[:n]
    max_err, rms_err = fp8_tolerance(64)
    assert rel_error(got[:n], ref) < max_err and rms_rel_error(got[:n], ref) < rms_err


@pytest.mark.parametrize("num_tiles,g1n,g2n", [(1, 3, 2), (5, 4, 3), (9, 32, 56)])
def test_item_order_takes_each_item_once_and_gemm1_of_a_tile_first(num_tiles, g1n, g2n):
    """``_item_at`` over all items: every (GEMM, tile, index) once, and each GEMM2 item after all of its tile's
    GEMM1 items, for lags from 0 past the tile count."""
    for lag in (0, 1, 2, num_tiles, num_tiles + 3):
        order = list(zip(*(t.tolist() for t in fused_order(num_tiles, lag, g1n, g2n))))
        assert sorted(order) == sorted([(1, t, s) for t in range(num_tiles) for s in range(g1n)]
                                       + [(0, t, s) for t in range(num_tiles) for s in range(g2n)]), lag
        gemm1_done = [0] * num_tiles
        for is_gemm1, t, _ in order:
            if is_gemm1:
                gemm1_done[t] += 1
            else:
                assert gemm1_done[t] == g1n, f"lag {lag}: a GEMM2 item of tile {t} before its tile's GEMM1"


BAD = [({"split": 0}, "split"), ({"lag": -1}, "lag"), ({"programs": 0}, "programs"), ({"block_n2": 32}, "block_n2")]
if DEVICE.type != "cuda":
    BAD.append(({"prefetch": True}, "prefetch"))


@pytest.mark.parametrize("kwargs,message", BAD)
def test_bad_arguments_raise_before_launch(kwargs, message, gen):
    x, w1, w2, plan = _case(2, 128, 128, 1, 1, gen)
    out = torch.empty(plan.num_rows, 128, dtype=torch.bfloat16, device=DEVICE)
    args = {"split": 1, "lag": 1, "programs": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        fused.fused_experts_fp8(x, w1, w2, plan, out, **args)


def test_widths_not_multiples_of_128_are_refused(gen):
    x, w1, w2, plan = _case(2, 160, 128, 1, 1, gen)
    with pytest.raises(ValueError, match="multiples of 128"):
        fused.fused_experts_fp8(x, w1, w2, plan, torch.empty(plan.num_rows, 160, device=DEVICE), split=1, lag=0,
                                programs=1)
