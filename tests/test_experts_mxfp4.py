"""MXFP4 experts (DeepSeek-V4 FP4 weights, W4A16, SPEC §6): the format against a float64 decode built from the
e2m1 bits, the exactness of the kernels' in-register unpacking (weights revealed one by one through the GEMMs, at
the ends of the supported exponents too), the Triton kernels (interpreter on CPU, compiled on a GPU) against the
float64 reference on random inputs and edge shapes, and the errors."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import experts_tolerance

import moefuse.experts.mxfp4.kernels as mxfp4_kernels
import moefuse.experts.mxfp4.w4a8 as mxfp4_w4a8
import moefuse.experts.mxfp4.w4a8_decode as mxfp4_w4a8_decode
import moefuse.experts.mxfp4.ws as mxfp4_ws
from moefuse.dispatch import moe_dispatch
from moefuse.experts import GemmTiles, TileConfig, configs, moe_experts, moe_experts_torch
from moefuse.experts.common import gather_rows, weight_descriptor
from moefuse.experts.reference import moe_experts_w4a8_torch, w4a8_weight
from moefuse.formats import MXFP4, MXFP4_EXPONENTS, BlockFP8
from moefuse.testing import assert_rel_close, rms_rel_error


def _e2m1(code: int) -> float:
    """An e2m1 code's value from its bits: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0)."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)  # 0 is subnormal
    return sign * magnitude  # code 8: -0.0


