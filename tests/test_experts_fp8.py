"""fp8 block-scale experts (W8A8, SPEC §5): the quantizer against a float64 emulation, the format, the Triton
kernels (interpreter on CPU, compiled on a GPU) against the float64 reference, edge shapes and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tolerances import experts_tolerance

from moefuse import _runtime
from moefuse.config import PRESETS
from moefuse.dispatch import moe_dispatch
from moefuse.experts import (
    GemmTiles,
    TileConfig,
    configs,
    experts_workspace,
    moe_experts,
    persistent,
    pick_block_m,
    plan_block_m,
)
from moefuse.experts.fp8 import kernels as fp8_kernels
from moefuse.experts.fp8.kernels import experts_fp8
from moefuse.experts.reference import dequantize_rows, moe_experts_fp8_torch, quantize_rows
from moefuse.formats import BlockFP8, tile_dtype, ue8m0_to_float
from moefuse.testing import assert_rel_close, rms_rel_error


def _e4m3_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, from its bits, in float64 (independent of torch's cast)."""
    values = []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue  # NaN
            value = mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
            values += [value, -value]
    return torch.tensor(sorted(set(values)), dtype=torch.float64)


GRID = _e4m3_grid()


def _nearest_even_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round float64 ``y`` (within [-448, 448]) to the e4m3 grid, ties to the even mantissa."""
    idx = torch.searchsorted(GRID, y.clamp(-448, 448)).clamp(1, len(GRID) - 1)
    lo, hi = GRID[idx - 1], GRID[idx]
    pick_hi = (hi - y) < (y - lo)
    tie = (hi - y) == (y - lo)
    return torch.where(pick_hi | (tie & _mantissa_even(hi)), hi, lo)


def _mantissa_even(value: torch.Tensor) -> torch.Tensor:
    """Whether each e4m3 value's last mantissa bit is 0 (of two neighbours on the grid, exactly one is)."""
    m = value.abs()
    exponent = torch.floor(torch.log2(m.clamp(min=2.0**-9))).clamp(min=-6)
    return (m == 0) | (torch.round(m / 2.0 ** (exponent - 3)) % 2 == 0)