E2M1 = torch.tensor([_e2m1(c) for c in range(16)], dtype=torch.float64)
POW2 = torch.tensor([2.0 ** (e - 127) for e in range(256)], dtype=torch.float64)  # ue8m0 exponent -> scale
LOW, HIGH = 0, 128  # the supported ue8m0 exponents (SPEC §6): scales 2^-127 .. 2^1
# Every code once at an even K index (low nibble) and once at an odd one (high nibble), in each group of 32.
ALL_CODES = torch.tensor(list(range(16)) + list(range(15, -1, -1)), dtype=torch.uint8)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """[E, N, K] codes -> [E, N, K/2] bytes: element 2j in byte j's low nibble, 2j + 1 in its high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _decode(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """float64 weights [E, N, K] of codes [E, N, K] and exponents [E, N, K/32]."""
    return E2M1[codes.long()] * POW2[exps.long()].repeat_interleave(32, dim=2)


def _mxfp4(codes: torch.Tensor, exps: torch.Tensor, device) -> MXFP4:
    return MXFP4(_pack(codes).to(device), exps.to(torch.uint8).to(device))


# --- the format ----------------------------------------------------------------------------------------------

def _format_case(gen):
    """Codes: every code in both nibble positions in every group; exponents: both ends, the middle, random."""
    E, N, K = 2, 6, 64
    codes = ALL_CODES.repeat(E, N, K // 32)
    exps = torch.randint(LOW, HIGH + 1, (E, N, K // 32), generator=gen, dtype=torch.uint8)
    exps[0, :, 0] = torch.tensor([LOW, HIGH, 127, LOW + 1, HIGH - 1, 128], dtype=torch.uint8)
    exps[0, :, 1] = torch.tensor([HIGH, LOW, 126, 100, 1, 127], dtype=torch.uint8)
    return codes, exps


def test_e2m1_from_bits():
    """The test's own decode (a sanity check of the oracle: the eight magnitudes and their negatives)."""
    assert MXFP4_EXPONENTS == (LOW, HIGH)
    assert E2M1[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert torch.equal(E2M1[8:], -E2M1[:8]) and bool(E2M1[8].signbit())


def test_dequantize_every_code_and_exponent(gen):
    codes, exps = _format_case(gen)
    want = _decode(codes, exps)
    assert torch.equal(want[0, 0, :16], E2M1 * 2.0**-127) and torch.equal(want[0, 1, :16], E2M1 * 2.0**1)
    packed = _pack(codes)
    for values in (packed, packed.view(torch.int8)):
        fmt = MXFP4(values, exps)
        assert fmt.shape == (2, 6, 64)
        got = fmt.dequantize(torch.float64)
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
        for dtype in (torch.float32, torch.bfloat16):  # exact too, within the supported exponents
            assert torch.equal(fmt.dequantize(dtype).double(), want), dtype
    # One expert, and the low/high nibble order seen on a single byte: 0x7A = code 10 (-1) then code 7 (6).
    byte = torch.full((1, 1, 16), 0x7A, dtype=torch.uint8)
    one = MXFP4(byte, torch.full((1, 1, 1), 127, dtype=torch.uint8)).dequantize(torch.float64)[0, 0]
    assert one[0::2].eq(-1).all() and one[1::2].eq(6).all()
    assert torch.equal(MXFP4(packed, exps)[1].dequantize(torch.float64), want[1:])


def test_from_checkpoint_scale_dtypes(gen):
    codes, exps = _format_case(gen)
    values = _pack(codes).view(torch.int8)  # checkpoints ship int8
    want = _decode(codes, exps)
    fp32 = POW2[exps.long()].float()  # 2^-127 .. 2^1: exact fp32 powers of two (2^-127 subnormal)
    for scale_inv in (exps.view(torch.float8_e8m0fnu), exps.clone(), fp32):
        fmt = MXFP4.from_checkpoint(values, scale_inv)
        assert fmt.scales.dtype == torch.uint8 and torch.equal(fmt.scales, exps), scale_inv.dtype
        assert torch.equal(fmt.dequantize(torch.float64), want), scale_inv.dtype
        assert fmt.values.data_ptr() == values.data_ptr()  # shares the checkpoint's values


@pytest.mark.parametrize("bad", [1.5, 3.0, 0.0, -1.0, float("inf"), float("nan")])
def test_from_checkpoint_rejects_fp32_scales_not_powers_of_two(bad, gen):
    codes, exps = _format_case(gen)
    scales = POW2[exps.long()].float()
    scales[1, 2, 1] = bad
    with pytest.raises(ValueError, match="power"):
        MXFP4.from_checkpoint(_pack(codes), scales)


@pytest.mark.parametrize("given, exponent", [
    (given, exponent) for given in ("uint8", "e8m0", "fp32") for exponent in (HIGH + 1, 200, 254, 255)
    if (given, exponent) != ("fp32", 255)  # NaN in ue8m0: not a power of two in fp32 (the test above)
])
def test_exponents_outside_the_range_are_rejected(given, exponent, gen):
    codes, exps = _format_case(gen)
    exps[1, 3, 0] = exponent
    if given == "uint8":
        build = lambda: MXFP4(_pack(codes), exps)  # noqa: E731
    elif given == "e8m0":
        build = lambda: MXFP4.from_checkpoint(_pack(codes), exps.view(torch.float8_e8m0fnu))  # noqa: E731
    else:
        build = lambda: MXFP4.from_checkpoint(_pack(codes), POW2[exps.long()].float())  # noqa: E731
    with pytest.raises(ValueError, match="scales"):
        build()


@pytest.mark.parametrize("make, error, match", [
    (lambda: MXFP4(torch.zeros(2, 4, 8, dtype=torch.uint8), torch.full((2, 4, 1), 127, dtype=torch.uint8)),
     ValueError, "multiple of 32"),  # K = 16
    (lambda: MXFP4(torch.zeros(2, 4, 24, dtype=torch.uint8), torch.full((2, 4, 1), 127, dtype=torch.uint8)),
     ValueError, "multiple of 32"),  # K = 48
    (lambda: MXFP4(torch.zeros(2, 4, 32, dtype=torch.uint8), torch.full((2, 4, 3), 127, dtype=torch.uint8)),
     ValueError, "scales"),  # K/32 + 1 groups
    (lambda: MXFP4(torch.zeros(2, 4, 32, dtype=torch.uint8), torch.full((2, 5, 2), 127, dtype=torch.uint8)),
     ValueError, "scales"),  # N + 1 rows
    (lambda: MXFP4(torch.zeros(2, 4, 32, dtype=torch.uint8), torch.full((3, 4, 2), 127, dtype=torch.uint8)),
     ValueError, "scales"),  # E + 1 experts
    (lambda: MXFP4(torch.zeros(2, 4, 32, dtype=torch.uint8), torch.full((2, 4, 2), 127, dtype=torch.int32)),
     TypeError, "scales"),
    (lambda: MXFP4(torch.zeros(2, 4, 32, dtype=torch.float32), torch.full((2, 4, 2), 127, dtype=torch.uint8)),
     TypeError, "values"),
    (lambda: MXFP4.from_checkpoint(torch.zeros(2, 4, 32, dtype=torch.int8), torch.ones(2, 4, 2).half()),
     TypeError, "scales"),
], ids=["K16", "K48", "scales-groups", "scales-rows", "scales-experts", "scales-dtype", "values-dtype",
        "fp16-scales"])
def test_format_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_quantize_round_trips_representable_weights(gen):
    """Groups whose amax is a 6 x 2^s hold exact MXFP4 values: quantize gives them back, codes and exponents."""
    codes, exps = _format_case(gen)
    exps = exps.clamp(LOW + 3, HIGH - 3)  # away from the clamp of quantize's exponent
    fmt = MXFP4.quantize(_decode(codes, exps).float())
    assert torch.equal(fmt.scales, exps)
    assert torch.equal(fmt.values.view(torch.uint8), _pack(torch.where(codes == 8, 0, codes)))  # -0 -> +0
    assert torch.equal(fmt.dequantize(torch.float64), _decode(codes, exps))


# --- exactness of the kernels' unpacking -----------------------------------------------------------------------
#
# One-hot activations reveal weights one at a time: x = 2^a at column k gives gate[n] = 2^a W1[e, n, k] and
# up[n] = 2^a W1[e, I + n, k], a single product in each fp32 sum. SiLU is exact at both ends: a gate >= 32 gives
# sigmoid = 1 (exp(-32) is below fp32's and bf16's half ulp of 1) and a gate <= 2^-100 gives sigmoid = 1/2, so the
# intermediate is gate x up or gate/2 x up, a power of two times the weight (two significant bits: exact in
# bf16). A down projection that selects intermediate column h % I into output column h passes it through
# unchanged: the output row of (token t, expert e) is a power of two times W1[e, I + h % I, t], bit for bit.
# Swapping roles (up one-hot, down random) reveals the down weights. The weights' exponents are random in
# [100, 128] ("mid"), or the supported range's ends, LOW in one group of 32 and HIGH in the other ("ends"): at
# LOW the smallest weights are bf16 subnormals (0.5 x 2^-127), which the kernels' multiply and MMA must keep. The
# powers of two of x and of the gate are chosen per group so that every output is a normal number.

E_X, H_X, I_X = 3, 64, 64  # two groups of 32 along H and along I (H = 128 to reveal the down weights)
REVEAL_TILES = TileConfig(16, GemmTiles(32, 32, 1, 4, 2), GemmTiles(32, 32, 1, 4, 2))  # 2 K-steps, 2 col blocks


def _random_codes(gen, E, N, K):
    codes = torch.randint(0, 16, (E, N, K), generator=gen, dtype=torch.uint8)
    codes[:, 0] = ALL_CODES.repeat(K // 32)  # row 0: every code, both nibble positions, in every group
    return codes


def _random_exps(gen, E, N, K, regime, mid=(100, HIGH)):
    if regime == "mid":
        return torch.randint(mid[0], mid[1] + 1, (E, N, K // 32), generator=gen, dtype=torch.uint8)
    exps = torch.empty(E, N, K // 32, dtype=torch.uint8)
    exps[..., 0], exps[..., 1] = LOW, HIGH  # group 0 at 2^-127 (bf16 subnormal weights), group 1 at 2^1
    return exps


def _constant(E, N, K, code, exps):
    """Every weight = code's value x 2^(exps[k // 32] - 127) (exps per K group, the same for all rows)."""
    return torch.full((E, N, K), code, dtype=torch.uint8), torch.tensor(exps, dtype=torch.uint8).expand(E, N, -1)


def _selector(E, H, I):
    """down[e, h, n] = 1 where n == h % I, else 0."""
    codes = torch.zeros(E, H, I, dtype=torch.uint8)
    codes[:, torch.arange(H), torch.arange(H) % I] = 2  # code 2 = 1.0
    return codes, torch.full((E, H, I // 32), 127, dtype=torch.uint8)


def _reveal_case(which, regime, gen):
    """(x, gate_up codes/exps, down codes/exps, expected [M, E, H] in float64, top-k ids) of one reveal."""
    E, H, I = E_X, H_X, I_X
    if which == "up":
        # Per H group: x = 2^a and the gate 2^(a + 1) >= 32 (gate weights 2 = code 2 at exponent HIGH), so SiLU(gate)
        # = gate and the intermediate is f x W with f = gate x 2^a. mid: x = 16, f = 2^9, exponents in [109, 128].
        # ends: W = c x 2^-127 (bf16 subnormals for c <= 1.5) with x = 2^15 (f = 2^31: c x 2^-96); W = c x 2 with
        # x = 2^5 (f = 2^11).
        a = [4, 4] if regime == "mid" else [15, 5]
        eg = [HIGH, HIGH]
        f = [2.0 ** (a[g] + eg[g] - 127) * 2.0 ** a[g] for g in range(2)]
        assert all(2.0 ** (a[g] + eg[g] - 127) >= 32 for g in range(2))
        M = H  # token t is one-hot at column t
        x = torch.zeros(M, H)
        x[torch.arange(M), torch.arange(M)] = torch.tensor([2.0 ** a[k // 32] for k in range(H)])
        gate_codes, gate_exps = _constant(E, I, H, 2, eg)
        up_codes, up_exps = _random_codes(gen, E, I, H), _random_exps(gen, E, I, H, regime, mid=(109, HIGH))
        down_codes, down_exps = _selector(E, H, I)
        up = _decode(up_codes, up_exps)  # [E, I, H]
        col = torch.arange(H) % I
        # expected[t, e, h] = f(t) x up[e, h % I, t]
        want = torch.stack([f[t // 32] * up[:, col, t] for t in range(M)])
    elif which == "down":
        u = [0, 0] if regime == "mid" else [0, -10]  # up = 16 x 2^u per I group
        # Token t is one-hot (16) at column 2t, an even one (a low nibble: the up weights' nibble order matters
        # here too), so up[n] = 16 x 2^u(n) [n == t] and, with a gate of 32, the intermediate is 2^(9 + u) one-hot.
        M, H = I, 2 * I
        x = torch.zeros(M, H)
        x[torch.arange(M), 2 * torch.arange(M)] = 16.0
        gate_codes, gate_exps = _constant(E, I, H, 2, [HIGH] * (H // 32))
        up_codes = torch.zeros(E, I, H, dtype=torch.uint8)
        up_codes[:, torch.arange(I), 2 * torch.arange(I)] = 2
        up_exps = torch.tensor([127 + u[n // 32] for n in range(I)], dtype=torch.uint8)[None, :, None]
        up_exps = up_exps.expand(E, I, H // 32).contiguous()
        down_codes, down_exps = _random_codes(gen, E, H, I), _random_exps(gen, E, H, I, regime)
        down = _decode(down_codes, down_exps)  # [E, H, I]
        want = torch.stack([512 * 2.0 ** u[t // 32] * down[:, :, t] for t in range(M)])
    else:  # "gate": up = 1, so the intermediate is bf16(SiLU(gate)), not exact in fp32: checked to a bf16 ulp
        M = H
        x = torch.zeros(M, H)
        x[torch.arange(M), torch.arange(M)] = 1.0
        gate_codes = _random_codes(gen, E, I, H)
        # |gate| <= 12, so |SiLU(gate)| >= 12 e^-12 > 2^-14 wherever the gate is not zero
        gate_exps = torch.randint(124, HIGH + 1, (E, I, H // 32), generator=gen, dtype=torch.uint8)
        up_codes, up_exps = _constant(E, I, H, 2, [127, 127])
        down_codes, down_exps = _selector(E, H, I)
        gate = _decode(gate_codes, gate_exps)
        col = torch.arange(H) % I
        want = torch.stack([torch.nn.functional.silu(gate[:, col, t]).bfloat16().double() for t in range(M)])
    w1 = (torch.cat([gate_codes, up_codes], dim=1), torch.cat([gate_exps, up_exps], dim=1))
    # Token t goes to every expert, in an order that differs per token.
    ids = torch.stack([torch.roll(torch.arange(E), t) for t in range(M)]).int()
    return x.bfloat16(), w1, (down_codes, down_exps), want, ids


# The gate goes through SiLU, so it is revealed (to a bf16 ulp) in the middle of the range only; its rows go
# through the same unpacking as the up rows.
@pytest.mark.parametrize("which, regime", [("up", "mid"), ("up", "ends"), ("down", "mid"), ("down", "ends"),
                                           ("gate", "mid")])
def test_unpacking_is_exact(which, regime, gen, device):
    x, w1, w2, want, ids = _reveal_case(which, regime, gen)
    assert torch.equal(want.bfloat16().double(), want) and want.abs().max() < 2.0**127  # representable
    assert (want[want != 0].abs() >= 2.0**-126).all()  # normal numbers: no flush to zero anywhere
    gate_up, down = _mxfp4(*w1, device), _mxfp4(*w2, device)
    x, ids = x.to(device), ids.to(device)
    H = x.shape[1]
    plan = moe_dispatch(ids, E_X, 16, backend="triton")
    out = torch.full((plan.num_rows, H), float("nan"), dtype=torch.bfloat16, device=device)
    with configs.override(REVEAL_TILES):
        moe_experts(x, gate_up, down, plan, out=out, backend="triton")
    # Row of (token t, slot s) in expanded order; its expert is ids[t, s].
    got = out[plan.expanded_to_permuted.long()].double().cpu().view(ids.shape[0], E_X, H)
    expected = want.gather(1, ids.cpu().long()[:, :, None].expand(-1, -1, H))
    if which == "gate":
        bad = (got - expected).abs() > 2.0**-7 * expected.abs()
    else:
        bad = got != expected  # (a zero's sign does not survive the sums: -0 + 0 = +0)
    if bool(bad.any()):
        t, s, h = (int(i) for i in bad.nonzero()[0])
        pytest.fail(f"{int(bad.sum())} wrong weights, first: token {t}, expert {int(ids[t, s])}, column {h}: "
                    f"got {got[t, s, h].item()!r}, expected {expected[t, s, h].item()!r}")
    if which != "gate":
        assert expected.count_nonzero() > expected.numel() // 2  # the test reveals values, not zeros


# --- Triton vs the float64 reference -----------------------------------------------------------------------------

def _inputs(gen, M, K, E, H, I, *, invalid=0.1, empty=None, device="cpu"):
    """bf16 activations, quantized random weights (gate/up values O(1), so the clamp bites), top-K ids without
    repeats from the experts other than ``empty``, each slot -1 with probability ``invalid``."""
    x = torch.randn(M, H, generator=gen).bfloat16()
    w1 = MXFP4.quantize(torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H) * 2)
    w2 = MXFP4.quantize(torch.randn(E, H, I, generator=gen) / math.sqrt(I))
    pool = E if empty is None else E - 1
    ids = torch.rand(M, pool, generator=gen).argsort(dim=1)[:, :K]
    if empty is not None:
        ids = ids + (ids >= empty).long()
    ids = torch.where(torch.rand(M, K, generator=gen) < invalid, -1, ids).int()
    move = lambda w: MXFP4(w.values.to(device), w.scales.to(device))  # noqa: E731
    return x.to(device), move(w1), move(w2), ids.to(device)


def _check(x, w1, w2, ids, *, limit=None, block_m=16):
    plan = moe_dispatch(ids, w1.shape[0], block_m, backend="triton")
    out = torch.full((plan.num_rows, x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    moe_experts(x, w1, w2, plan, swiglu_limit=limit, out=out, backend="triton")
    ref = moe_experts_torch(x, w1, w2, plan, swiglu_limit=limit, dtype=torch.float64,
                            out=torch.zeros(plan.num_rows, x.shape[1], dtype=torch.float64, device=x.device))
    n_valid = int(plan.expert_offsets[-1])
    assert_rel_close(out[:n_valid], ref[:n_valid], 1e-2, "mxfp4 gemm2_out")
    assert out[n_valid:].isnan().all(), "rows with no token must be left unwritten"
    return plan


TOP_K = {0: 1, 1: 2, 7: 3, 33: 2}
K64 = TileConfig(16, GemmTiles(64, 64, 1, 4, 2), GemmTiles(64, 64, 2, 4, 2))  # H = 96, I = 160: a 32-wide last step


@pytest.mark.parametrize("tiles", [None, K64], ids=["heuristic", "block_k64"])
@pytest.mark.parametrize("limit", [None, 1.5], ids=["no-clamp", "clamp"])
@pytest.mark.parametrize("M", [0, 1, 7, 33])
def test_triton_matches_float64(M, limit, tiles, gen, device):
    """E = 5, H = 96 (3 groups: the heuristic's BLOCK_K 128 covers it in one masked step, block_k 64 in a full and
    a half step), I = 160 (partial column blocks, a last GEMM2 step of 32), -1 slots, expert 2 empty."""
    E, H, I = 5, 96, 160
    x, w1, w2, ids = _inputs(gen, M, TOP_K[M], E, H, I, empty=2, device=device)
    if tiles is None:
        plan = _check(x, w1, w2, ids, limit=limit)
    else:
        with configs.override(tiles):
            plan = _check(x, w1, w2, ids, limit=limit)
    assert int(plan.expert_offsets[3] - plan.expert_offsets[2]) == 0


def test_smallest_shapes(gen, device):
    """H = I = 32: one scale group per row, BLOCK_K and BLOCK_N above the dims."""
    _check(*_inputs(gen, 9, 3, 4, 32, 32, device=device), limit=1.5)


@pytest.mark.parametrize("limit", [None, 1.5], ids=["no-clamp", "clamp"])
def test_nan_stays_in_its_token(limit, gen, device):
    """A NaN in one token's hidden state makes that token's rows NaN, as in the reference (zero weights included:
    NaN x 0 is NaN), with and without the clamp; every other row matches the reference."""
    x, w1, w2, ids = _inputs(gen, 9, 2, 4, 64, 32, invalid=0.0, device=device)
    x[2, 33] = float("nan")
    _check(x, w1, w2, ids, limit=limit)


def test_tall_tiles(gen, device):
    """64-row tiles (block_m 64): expert 0's 70 rows are a full tile and a 6-row tail, GROUP_M 0 (per expert) in
    GEMM1 and 2 in GEMM2, BLOCK_K 32 over H = 96 and 64 over I = 160 (a last step of 32)."""
    x, w1, w2, _ = _inputs(gen, 70, 2, 3, 96, 160, device=device)
    ids = torch.stack([torch.zeros(70, dtype=torch.int32), (torch.arange(70) >= 40).int() + 1], dim=1).to(device)
    with configs.override(TileConfig(64, GemmTiles(64, 32, 0, 4, 2), GemmTiles(32, 64, 2, 4, 2))):
        plan = _check(x, w1, w2, ids, block_m=64, limit=1.5)
    assert plan.expert_offsets.diff().tolist() == [70, 40, 30]


def test_a_row_has_the_same_bits_on_every_tile_height(gen, device):
    """Each (token, slot)'s output row is bitwise the same on 16-, 32- and 64-row tiles: what batch invariance rests
    on (a token alone runs shorter tiles than in a batch). The sums are made to cancel: the intermediate's columns
    come in equal pairs (gate and up rows repeated) and the down weights in opposite pairs along K, so each output's
    exact sum is 0 and a rounded sum leaves a residue that follows its order. Under the interpreter, tiles summing
    in numpy's fp32 (whose order follows the tile's height) gave 10 to 270 of the 240 x 256 outputs other bits on
    some height in each of four draws; summed in float64 they give 0 on every height."""
    E, H, I, M = 3, 256, 128, 40
    for _ in range(2):
        x = torch.randn(M, H, generator=gen).bfloat16().to(device)
        w1 = (torch.randn(E, I, H, generator=gen) / math.sqrt(H) * 2).repeat_interleave(2, dim=1)
        down = torch.randn(E, H, I // 2, 1, generator=gen) / math.sqrt(I)
        w2 = torch.cat([down, -down], dim=3).reshape(E, H, I)
        w1, w2 = (MXFP4(w.values.to(device), w.scales.to(device)) for w in (MXFP4.quantize(w1), MXFP4.quantize(w2)))
        ids = torch.rand(M, E, generator=gen).argsort(dim=1)[:, :2].int().to(device)
        outs = []
        for block_m in (16, 32, 64):
            plan = moe_dispatch(ids, E, block_m, backend="triton")
            out = torch.zeros(plan.num_rows, H, dtype=x.dtype, device=device)
            moe_experts(x, w1, w2, plan, out=out, backend="triton")
            outs.append(out[plan.expanded_to_permuted.long()])
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("pad, offset", [(4, 4), (5, 3)], ids=["word-aligned", "byte-aligned"])
def test_strided_operands(pad, offset, gen, device):
    """Packed rows padded by ``pad`` bytes from byte ``offset``, strided scales and activations, over several K
    steps of 32, give the same result as the float64 reference. Word-aligned rows whose stride is no multiple of 16
    bytes are read as int32 words by pointer loads (no TMA descriptor); byte-aligned ones are copied first."""
    E, H, I = 3, 96, 64
    x, w1, w2, ids = _inputs(gen, 7, 2, E, H, I, device=device)

    def strided(w: MXFP4) -> MXFP4:
        E_, N, half = w.values.shape
        values = torch.zeros(E_, N, half + pad, dtype=torch.uint8, device=device)
        values[:, :, offset:offset + half] = w.values
        scales = torch.full((E_, N, 2 * w.scales.shape[2]), 127, dtype=torch.uint8, device=device)
        scales[:, :, 0::2] = w.scales
        return MXFP4(values[:, :, offset:offset + half], scales[:, :, 0::2])

    s1, s2 = strided(w1), strided(w2)
    if pad == 4:
        words = s1.values.view(torch.int32), s2.values.view(torch.int32)  # a view: no copy
        assert weight_descriptor(words[0], 32, 4) is None and weight_descriptor(words[1], 32, 4) is None
    wide = torch.randn(7, H + 16, generator=gen).bfloat16().to(device)
    wide[:, 5:5 + H] = x
    with configs.override(TileConfig(16, GemmTiles(32, 32, 1, 4, 2), GemmTiles(32, 32, 2, 4, 2))):
        _check(wide[:, 5:5 + H], s1, s2, ids, limit=1.5)


def test_reference_backend(gen, device):
    x, w1, w2, ids = _inputs(gen, 7, 2, 3, 64, 32, device=device)
    plan = moe_dispatch(ids, 3, 16, backend="reference")
    got = moe_experts(x, w1, w2, plan, swiglu_limit=2.0, backend="reference")
    want = moe_experts_torch(x, w1, w2, plan, swiglu_limit=2.0)
    n_valid = int(plan.expert_offsets[-1])
    assert got.dtype == torch.bfloat16 and torch.equal(got[:n_valid], want[:n_valid])


@pytest.mark.parametrize("scale", [2.0**20, 2.0**-20], ids=["large", "small"])
def test_activations_outside_fp16_range(scale, gen, device):
    """bf16 activations keep bf16's range: hidden ~ 2^20 (an intermediate ~ 2^40) or ~ 2^-20 (~ 2^-41), beyond
    fp16's normal range both ways, still match the float64 reference."""
    x, w1, w2, ids = _inputs(gen, 7, 2, 3, 64, 32, invalid=0.0, device=device)
    _check((x.float() * scale).bfloat16(), w1, w2, ids)


# --- the warp-specialized decode kernels (Gluon, sm_90 only) ---------------------------------------------------

@pytest.mark.parametrize("paired", [False, True], ids=["plain", "paired"])
def test_gather_rows(paired, gen, device):
    """The Gluon GEMMs' activation rows (``common.gather_rows``): the plan's rows of hidden, zeros for the rows past
    the valid ones (-1 slots); ``paired`` (the MXFP4 kernels) with each group of 32 columns in the MMA's K order
    (``mxfp4.kernels._paired``), plain for the persistent 16-bit GEMMs."""
    x, _, _, ids = _inputs(gen, 9, 3, 4, 96, 32, invalid=0.3, device=device)
    plan = moe_dispatch(ids, 4, 16, backend="triton")
    got = gather_rows(x.t().contiguous().t(), plan, paired)  # column-major hidden: strides are honoured
    expanded = plan.permuted_to_expanded.long()
    want = torch.where((expanded >= 0)[:, None], x[expanded.clamp(min=0) // 3], 0.0)
    if paired:
        want = want.view(-1, 3, 4, 2, 4).permute(0, 1, 4, 2, 3).reshape(-1, 96)
    assert int(plan.expert_offsets[-1]) < plan.num_rows and torch.equal(got, want)


WS_SHAPE = (6, 256, 256)  # E, H, I: whole 128-deep steps and column blocks (ws_eligible)


@pytest.fixture
def triton_kernels_only(monkeypatch):
    monkeypatch.setattr(mxfp4_ws, "ws_eligible", lambda *args: False)


def _run(x, w1, w2, plan, limit, activation_quant=None):
    out = torch.full((plan.num_rows, x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    return moe_experts(x, w1, w2, plan, swiglu_limit=limit, out=out, activation_quant=activation_quant,
                       backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon kernels run on sm_90 only (CI compiles them: test_sm90.py)")
@pytest.mark.parametrize("limit", [None, 1.5], ids=["no-clamp", "clamp"])
@pytest.mark.parametrize("narrow", [False, True], ids=["wide", "narrow"])
@pytest.mark.parametrize("block_m, M", [(16, 1), (16, 6), (16, 16), (32, 40), (64, 70), (128, 150)])
def test_warp_specialized_matches_float64_and_triton(block_m, M, narrow, limit, gen, device, monkeypatch):
    """On Hopper the Gluon kernels run (``ws_eligible``), at every tile height they have a launch shape for (up to
    75 rows an expert: partial tiles), in wide and, where a height may, narrow programs (``narrow_grid``, forced
    here: these small grids would take narrow ones wherever allowed): against the float64 reference on quantized
    random weights (-1 slots, an empty expert, a NaN token), and bit for bit against the Triton kernels on random
    codes with exponents over the whole supported range (the Triton kernels' unpacking is proven exact above)."""
    if narrow and block_m not in mxfp4_ws.NARROW_HEIGHTS:
        pytest.skip("no narrow programs at this height")
    monkeypatch.setattr(mxfp4_ws, "narrow_grid", lambda programs, height, dev: narrow)
    E, H, I = WS_SHAPE
    x, w1, w2, ids = _inputs(gen, M, 3, E, H, I, empty=4, device=device)
    x[0, 70] = float("nan")
    plan = moe_dispatch(ids, E, block_m, backend="triton")
    assert mxfp4_ws.ws_eligible(x, w1, w2, plan)
    _check(x, w1, w2, ids, limit=limit, block_m=block_m)
    codes = lambda N, K: _mxfp4(torch.randint(0, 16, (E, N, K), generator=gen, dtype=torch.uint8),  # noqa: E731
                                torch.randint(LOW, HIGH + 1, (E, N, K // 32), generator=gen), device)
    w1, w2 = codes(2 * I, H), codes(H, I)
    x = (torch.randn(M, H, generator=gen) * 2.0**-60).bfloat16().to(device)  # keeps 2^1-scale weights finite
    got = _run(x, w1, w2, plan, limit)
    monkeypatch.setattr(mxfp4_ws, "ws_eligible", lambda *args: False)
    want = _run(x, w1, w2, plan, limit)
    n_valid = int(plan.expert_offsets[-1])
    assert torch.equal(got[:n_valid].nan_to_num(7.0), want[:n_valid].nan_to_num(7.0))
    assert got[n_valid:].isnan().all()


def test_narrow_programs_only_where_the_wide_grid_is_uneven(monkeypatch):
    """Narrow programs where the wide grid puts two programs on some SMs and one on others (DeepSeek-V4-Flash's
    192 at one token on 132 SMs), and on 16-row tiles only: not where it holds one an SM or less, nor more than two
    (where narrow programs measured no faster)."""
    monkeypatch.setattr(mxfp4_ws._runtime, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert [mxfp4_ws.narrow_grid(p, 16, cpu) for p in (108, 132, 133, 192, 264, 265, 416)] == [
        False, False, True, True, True, False, False]
    assert not any(mxfp4_ws.narrow_grid(192, block_m, cpu) for block_m in (32, 64, 128))
    # The launch: two narrow programs a wide one's columns.
    assert [mxfp4_ws.launch_grid(p, 16, cpu) for p in (132, 192)] == [((132,), False), ((384,), True)]
    assert mxfp4_ws.launch_grid(192, 32, cpu) == ((192,), False)


# --- W4A8: fp8 MMAs at prefill (SPEC §6) -------------------------------------------------------------------------

def _prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte j of the result is byte (selector >> 4j) & 7 of b:a."""
    pool = (a | b << 32).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[(selector >> 4 * j) & 7] for j in range(4)), "little")


def test_w4a8_conversion_constants(gen):
    """The W4A8 unpacking's constants (``mxfp4.w4a8._e4m3_asm``), decoded on the CPU: the table with 2^d added is
    the e4m3 bytes of the eight magnitudes times 2^d for every d the kernels use, and the sign permutes move bit 3
    of each code to bit 7 of its byte."""
    for d in range(mxfp4_w4a8.FLUSH_BELOW, 7):
        words = [(base + d * step) % 2**32 for base, step in zip(mxfp4_w4a8.E4M3_TABLE, mxfp4_w4a8.E4M3_STEP)]
        table = torch.tensor(list(b"".join(w.to_bytes(4, "little") for w in words)), dtype=torch.uint8)
        assert torch.equal(table.view(torch.float8_e4m3fn).double(), E2M1[:8] * 2.0**d), d
    for word in torch.randint(0, 2**31, (64,), generator=gen).tolist() + [0xFFFFFFFF, 0x88888888, 0x80000008]:
        for half, selector in enumerate(mxfp4_w4a8.SIGN_SELECTORS):
            signs = _prmt(word, (word << 4) % 2**32, selector) & 0x80808080
            assert signs == sum(((word >> (16 * half + 4 * j + 3)) & 1) << (8 * j + 7) for j in range(4))


def test_w4a8_weight_flushes_only_far_groups(gen):
    """Per row, base = max(largest exponent - 6, 1); a group more than 5 under it (more than 11 under the largest)
    is zeroed, every other kept: decoded by hand from the codes."""
    codes = torch.randint(0, 16, (1, 3, 320), generator=gen, dtype=torch.uint8)
    exps = torch.tensor([[[127, 116, 115, 120, 40, 30, 28, 29, 0, 121],  # base 121: 115 and below go
                          [5, 3, 0, 1, 6, 1, 0, 7, 2, 4],  # small: base 1, nothing goes
                          [60, 60, 60, 60, 90, 84, 78, 79, 77, 66]]], dtype=torch.uint8)  # base 84: 78 and below
    flushed = {(0, g) for g in (2, 4, 5, 6, 7, 8)} | {(2, g) for g in (0, 1, 2, 3, 6, 8, 9)}
    want = _decode(codes, exps)
    for row, group in flushed:
        want[0, row, 32 * group:32 * group + 32] = 0.0
    got = w4a8_weight(_mxfp4(codes, exps, "cpu")).dequantize(torch.float64)
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon kernels run on sm_90 only (CI compiles them: test_sm90.py)")
@pytest.mark.parametrize("limit", [None, 1.5], ids=["no-clamp", "clamp"])
@pytest.mark.parametrize("far", [False, True], ids=["exact", "flushed-groups"])
@pytest.mark.parametrize("block_m, M, narrow", [(16, 1, False), (16, 1, True), (32, 37, False), (128, 1, False),
                                                (128, 549, False), (128, 4000, False)],
                         ids=["decode-one-token", "decode-narrow", "decode-32-rows", "one-token", "an-item-a-program",
                              "items-a-program"])
@pytest.mark.parametrize("shape", [WS_SHAPE, (6, 384, 128)], ids=["even-steps", "odd-steps"])
def test_w4a8_matches_float64(shape, block_m, M, narrow, far, limit, gen, device, monkeypatch):
    """With ``activation_quant="fp8"``, at every token count, the Gluon kernels multiply e4m3 activations and
    weights: against the float64 W4A8 reference (-1 slots, an empty expert, a NaN token); ``far``: a quarter of the
    groups 12 or more under their row's largest exponent, which W4A8 flushes (the reference does the same). The
    decode kernels (16 and 32 rows, ``mxfp4/w4a8_decode.py``: activations and intermediate in word order) and the
    128-row ones; at 4,000 tokens the plan has more work items than an H200 has SMs (GEMM1 400, GEMM2 200), so the
    persistent programs run several each and their ring and row-scale buffers carry on from item to item.
    ``decode-narrow``: the decode kernels' narrow programs (forced; a token of DeepSeek-V4-Flash takes them).
    ``odd-steps``: 3 and 1 steps of 128 (the transform unpacks two steps between fences, ``TRANSFORM_STEPS``, and
    an odd last one alone)."""
    monkeypatch.setattr(mxfp4_ws, "narrow_grid", lambda programs, height, dev: narrow)
    E, H, I = shape
    x, w1, w2, ids = _inputs(gen, M, 3, E, H, I, empty=4, device=device)
    if far:
        def spread(w):
            exps = w.scales.clone()
            far_groups = torch.rand(exps.shape, generator=gen).to(device) < 0.25
            exps[far_groups] = (exps[far_groups].int() - 12 - 20 * torch.rand(int(far_groups.sum()), generator=gen)
                                .to(device)).clamp(min=0).to(torch.uint8)
            return MXFP4(w.values, exps)
        w1, w2 = spread(w1), spread(w2)
        assert not torch.equal(w4a8_weight(w1).values, w1.values)
    if M > 1:  # a NaN token beside finite ones (alone, every row would be NaN)
        x[0, 70] = float("nan")
    plan = moe_dispatch(ids, E, block_m, backend="triton")
    assert mxfp4_ws.ws_eligible(x, w1, w2, plan) and mxfp4_w4a8.fits(128, H, I)
    assert block_m == 128 or mxfp4_w4a8_decode.fits(block_m, H, I)
    out = _run(x, w1, w2, plan, limit, "fp8")
    ref = moe_experts_w4a8_torch(x, w1, w2, plan, swiglu_limit=limit, dtype=torch.float64,
                                 out=torch.zeros(plan.num_rows, H, dtype=torch.float64, device=device))
    n_valid = int(plan.expert_offsets[-1])
    # As the fp8 kernels' (test_experts_fp8.test_tall_tiles): wgmma's fp8 sums flip e4m3 roundings of the
    # intermediate; on an H200 1.5-2.3e-2 max here. A wrong scale, flush or row errs by O(1). The RMS bound is the
    # table's, widened for few rows: at one token (3 rows of I = 128) the RMS is about the max, and a GPU run met
    # 1.55e-2 (seed 500794227, odd steps, flushed groups), which the 1e-2 once written here refused.
    finite = ref[:n_valid].isfinite().all(dim=1)  # the NaN token's rows (placement checked above)
    tol, rms_tol = experts_tolerance("w4a8", block_m, int(finite.sum()))
    assert_rel_close(out[:n_valid], ref[:n_valid], tol, "w4a8 gemm2_out")
    rms = rms_rel_error(out[:n_valid][finite], ref[:n_valid][finite])
    assert rms <= rms_tol, f"w4a8 gemm2_out: RMS relative error {rms:.3e} > {rms_tol}"
    assert out[n_valid:].isnan().all(), "rows with no token must be left unwritten"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon kernels run on sm_90 only (CI compiles them: test_sm90.py)")
@pytest.mark.parametrize("block_m, narrow", [(16, False), (16, True), (32, False)], ids=["16", "16-narrow", "32"])
@pytest.mark.parametrize("shape", [WS_SHAPE, (6, 384, 128)], ids=["even-steps", "odd-steps"])
def test_w4a8_decode_kernels_give_the_128_row_bits(shape, block_m, narrow, gen, device, monkeypatch):
    """W4A8's decode kernels (``mxfp4/w4a8_decode.py``: the weights as the wgmma's first operand, from registers),
    wide and narrow (forced), and its 128-row kernels (the tokens first, both from shared memory) hand the wgmma
    each row's products in one K order (word order): every valid slot of an 11-token batch bitwise equal (-1 slots,
    an empty expert, the clamp). What W4A8's batch invariance rests on: fp8 wgmma gives a row the same sums swapped
    (``research/swap_bits.py`` measured it for 16 rows against 64), and at any row of the MMA (a narrow GEMM1
    program holds a gate row 32 rows from where a wide one does)."""
    assert block_m in mxfp4_w4a8_decode.LAUNCH and (not narrow or block_m in mxfp4_ws.NARROW_HEIGHTS)
    monkeypatch.setattr(mxfp4_ws, "narrow_grid", lambda programs, height, dev: narrow)
    E, H, I = shape
    x, w1, w2, ids = _inputs(gen, 11, 3, E, H, I, empty=2, device=device)
    slots = []
    for height in (block_m, 128):
        plan = moe_dispatch(ids, E, height, backend="triton")
        out = _run(x, w1, w2, plan, 1.5, "fp8")
        valid = plan.expanded_to_permuted.long() >= 0
        slots.append(out[plan.expanded_to_permuted.long()[valid]])
    assert slots[0].numel() > 0 and bool(slots[0].isfinite().all())
    assert torch.equal(slots[0].view(torch.int16), slots[1].view(torch.int16))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon kernels run on sm_90 only (CI compiles them: test_sm90.py)")
@pytest.mark.parametrize("shape", [WS_SHAPE, (6, 1024, 512)], ids=["a-word-a-load", "four-words-a-load"])
def test_w4a8_row_bases_are_each_rows_own(shape, gen, device):
    """Each weight row is converted against its own base (from its largest exponent, SPEC §6), which the transform
    finds per item from the item's rows: rows whose exponents sit 2^-6..2^6 apart from item to item, so a base taken
    from another row or item puts groups out of e4m3's range (flushed or overflowed, an O(1) error). GEMM1's up rows
    are shifted per 128 intermediate columns and GEMM2's groups back by as much (the intermediate's 128-column
    quantization sees one shift); GEMM2's rows are shifted one by one, and each output column is compared scaled
    back. Each row's largest exponent sits at a random group, 2 over the rest, so a row maximum that skips any of
    a row's words gets a wrong base. 4,000 tokens: several items a program (``test_w4a8_matches_float64``). With
    K/128 = 2 the row-maximum pass reads a word a load; with a multiple of 4 four words a load (``QUADS``): here 8
    in GEMM1 (the pass loops over two loads a row) and 4 in GEMM2 (one)."""
    E, H, I = shape
    M = 4000
    x, w1, w2, ids = _inputs(gen, M, 3, E, H, I, empty=4, device=device)
    up_shift = torch.randint(-6, 7, (E, I // 128), generator=gen).to(device)
    row_shift = torch.randint(-6, 7, (E, H), generator=gen).to(device)

    def peaked(scales: torch.Tensor) -> torch.Tensor:  # room below 128, the largest supported exponent
        s = scales.int() - 12
        at = torch.randint(0, s.shape[-1], (*s.shape[:-1], 1), generator=gen).to(device)
        return s.scatter(-1, at, s.amax(-1, keepdim=True) + 2)

    s1, s2 = peaked(w1.scales), peaked(w2.scales)
    s1[:, I:] += up_shift.repeat_interleave(128, dim=1)[:, :, None]
    s2 += row_shift[:, :, None] - up_shift.repeat_interleave(128 // 32, dim=1)[:, None, :]
    assert int(s1.min()) >= 0 and int(s1.max()) <= 128 and int(s2.min()) >= 0 and int(s2.max()) <= 128
    w1, w2 = MXFP4(w1.values, s1.to(torch.uint8)), MXFP4(w2.values, s2.to(torch.uint8))
    plan = moe_dispatch(ids, E, 128, backend="triton")
    assert mxfp4_ws.ws_eligible(x, w1, w2, plan) and mxfp4_w4a8.fits(128, H, I)
    out = _run(x, w1, w2, plan, None, "fp8")
    ref = moe_experts_w4a8_torch(x, w1, w2, plan, dtype=torch.float64,
                                 out=torch.zeros(plan.num_rows, H, dtype=torch.float64, device=device))
    n_valid = int(plan.expert_offsets[-1])
    row_expert = torch.repeat_interleave(torch.arange(E, device=device), plan.expert_offsets.diff())
    back = torch.exp2(-row_shift[row_expert].double())  # each output column to one scale
    tol, rms_tol = experts_tolerance("w4a8", 128, n_valid)
    assert_rel_close(out[:n_valid] * back, ref[:n_valid] * back, tol, "w4a8 gemm2_out")
    assert rms_rel_error(out[:n_valid] * back, ref[:n_valid] * back) <= rms_tol


@pytest.mark.parametrize("layout", ["inner-stride-2", "row-padded"])
@pytest.mark.parametrize("block_m, M", [(16, 3), (64, 37)])
def test_strided_hidden(layout, block_m, M, gen, device):
    """Hidden states that are views: inner stride 2 (which crashed Triton 3.6's compiler in GEMM1 on an H200 at
    every tile height; the op now hands the kernels a unit-stride copy) and rows padded past H. Widths of 32s, not
    128s (the ``tl`` kernels, also on Hopper), against float64."""
    E, H, I = 7, 160, 96
    x, w1, w2, ids = _inputs(gen, M, 2, E, H, I, device=device)
    x = torch.cat([x, x], 1)[:, ::2] if layout == "inner-stride-2" else torch.cat([x, x[:, :5]], 1)[:, :H]
    assert x.stride(1) == (2 if layout == "inner-stride-2" else 1)
    _check(x, w1, w2, ids, limit=1.5, block_m=block_m)


@pytest.mark.parametrize("activation_quant", [None, "fp8"])
def test_out_with_strided_columns(activation_quant, gen, device):
    """``out`` with inner stride 2 (rows padded too): the Gluon kernels on Hopper store rows with one stride, so the
    op hands them a contiguous copy and writes it back (found by tests/test_fuzz.py's reading of the kernels); the
    rows the experts leave unwritten keep their values. Elsewhere the ``tl`` kernels take both strides."""
    if activation_quant == "fp8" and not (device.type == "cuda" and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("W4A8 runs on sm_90 only")
    E, H, I = WS_SHAPE
    x, w1, w2, ids = _inputs(gen, 9, 2, E, H, I, device=device)
    plan = moe_dispatch(ids, E, 128 if activation_quant else 16, backend="triton")
    buf = torch.full((plan.num_rows, 2 * H + 6), float("nan"), dtype=x.dtype, device=device)
    out = buf[:, : 2 * H : 2]
    moe_experts(x, w1, w2, plan, out=out, activation_quant=activation_quant, backend="triton")
    reference = moe_experts_w4a8_torch if activation_quant else moe_experts_torch
    ref = reference(x, w1, w2, plan, dtype=torch.float64,
                    out=torch.zeros(plan.num_rows, H, dtype=torch.float64, device=device))
    n_valid = int(plan.expert_offsets[-1])
    assert_rel_close(out[:n_valid], ref[:n_valid], 5e-2 if activation_quant else 1e-2, "mxfp4 gemm2_out")
    assert buf[:, 1 : 2 * H : 2].isnan().all() and buf[:, 2 * H :].isnan().all(), "wrote between or past the columns"
    assert out[n_valid:].isnan().all(), "rows with no token must be left unwritten"


def test_activation_quant_choices(gen, device):
    """``activation_quant``: MXFP4 defaults to W4A16 at every size; "fp8" (W4A8) on the reference backend computes
    the W4A8 reference's numerics (flushed groups, e4m3 activations) on any device; precisions a format has no
    kernels for, and W4A8 where its Gluon kernels cannot run, are refused naming the argument, before a launch."""
    from moefuse.experts import plan_block_m
    from moefuse.formats import resolve_activation_quant

    E, H, I = 4, 256, 128
    x, w1, w2, ids = _inputs(gen, 5, 2, E, H, I, device=device)
    assert resolve_activation_quant(w1, "default") is None and resolve_activation_quant(w1, "fp8") == "fp8"
    # W4A8 plans: W4A16's height where a decode kernel takes it (here 16 rows), else 128 rows; batch-invariant
    # ones alike (both kernels sum in one K order)
    assert plan_block_m(5, w1, 2, x.dtype, "fp8", arch=None) == plan_block_m(5, w1, 2, x.dtype, arch=None) == 16
    assert plan_block_m(5, w1, 2, x.dtype, "fp8", arch=None, batch_invariant=True) == 16
    assert plan_block_m(4096, w1, 2, x.dtype, "fp8", arch=None) == mxfp4_w4a8.BLOCK_M
    plan = moe_dispatch(ids, E, 128, backend="triton")
    got = moe_experts(x, w1, w2, plan, activation_quant="fp8", backend="reference")
    want = moe_experts_w4a8_torch(x, w1, w2, plan)
    n = int(plan.expert_offsets[-1])
    assert torch.equal(got[:n], want[:n])
    w4a16 = moe_experts(x, w1, w2, plan, backend="reference")
    assert not torch.equal(got[:n], w4a16[:n])  # the precisions differ, so the argument is not ignored
    with pytest.raises(ValueError, match="activation_quant"):
        moe_experts(x, w1, w2, plan, activation_quant="int8")
    small = moe_dispatch(ids, E, 64, backend="triton")  # no W4A8 kernel has 64-row tiles
    if device.type == "cuda":  # the Gluon kernels take 16, 32 or 128 rows
        with pytest.raises(ValueError, match="activation_quant.*block_m"):
            moe_experts(x, w1, w2, small, activation_quant="fp8", backend="triton")
    else:  # the interpreter runs no Gluon
        with pytest.raises(ValueError, match="activation_quant.*Hopper"):
            moe_experts(x, w1, w2, plan, activation_quant="fp8", backend="triton")
    odd = _inputs(gen, 5, 2, E, 160, 96, device=device)
    with pytest.raises(ValueError, match="activation_quant.*multiples of 128"):
        moe_experts(odd[0], odd[1], odd[2], moe_dispatch(odd[3], E, 128), activation_quant="fp8", backend="triton")


# --- errors ----------------------------------------------------------------------------------------------------

class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("a kernel was launched before the arguments were checked")


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(mxfp4_kernels, "_gemm1_mxfp4_kernel", _NoLaunch())
    monkeypatch.setattr(mxfp4_kernels, "_gemm2_mxfp4_kernel", _NoLaunch())


def test_errors_name_the_argument(gen, device, no_launch):
    x, w1, w2, ids = _inputs(gen, 3, 2, 4, 64, 32, device=device)
    plan = moe_dispatch(ids, 4, 16, backend="triton")
    out = torch.full((plan.num_rows, 64), float("nan"), dtype=torch.bfloat16, device=device)
    for dtype in (torch.float16, torch.float32):
        with pytest.raises(TypeError, match="hidden"):
            moe_experts(x.to(dtype), w1, w2, plan, backend="triton")
    with pytest.raises(TypeError, match="down_proj"):
        moe_experts(x, w1, w2.dequantize(torch.bfloat16), plan, out=out, backend="triton")
    with pytest.raises(TypeError, match="down_proj"):
        moe_experts(x, w1, BlockFP8.quantize(w2.dequantize()), plan, out=out, backend="triton")
    with pytest.raises(TypeError, match="down_proj"):  # and the other way round
        moe_experts(x, BlockFP8.quantize(w1.dequantize()), w2, plan, out=out, backend="triton")
    with pytest.raises(ValueError, match="gate_up_proj"):  # H mismatch: hidden 32 wide, weights 64
        moe_experts(x[:, :32].contiguous(), w1, w2, plan, backend="triton")
    with pytest.raises(ValueError, match="down_proj"):  # I mismatch: a down projection of width 64
        moe_experts(x, w1, MXFP4.quantize(torch.randn(4, 64, 64, generator=gen)), plan, out=out, backend="triton")
    with pytest.raises(ValueError, match="plan"):  # E mismatch
        moe_experts(x, w1[:3], w2[:3], plan, out=out, backend="triton")
    assert out.isnan().all()