def test_quantizer_matches_a_float64_emulation(gen):
    """Per token and 128 columns: amax, scale = amax/448, q = e4m3(x · 448/amax) to nearest even, saturating;
    an all-zero group has scale 0; the last group of an odd width covers what is left."""
    x = torch.randn(64, 300, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    x[1, 128:256] = 0  # an all-zero group
    x[2, 5] = 1e-9  # far below the group's amax: a subnormal or zero
    q, scales = quantize_rows(x.bfloat16())
    x64 = x.bfloat16().double()
    for g in range(3):
        cols = slice(128 * g, min(128 * (g + 1), 300))
        # fp32 arithmetic, as specified, each operation rounded once: numpy's float32 division (torch's
        # ``448 / tensor`` multiplies by a reciprocal, which rounds twice)
        amax = x64[:, cols].abs().amax(dim=1).float().numpy()
        assert torch.equal(scales[:, g], torch.from_numpy(amax / np.float32(448)))
        with np.errstate(divide="ignore"):
            inv = np.where(amax > 0, np.float32(448) / amax, np.float32(0)).astype(np.float32)
        y = x64[:, cols].float().numpy() * inv[:, None]
        want = _nearest_even_e4m3(torch.from_numpy(y).double())
        assert torch.equal(q[:, cols].double(), want), f"group {g}"
    assert (q[1, 128:256].float() == 0).all() and scales[1, 1] == 0
    assert_rel_close(dequantize_rows(q, scales), x.bfloat16().float(), 2**-4, "dequantized")


def test_quantizer_nan_and_saturation():
    x = torch.tensor([[float("nan")] + [1.0] * 127, [448.0 * 3] + [-1e30] + [0.5] * 126])
    q, scales = quantize_rows(x)
    assert q[0].float().isnan().all() and scales[0].isnan()
    assert q[1].float().abs().max() == 448 and not q[1].float().isnan().any()


def test_ue8m0_scales():
    exps = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    want = torch.tensor([2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127, float("nan")])
    assert torch.equal(ue8m0_to_float(exps).nan_to_num(-1), want.nan_to_num(-1))
    assert torch.equal(ue8m0_to_float(exps.view(torch.float8_e8m0fnu)).nan_to_num(-1), want.nan_to_num(-1))
    values = torch.randn(2, 130, 140).clamp(-400, 400).to(torch.float8_e4m3fn)
    fmt = BlockFP8.from_checkpoint(values, torch.full((2, 2, 2), 127, dtype=torch.uint8))
    assert fmt.scales.dtype == torch.float32 and (fmt.scales == 1).all()
    with pytest.raises(TypeError, match="ue8m0"):
        ue8m0_to_float(torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("bad, match", [
    (lambda: BlockFP8(torch.zeros(2, 130, 140), torch.ones(2, 2, 2)), "values"),  # not e4m3
    (lambda: BlockFP8(torch.zeros(2, 130, 140).to(torch.float8_e4m3fn), torch.ones(2, 1, 2)), "scales"),  # shape
    (lambda: BlockFP8(torch.zeros(2, 130, 140).to(torch.float8_e4m3fn), torch.ones(2, 2, 2).double()), "scales"),
], ids=["values-dtype", "scales-shape", "scales-dtype"])
def test_format_errors(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        bad()


def _inputs(gen, M, K, E, H, I, *, invalid=0.0, ue8m0=False, device="cpu"):
    x = torch.randn(M, H, generator=gen).bfloat16()
    w1 = torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, H, I, generator=gen) / math.sqrt(I)
    if ue8m0:  # power-of-two scales, as DeepSeek-V3.1 ships: quantize against them
        formats = []
        for w in (w1, w2):
            q = BlockFP8.quantize(w)
            exps = (torch.log2(q.scales).ceil() + 127).to(torch.uint8)
            scales = ue8m0_to_float(exps)
            blocks = scales.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, : w.shape[1], : w.shape[2]]
            formats.append(BlockFP8.from_checkpoint((w / blocks).clamp(-448, 448).to(torch.float8_e4m3fn), exps))
        f1, f2 = formats
    else:
        f1, f2 = BlockFP8.quantize(w1), BlockFP8.quantize(w2)
    ids = torch.rand(M, E, generator=gen).argsort(dim=1)[:, :K].int()
    ids = torch.where(torch.rand(M, K, generator=gen) < invalid, -1, ids)
    move = lambda f: BlockFP8(f.values.to(device), f.scales.to(device))  # noqa: E731
    return x.to(device), move(f1), move(f2), ids.to(device)


def _check(x, w1, w2, ids, *, limit=None, block_m=16):
    """The Triton kernels against float64 on tiles of ``block_m`` rows, at the tile path's tolerance (measured:
    ``tolerances.py``): a 40-token test once took tall tiles at a 16-row tile's tolerance and failed on one seed."""
    plan = moe_dispatch(ids, w1.shape[0], block_m, backend="triton")
    out = torch.full((plan.num_rows, x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    moe_experts(x, w1, w2, plan, swiglu_limit=limit, out=out, backend="triton")
    ref = moe_experts_fp8_torch(x, w1, w2, plan, swiglu_limit=limit, dtype=torch.float64,
                                out=torch.zeros(plan.num_rows, x.shape[1], dtype=torch.float64, device=x.device))
    n_valid = int(plan.expert_offsets[-1])
    finite = ref[:n_valid].isfinite().all(dim=1)  # a NaN token's rows are checked for placement above
    tol, rms_tol = experts_tolerance("fp8", block_m, int(finite.sum()))
    assert_rel_close(out[:n_valid], ref[:n_valid], tol, "fp8 gemm2_out")
    rms = rms_rel_error(out[:n_valid][finite], ref[:n_valid][finite])
    assert rms <= rms_tol, f"fp8 gemm2_out: RMS relative error {rms:.3e} > {rms_tol:.1e}"
    assert out[n_valid:].isnan().all(), "rows with no token must be left unwritten"
    return plan


@pytest.mark.parametrize("M", [0, 1, 7, 33])
@pytest.mark.parametrize("shape", [(5, 200, 136), (3, 256, 128), (3, 136, 520)],
                         ids=["edges", "whole-blocks", "five-gemm2-steps"])
def test_triton_matches_float64(M, shape, gen, device):
    """H and I not multiples of 128 (partial blocks and groups; a scale block that straddles the gate and up rows),
    E not a power of two, -1 slots, and whole blocks; and I = 520, GEMM2's K in five steps with a scale group each
    (the last of 8 columns), so that a step multiplied by another step's scales shows."""
    E, H, I = shape
    _check(*_inputs(gen, M, 2 + M % 2, E, H, I, invalid=0.1, device=device), limit=1.5 if M % 2 else None)


def test_ue8m0_scales_and_empty_experts(gen, device):
    x, w1, w2, ids = _inputs(gen, 9, 2, 6, 200, 136, ue8m0=True, device=device)
    ids = torch.where(ids == 3, 4, ids)  # expert 3 gets no row
    plan = _check(x, w1, w2, ids)
    assert int(plan.expert_offsets[4] - plan.expert_offsets[3]) == 0


@pytest.mark.parametrize("M", [3, 40], ids=["few-rows", "many-rows"])
@pytest.mark.parametrize("limit", [None, 1.5], ids=["no-clamp", "clamp"])
def test_nan_stays_in_its_token(M, limit, gen, device):
    """A NaN in one token's hidden state makes that token's rows NaN (SPEC §5), at a few rows and at 64 or more
    (GEMM1 on 8 warps and on 4: ``configs.FP8_FEW_ROWS``), with and without the clamp; every other row matches the
    reference."""
    x, w1, w2, ids = _inputs(gen, M, 2, 3, 200, 136, device=device)
    x[1, 150] = float("nan")
    _check(x, w1, w2, ids, limit=limit)


@pytest.mark.parametrize("M", [5, 33], ids=["few-rows", "many-rows"])
@pytest.mark.parametrize("split_k", [2, 3, 4, 5])
@pytest.mark.parametrize("depth", [128, 256], ids=["one-box-steps", "two-box-steps"])
def test_split_k_matches_float64_and_repeats(depth, split_k, M, gen, device):
    """GEMM1 in runs of K steps, each its own program, summed by the last to finish (decode): against float64 at
    the short tiles' tolerance, on H = 520 (five boxes, the last of 8 columns: runs of one, two or three steps, one
    of them short; in four runs the last has none, and must still arrive; in steps of two boxes, three steps, the
    last one box) and I = 136 (partial blocks), -1 slots, the clamp, a NaN token, at 10 and 66 rows (each run starts
    at its own step of the quantized rows); on a GPU, where the programs race, two runs give the same bits (the runs
    are added in split order, whichever finishes last)."""
    x, w1, w2, ids = _inputs(gen, M, 2, 4, 520, 136, invalid=0.2, device=device)
    x[3, 300] = float("nan")
    ids[3] = torch.tensor([0, 1], dtype=ids.dtype)  # the NaN token has rows
    plan = moe_dispatch(ids, 4, 16, backend="triton")
    n = int(plan.expert_offsets[-1])
    tiles = GemmTiles(128, depth, 1, 4, 2)
    outs = []
    for _ in range(2 if torch.device(device).type == "cuda" else 1):  # the interpreter runs programs one after another
        out = torch.full((plan.num_rows, 520), float("nan"), dtype=x.dtype, device=device)
        experts_fp8(x, w1, w2, plan, out, tiles, tiles, 1.5, split_k=split_k)
        outs.append(out[:n])
    ref = moe_experts_fp8_torch(x, w1, w2, plan, swiglu_limit=1.5, dtype=torch.float64)[:n]
    finite = ref.isfinite().all(dim=1)
    tol, rms_tol = experts_tolerance("fp8", 16, int(finite.sum()))
    assert_rel_close(outs[0], ref, tol, f"fp8 split_k={split_k}")
    assert not finite.all() and rms_rel_error(outs[0][finite], ref[finite]) <= rms_tol
    for again in outs[1:]:
        assert torch.equal(outs[0].isnan(), again.isnan()) and torch.equal(outs[0].nan_to_num(), again.nan_to_num())
    with pytest.raises(ValueError, match="split_k"):
        experts_fp8(x, w1, w2, plan, out, tiles, tiles, split_k=0)


@pytest.mark.parametrize("shape", [(520, 136), (392, 264), (256, 648)], ids=["pointer-rows", "tma-rows", "wide"])
@pytest.mark.parametrize("M", [3, 40], ids=["few-rows", "many-rows"])
def test_two_box_steps_sum_as_one_box_steps(shape, M, gen, device):
    """Steps of two K-adjacent boxes (short tiles' default: ``configs.heuristic`` item 6) promote each box on its
    own, in K order: the same bits as steps of one box, in both GEMMs, with an odd count of boxes (the last step's
    second box past K, whose scale index must stay in range), a last box of 8 columns, rows read by pointers
    (H = 520, I = 136: not 16-byte rows) or through TMA, and GEMM2's K in six boxes (I = 648)."""
    H, I = shape
    x, w1, w2, ids = _inputs(gen, M, 2, 3, H, I, invalid=0.2, device=device)
    plan = moe_dispatch(ids, 3, 16, backend="triton")
    outs = []
    for depth in (128, 256):
        tiles = GemmTiles(128, depth, 1, 4, 3)
        out = torch.full((plan.num_rows, H), float("nan"), dtype=x.dtype, device=device)
        experts_fp8(x, w1, w2, plan, out, tiles, tiles, 1.5, split_k=1)
        outs.append(out)
    assert torch.equal(outs[0].isnan(), outs[1].isnan()) and torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num())
    n = int(plan.expert_offsets[-1])
    assert not outs[1][:n].isnan().any() and outs[1][n:].isnan().all()


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_counts_in_the_workspace_and_leaves_it_zeroed(split_k, gen, device):
    """Given a workspace, split GEMM1 counts its arrivals there (so no zeroing kernel runs) and its last arrivers
    set the counters back to zero: two calls on one workspace give the bits of a call with counters of its own, and
    leave it zeroed. The workspace is really the counters: primed far below zero, no run takes itself for its
    tile's last, and each tile's counters end raised by exactly the split, whatever order the runs arrive in (a
    GPU's races change nothing). One too small for the grid is not used, and not touched. H = 392 is four
    128-deep steps of GEMM1 (the last of 8 columns), so that in three runs the last is empty and must still
    arrive."""
    x, w1, w2, ids = _inputs(gen, 5, 2, 2, 392, 136, invalid=0.2, device=device)
    plan = moe_dispatch(ids, 2, 16, backend="triton")
    n = int(plan.expert_offsets[-1])
    tiles = GemmTiles(128, 128, 1, 4, 2)
    programs = plan.tile_expert.numel() * 2  # GEMM1's unsplit grid: 2 column blocks of I = 136

    def run(workspace):
        out = torch.zeros(plan.num_rows, 392, dtype=x.dtype, device=device)
        experts_fp8(x, w1, w2, plan, out, tiles, tiles, split_k=split_k, workspace=workspace)
        return out[:n]

    want = run(None)
    workspace = experts_workspace(device)
    for _ in range(2):
        assert torch.equal(run(workspace), want)
        assert not workspace.any()
    primed = torch.full((programs,), -100, dtype=torch.int32, device=device)
    run(primed)
    counted = primed == -100 + split_k  # the rest: tiles past the plan's, whose programs return at once
    assert (counted | (primed == -100)).all() and int(counted.sum()) == 2 * int((plan.tile_expert >= 0).sum())
    short = torch.full((programs - 1,), -100, dtype=torch.int32, device=device)
    assert torch.equal(run(short), want) and (short == -100).all()


def test_workspace_is_checked_before_any_launch(device):
    """``moe_experts(workspace=...)`` takes 1-D contiguous int32 on hidden's device, named in the error."""
    gen = torch.Generator().manual_seed(0)
    x, w1, w2, ids = _inputs(gen, 3, 2, 4, 256, 128, device=device)
    plan = moe_dispatch(ids, 4, 16, backend="triton")
    bad = [(torch.zeros(8, dtype=torch.int64, device=device), TypeError),
           (torch.zeros(2, 4, dtype=torch.int32, device=device), ValueError),
           (torch.zeros(16, dtype=torch.int32, device=device)[::2], ValueError),
           ([0] * 8, TypeError)]
    for workspace, error in bad:
        with pytest.raises(error, match="workspace"):
            moe_experts(x, w1, w2, plan, workspace=workspace, backend="triton")


@pytest.mark.parametrize("columns", [128, 64])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("shape", [(520, 256), (392, 384)], ids=["pointer-rows", "tma-rows"])
@pytest.mark.parametrize("M", [3, 40], ids=["few-rows", "many-rows"])
def test_gate_and_up_halves_give_the_unsplit_bits(M, shape, block_m, columns, gen, device):
    """GEMM1's gate and up tiles as programs of their own (``halves``, the batch-invariant layer's decode), each
    program the whole tile's 128 columns of its half or 64 of them (``half_columns``): each sums its columns over
    all of K in the unsplit order and the last to arrive runs the epilogue, so the bits are those of the unsplit
    launch: with -1 slots, the clamp, a NaN token, rows read by pointers (H = 520: not 16-byte rows, a last box of
    8 columns) or through TMA, one-box (64 rows) and two-box steps (16), and I of two and three scale groups. On a
    GPU, where the halves race, twice. A given workspace holds the counters and is left zeroed."""
    H, I = shape
    x, w1, w2, ids = _inputs(gen, M, 2, 4, H, I, invalid=0.2, device=device)
    x[1, 100] = float("nan")
    ids[1] = torch.tensor([0, 3], dtype=ids.dtype)  # the NaN token has rows
    # Finite rows and a -1 slot whatever the draw: at three tokens the other two drew no valid slot once in 625.
    ids[0] = torch.tensor([2, -1], dtype=ids.dtype)
    plan = moe_dispatch(ids, 4, block_m, backend="triton")
    tiles = configs.heuristic(M, 4, H, I, 2, torch.float8_e4m3fn, block_m=block_m)
    workspace = experts_workspace(device)

    def run(halves, workspace=None):
        out = torch.full((plan.num_rows, H), float("nan"), dtype=x.dtype, device=device)
        experts_fp8(x, w1, w2, plan, out, tiles.gemm1, tiles.gemm2, 1.5, split_k=1, halves=halves,
                    half_columns=columns if halves else None, workspace=workspace)
        return out

    want = run(False)
    for got in [run(True) for _ in range(2 if torch.device(device).type == "cuda" else 1)] + [run(True, workspace)]:
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert not workspace.any()
    n = int(plan.expert_offsets[-1])
    assert want[:n].isnan().any() and not want[:n].isnan().all()  # the NaN token's rows, and the others finite


@pytest.mark.parametrize("shape", [(520, 136), (392, 256)], ids=["pointer-rows-straddling", "tma-rows"])
def test_wgmma_gives_a_row_the_same_bits_on_every_height(shape, gen, device):
    """``wgmma=True`` (the batch-invariant order): both GEMMs on swapped wgmma below 64 rows give each row the bits of
    a 64-row wgmma tile, on 16- and 32-row plans, whole and in gate and up halves (I a multiple of 128), with -1
    slots, the clamp and a NaN token; rows read by pointers with the up tile straddling two weight blocks (I = 136:
    a scale per column) or through TMA. Without it the short tiles run mma.sync, whose bits differ on a GPU."""
    H, I = shape
    x, w1, w2, ids = _inputs(gen, 24, 2, 4, H, I, invalid=0.2, device=device)
    x[1, 100] = float("nan")
    ids[1] = torch.tensor([0, 3], dtype=ids.dtype)
    valid = (ids >= 0).flatten()

    def rows(block_m, halves=False):
        plan = moe_dispatch(ids, 4, block_m, backend="triton")
        tiles = configs.heuristic(24, 4, H, I, 2, torch.float8_e4m3fn, block_m=block_m)
        out = torch.full((plan.num_rows, H), float("nan"), dtype=x.dtype, device=device)
        experts_fp8(x, w1, w2, plan, out, tiles.gemm1, tiles.gemm2, 1.5, split_k=1, halves=halves, wgmma=True)
        return out[plan.expanded_to_permuted.long()[valid]]

    want = rows(64)
    assert want.isnan().any() and not want.isnan().all()  # the NaN token's rows, and the others finite
    for got in [rows(16), rows(32)] + ([rows(16, halves=True)] if I % 128 == 0 else []):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(TypeError, match="wgmma"):
        plan = moe_dispatch(ids, 4, 16, backend="triton")
        experts_fp8(x, w1, w2, plan, torch.empty(plan.num_rows, H, dtype=x.dtype, device=device),
                    GemmTiles(128, 128, 1, 4, 2), GemmTiles(128, 128, 1, 4, 2), wgmma=1)


def test_halves_are_checked_before_any_launch(gen, device):
    """``halves`` is a bool (or None), and True needs GEMM1 unsplit along K and I a multiple of 128 (each tile's
    weight-block scale one scalar a step)."""
    x, w1, w2, ids = _inputs(gen, 3, 2, 4, 256, 136, device=device)
    plan = moe_dispatch(ids, 4, 16, backend="triton")
    out = torch.empty(plan.num_rows, 256, dtype=x.dtype, device=device)
    tiles = GemmTiles(128, 128, 1, 4, 2)
    with pytest.raises(TypeError, match="halves"):
        experts_fp8(x, w1, w2, plan, out, tiles, tiles, halves=1)
    with pytest.raises(ValueError, match="halves"):  # I = 136
        experts_fp8(x, w1, w2, plan, out, tiles, tiles, halves=True)
    x, w1, w2, ids = _inputs(gen, 3, 2, 4, 256, 128, device=device)
    with pytest.raises(ValueError, match="halves"):
        experts_fp8(x, w1, w2, plan, out, tiles, tiles, split_k=2, halves=True)
    for columns, error in ((32, ValueError), (96, ValueError), (128.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="half_columns"):
            experts_fp8(x, w1, w2, plan, out, tiles, tiles, halves=True, half_columns=columns)


def test_halves_where_an_unsplit_grid_leaves_sms_idle():
    """The halves run where GEMM1 must not split K (``split_k`` 1, as a batch-invariant layer asks) and its grid
    fills at most two programs an SM: DeepSeek-V3's token with its shared slot (144 programs on 132 SMs), not from 16
    tokens; never where the default may split K instead, nor under the interpreter or off CUDA."""
    assert configs.fp8_halves(9, 2048, 132) and configs.fp8_halves(8, 2048, 132)
    assert not configs.fp8_halves(16 * 9, 2048, 132)
    assert configs.fp8_halves(33, 1024, 132) == (33 * 8 <= 264)
    cpu = torch.device("cpu")
    assert not fp8_kernels.default_halves(9, 2048, 1, cpu) and not fp8_kernels.default_halves(9, 2048, None, cpu)


def test_half_columns_where_every_program_has_an_sm():
    """The halves' programs sum 64 columns only where even then each has an SM of its own: a dense shared expert's
    token (DeepSeek-V4-Flash's: 32 halves, then 64 programs on 132 SMs; a width of 8,192 would make 256), never
    where programs share SMs (DeepSeek-V3's token with its shared slot: 288 halves); 128 off CUDA."""
    assert configs.fp8_half_columns(1, 2048, 132) == 64
    assert configs.fp8_half_columns(1, 8192, 132) == 128 and configs.fp8_half_columns(1, 8192, 256) == 64
    assert configs.fp8_half_columns(9, 2048, 132) == 128
    assert configs.fp8_half_columns(8, 768, 132) == 128
    assert fp8_kernels.default_half_columns(1, 2048, torch.device("cpu")) == 128


def test_swapped_wgmma_tiles_are_at_least_64_columns_wide():
    """On the batch-invariant order (``wgmma``) a swapped tile's columns are its MMA's M, which wgmma needs at 64 or
    more (sm_90 SASS: GEMM2 on 16 and 32 rows runs HMMA at 32 columns, HGMMA at 64). A narrow model's GEMM2
    (hidden 32: the tile choice asks for 32 columns) otherwise summed a lone token on mma.sync and the same token
    among 17 on a 64-row wgmma tile: a GPU run of the layer fuzz found the last bit apart."""
    narrow = GemmTiles(32, 128, 1, 4, 3)
    for block_m in (16, 32):
        assert fp8_kernels.fp8_tiles(narrow, block_m, False, 1, wgmma=True).block_n == fp8_kernels.WGMMA_MIN_ROWS
        assert fp8_kernels.fp8_tiles(narrow, block_m, False, 1).block_n == 32  # the default keeps its tile
    assert fp8_kernels.fp8_tiles(narrow, 64, False, 1, wgmma=True).block_n == 32  # unswapped: its rows are M
    assert fp8_kernels.fp8_tiles(GemmTiles(128, 128, 1, 4, 3), 16, False, 1, wgmma=True).block_n == 128


def test_halves_take_a_launch_of_their_own():
    """GEMM1's halves step one box on ``FP8_HALVES_WARPS`` warps and ``FP8_HALVES_STAGES`` stages on every tile height,
    whatever the tile choice asked for (two-box steps, 8 warps)."""
    for block_m in (16, 64):
        got = fp8_kernels.fp8_tiles(GemmTiles(128, 256, 0, 8, 2), block_m, True, 2, 1, configs.SMEM_BUDGET,
                                    half_columns=128)
        assert got == GemmTiles(128, 128, 0, configs.FP8_HALVES_WARPS, configs.FP8_HALVES_STAGES)


def test_narrow_halves_run_deeper_within_shared_memory():
    """Halves of 64 columns (each program an SM of its own) take ``FP8_NARROW_HALVES_STAGES`` where they fit the
    budget, fewer where they do not (but never under the halves' own), the same warps and steps."""
    tiles = GemmTiles(128, 256, 0, 8, 2)
    got = fp8_kernels.fp8_tiles(tiles, 16, True, 2, 1, configs.SMEM_BUDGET, half_columns=64)
    assert got == GemmTiles(128, 128, 0, configs.FP8_HALVES_WARPS, configs.FP8_NARROW_HALVES_STAGES)
    stage = 128 * (16 * 2 + 64)  # a 128-deep step of 16 activation rows (counted at 2 bytes) and 64 weight rows
    assert configs.FP8_NARROW_HALVES_STAGES * stage <= configs.SMEM_BUDGET
    tight = fp8_kernels.fp8_tiles(tiles, 16, True, 2, 1, 5 * stage, half_columns=64)
    assert tight.num_stages == 5
    floor = fp8_kernels.fp8_tiles(tiles, 128, True, 2, 1, stage, half_columns=64)
    assert floor.num_stages == configs.FP8_HALVES_STAGES
    assert fp8_kernels.fp8_tiles(tiles, 16, True, 2, 1, configs.SMEM_BUDGET, half_columns=128).num_stages \
        == configs.FP8_HALVES_STAGES


def test_split_k_where_the_grid_leaves_sms_idle():
    """GEMM1 splits along K at one token where its grid leaves SMs idle on a 132-SM Hopper, into the runs measured
    fastest on one H100 for two-box steps (splits 1-4, with and without the shared expert's slot; H100, 2026-12-05,
    docs/PERF-NOTES.md, fp8 decode), and not from 16 tokens, where a split measured slower. The rule fills waves of one
    unsplit program or two split ones per SM: on 127 SMs, 128 programs in two runs each leave 252 of two waves' 508
    slots empty, in three runs 124."""
    fastest = {"deepseek-v3": (1, 3), "kimi-k2": (1, 3), "deepseek-v4-flash": (1, 1), "glm-4.5-air": (3, 1),
               "qwen3-30b-a3b": (4, 4)}
    for name, cfg in PRESETS.items():
        for slots, split in zip((cfg.top_k, cfg.top_k + 1), fastest[name]):
            assert configs.fp8_split_k(slots, cfg.intermediate_size, 132) == split, (name, slots)
        assert configs.fp8_split_k(16 * cfg.top_k, cfg.intermediate_size, 132) == 1, name
    assert configs.fp8_split_k(8, 2048, 127) == 3
    assert configs.fp8_split_k(8, 2048, 64) == 1  # 128 programs already fill two per SM


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("shape", [(200, 136), (256, 128)], ids=["pointer-rows", "tma-rows"])
def test_tall_tiles(block_m, shape, gen, device):
    """Prefill tiles (activations quantized once, in plan order): several tiles per expert and short tails, a
    64-wide GEMM2; rows read through TMA where H and I allow (16-byte rows), by pointers where not."""
    H, I = shape
    x, w1, w2, _ = _inputs(gen, 70, 2, 3, H, I, device=device)
    ids = torch.stack([torch.zeros(70, dtype=torch.int32), (torch.arange(70) >= 40).int() + 1], dim=1).to(device)
    with configs.override(TileConfig(block_m, GemmTiles(128, 128, 0, 4, 2), GemmTiles(64, 128, 2, 4, 2))):
        _check(x, w1, w2, ids, block_m=block_m, limit=2.0)


def test_errors_name_the_argument(gen, device):
    x, w1, w2, ids = _inputs(gen, 3, 2, 4, 64, 32, device=device)
    plan = moe_dispatch(ids, 4, 16)
    with pytest.raises(ValueError, match="activation_quant"):  # W8A8 only: no kernels take unquantized activations
        moe_experts(x, w1, w2, plan, activation_quant=None)
    with pytest.raises(ValueError, match="activation_quant"):  # plain weights take the activations as they are
        moe_experts(x, w1.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16), plan, activation_quant="fp8")
    with pytest.raises(TypeError, match="down_proj"):
        moe_experts(x, w1, w2.dequantize(torch.bfloat16), plan)
    with pytest.raises(TypeError, match="hidden"):
        moe_experts(x.float(), w1, w2, plan)
    with pytest.raises(ValueError, match="gate_up_proj"):
        moe_experts(x[:, :32], w1, w2, plan)


@pytest.mark.parametrize("M, limit", [(5, None), (18, 0.75)])
def test_passes_around_cublas_match_the_quantizer(M, limit, gen, device):
    """The two Triton passes of the fp8 shared expert on cuBLAS (``experts/fp8/mlp.py``): the tokens quantized
    without a plan into column-major scales, bit for bit as ``quantize_rows`` (an all-zero row, a NaN row); and
    SwiGLU of an fp32 [M, 2I] (with and without the clamp) quantized the same way, against float64."""
    from moefuse.experts.fp8 import mlp as fp8_mlp
    from moefuse.experts.fp8 import quantize_rows_into

    x = (torch.randn(M, 300, generator=gen) * torch.logspace(-2, 2, M)[:, None]).bfloat16()
    x[1] = 0
    x[2, 7] = float("nan")
    x[3, 5] = -x[3].abs().max() * 1e-6  # quantizes below e4m3's smallest subnormal: -0.0, sign kept
    q = torch.empty(M, 300, dtype=torch.float8_e4m3fn, device=device)
    s = fp8_mlp._column_major(M, 3, device)
    quantize_rows_into(x.to(device), q, s, None, gather=False)
    want_q, want_s = quantize_rows(x)
    assert s.stride(0) == 1 and torch.equal(s[2].isnan().cpu(), want_s[2].isnan())
    keep = torch.arange(M) != 2
    assert torch.equal(s.cpu()[keep], want_s[keep]) and s[2, 0].isnan()
    assert torch.equal(q.cpu()[keep].view(torch.uint8), want_q[keep].view(torch.uint8))
    assert q[3, 5].view(torch.uint8).item() == 0x80
    I = 256
    gate_up = torch.randn(M, 2 * I, generator=gen) * 2
    aq = torch.empty(M, I, dtype=torch.float8_e4m3fn, device=device)
    a_s = fp8_mlp._column_major(M, I // 128, device)
    fp8_mlp._swiglu_quantize_kernel[(2,)](
        gate_up.to(device), aq, a_s, M, I, 0.0 if limit is None else limit, gate_up.stride(0), aq.stride(0),
        *a_s.stride(), HAS_LIMIT=limit is not None, EMULATE_RTNE=device.type == "cpu", BLOCK_R=16)
    gate, up = gate_up[:, :I].double(), gate_up[:, I:].double()
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    act = torch.nn.functional.silu(gate) * up
    got = dequantize_rows(aq.cpu(), a_s.cpu(), torch.float64)
    # e4m3 keeps 3 mantissa bits: each value within half a step (2^-4 of it) of its group's scaled act
    assert ((got - act).abs() <= act.abs() * 2**-4 + a_s.cpu().repeat_interleave(128, 1) * 2**-9 + 1e-12).all()
    assert torch.allclose(a_s.cpu().double(), act.view(M, -1, 128).abs().amax(2) / 448, rtol=1e-6)


@pytest.mark.parametrize("per_program", [1, 2, 4, 5])
@pytest.mark.parametrize("gather, word_order, step_major", [(True, False, False), (False, False, False),
                                                          (True, True, False), (True, True, True)],
                         ids=["gathered", "rows", "gathered-in-word-order", "W4A8-step-major-scales"])
def test_quantize_rows_pass(gather, word_order, step_major, per_program, gen, device, monkeypatch):
    """The activation quantization pass (``quantize_rows_into``: fp8 GEMM1's rows, W4A8's, the
    fp8 shared expert's on cuBLAS): the plan's valid rows, gathered from the tokens or (GEMM2's intermediate) as
    they are, quantized per SPEC §5 bit for bit as ``quantize_rows``, the other rows left unwritten; its groups of
    128 columns in runs of ``per_program`` a program (forced here; ``groups_per_program`` picks it by the row
    count), on H = 520 (five groups, the last of 8 columns, so that runs of 2 and 4 leave a short last run); -1
    slots, a NaN in a routed row. ``word_order``: W4A8's column order (``gluon_common.word_position``: column
    8t + 4h + j of each 32 at 4t + 16h + j), on H = 544 (W a multiple of 32, five groups of 128, the last of 32):
    the same values moved, the same scales. ``step_major``: the scales a transposed view (``quantized_rows``'
    W4A8 layout), the same values."""
    from moefuse.experts.fp8 import quantize

    monkeypatch.setattr(quantize, "groups_per_program", lambda row_blocks, groups: per_program)
    H = 544 if word_order else 520
    x, _, _, ids = _inputs(gen, 19, 2, 4, H, 128, invalid=0.2, device=device)
    plan = moe_dispatch(ids, 4, 16, backend="triton")
    n = int(plan.expert_offsets[-1])
    source = x if gather else torch.randn(plan.num_rows, H, generator=gen).bfloat16().to(device)
    source[int(plan.permuted_to_expanded[0]) // 2 if gather else 0, 300] = float("nan")  # in the third group
    q = torch.full((plan.num_rows, H), 7.0, device=device).to(torch.float8_e4m3fn)
    if step_major:  # W4A8's room from quantized_rows: a transposed view
        scales = quantize.quantized_rows(plan, H, device, step_major=True)[1].fill_(7.0)
        assert scales.shape == (plan.num_rows, 5) and scales.stride() == (1, plan.num_rows)
    else:
        scales = torch.full((plan.num_rows, 5), 7.0, device=device)
    quantize.quantize_rows_into(source, q, scales, plan, gather=gather, word_order=word_order)
    rows = source[plan.permuted_to_expanded[:n].long() // 2] if gather else source[:n]
    want_q, want_s = quantize_rows(rows.cpu())
    finite = want_s.isfinite().repeat_interleave(128, dim=1)[:, :H]  # a NaN group's values are unspecified
    if word_order:  # column k at 4t + 16h + j of its 32 (k = 32g + 8t + 4h + j), written out by hand
        k = torch.arange(H)
        position = (k // 32) * 32 + 4 * ((k % 32) // 8) + 16 * ((k % 8) // 4) + k % 4
        assert sorted(position.tolist()) == list(range(H)) and not torch.equal(position, k)
        moved_q, moved_finite = torch.empty_like(want_q), torch.empty_like(finite)
        moved_q[:, position], moved_finite[:, position] = want_q, finite
        want_q, finite = moved_q, moved_finite
    assert bool(want_s.isnan().any())
    assert torch.equal(torch.where(finite, q[:n].cpu().view(torch.uint8), 0),
                       torch.where(finite, want_q.view(torch.uint8), 0))
    assert torch.equal(scales[:n].cpu().nan_to_num(-1.0), want_s.nan_to_num(-1.0))
    assert bool((scales[n:] == 7.0).all()) and bool((q[n:].float() == 7.0).all()), "rows with no token are unwritten"


def test_groups_per_program_fills_the_pass():
    """The pass's runs of groups: one group a program while the row blocks are few (DeepSeek-V3's 56 groups at 16
    tokens: 8 row blocks, 448 programs), longer runs as they grow, and a whole row a program from about
    ``PASS_PROGRAMS`` row blocks (4,096 tokens); runs of one group to all of them, and a run of several groups
    short of a whole row only where the pass keeps at least half of ``PASS_PROGRAMS`` programs."""
    from moefuse.experts.fp8.quantize import PASS_PROGRAMS, groups_per_program

    assert [groups_per_program(-(-tokens * 8 // 16), 56) for tokens in (1, 16, 128, 1024, 4096)] == [1, 1, 4, 32, 56]
    for row_blocks in (0, 1, 7, 100, 1000, 5000):
        for groups in (1, 5, 16, 56):
            per = groups_per_program(row_blocks, groups)
            assert 1 <= per <= groups
            programs = row_blocks * -(-groups // per)
            assert per == groups or programs >= PASS_PROGRAMS // 2 or per == 1


def test_plan_block_m_gives_the_persistent_kernels_their_plans(monkeypatch):
    """fp8 experts on a Hopper GPU without a tuned table get the persistent kernels' 128-row plans from
    ``persistent.FP8_MIN_TOKENS`` tokens, if their widths are whole items, unless ``persistent="none"`` (argument or
    process default); the heuristic's height everywhere else."""
    E, H, I, K = 4, 256, 128, 2
    w1 = BlockFP8.quantize(torch.randn(E, 2 * I, H))
    narrow = BlockFP8.quantize(torch.randn(E, 2 * 192, H))  # I = 192: not whole 128-column items
    many = persistent.FP8_MIN_TOKENS

    def table(M: int, arch, width: int = I) -> int:
        return pick_block_m(M, E, H, width, K, tile_dtype(w1, torch.bfloat16), arch)

    assert table(many, (9, 0)) != persistent.BLOCK_M  # else the switch would not show here
    monkeypatch.setattr(_runtime.DEFAULTS, "persistent", "none")
    assert plan_block_m(many, w1, K, torch.bfloat16, arch=(9, 0)) == table(many, (9, 0))
    assert plan_block_m(many, w1, K, torch.bfloat16, arch=(9, 0), persistent="auto") == persistent.BLOCK_M
    for value in ("auto", "all"):  # the default and the 16-bit opt-in
        monkeypatch.setattr(_runtime.DEFAULTS, "persistent", value)
        assert plan_block_m(many, w1, K, torch.bfloat16, arch=(9, 0)) == persistent.BLOCK_M
        assert plan_block_m(many, w1, K, torch.bfloat16, arch=(9, 0), persistent="none") == table(many, (9, 0))
    assert plan_block_m(many - 1, w1, K, torch.bfloat16, arch=(9, 0)) == table(many - 1, (9, 0))
    assert plan_block_m(many, w1, K, torch.bfloat16, arch=(10, 0)) == table(many, (10, 0))
    assert plan_block_m(many, w1, K, torch.bfloat16, arch=None) == table(many, None)
    assert plan_block_m(many, narrow, K, torch.bfloat16, arch=(9, 0)) == table(many, (9, 0), 192)
