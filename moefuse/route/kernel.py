"""Triton router kernel: activation, grouped selection, exact top-k and weights in one pass over the logits.

Contract of ``_fused_gate_kernel``:

- Inputs: ``scores`` [M, E] fp32/bf16/fp16, contiguous row-major (upcast to fp32 in registers); ``bias`` [E]
  fp32 when ``HAS_BIAS``; ``ntnp`` a 0-d int32/int64 tensor read when ``NTNP_FROM_PTR`` (else ``n_valid``).
- Outputs: ``weights`` fp32 [M, TOPK] and ``ids`` int32 [M, TOPK], contiguous, written once per row.
- Grid: ``cdiv(M, BLOCK_M)`` programs; program ``p`` owns rows ``[p·BLOCK_M, (p+1)·BLOCK_M)``.
- Each program holds its rows as a [BLOCK_M, GS_PAD, G_PAD] tile (column ``g·GS + j`` at ``[j, g]``, masked
  where ``g >= G`` or ``j >= GS``). Groups score by one int32 (largest, second largest) reduction over axis 1.
  Every element gets one int64 key that orders exactly as the spec orders experts (value, then lower id; NaN
  below ``-inf``), so each top-k pass is a single ``tl.max`` (group axis first, which is in-thread) plus a
  knock-out by the winner's id, read back from the key's low word.

Numerics: ``tl.exp`` is ``ex2(x·log2e)``, which carries the rounding of ``x·log2e`` into the result (relative error
growing with |x|). ``_exp`` reduces exactly first (Cody–Waite, no FMA, so the interpreter rounds alike) and
only calls ``tl.math.exp2`` on |r| <= 1/2 (MUFU.EX2 on the GPU, <= 2 ulp; numpy under the interpreter), with
2^n from exponent bits. Divisions that only scale use ``/`` (div.full, <= 2 ulp) or a reciprocal; sqrtsoftplus
keeps one ``div_rn`` and ``sqrt_rn``: it meets the spec's 1e-6 relative bound over [-100, 100] on the dense grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moefuse import _runtime

SIGMOID, SQRTSOFTPLUS, SOFTMAX = 0, 1, 2
SCORING_CODES = {"sigmoid": SIGMOID, "sqrtsoftplus": SQRTSOFTPLUS, "softmax": SOFTMAX}
MAX_EXPERTS = 1024  # E limit of the kernel: keeps a row in one program's registers
MAX_TOPK = 32  # topk limit (routed + fused shared slots)

# Cody–Waite split of ln 2: LN2_HI has 15 significant bits, so n·LN2_HI is exact for |n| < 2^9.
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2_HI = tl.constexpr(0.693145751953125)
_LN2_LO = tl.constexpr(1.4286068203094173e-06)

# Sort keys (``_key``): the high word is the fp32 value mapped to an int32 that orders like the float; the low
# word is 0x7FFFFFFF - index, so among equal values the lower index has the larger key.
_MONO_NAN = tl.constexpr(-2139095042)  # one below the image of -inf (0x807FFFFF); decodes to a NaN pattern
_MONO_MIN = tl.constexpr(-(2**31))  # padding in int32 value reductions: below every real value's image
_KEY_MIN = tl.constexpr(-(2**63))  # padding and knocked-out positions: below every real key
# (Constexpr globals stay on the right of operators: the interpreter cannot apply them to a tensor on the left.)


@triton.jit
def _pow2(k):
    """2^k for int32 k in [-126, 127], built from exponent bits."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exp_reduced(y):
    """Split e^y = (1 + q)·2^n with |r| <= ln2/2: returns q = e^r - 1 (degree-7 Taylor, error < 1e-8) and n."""
    n = tl.floor(y * _LOG2E + 0.5)
    r = y - n * _LN2_HI  # exact
    r = r - n * _LN2_LO
    # Horner from 1/7! down to 1/1!
    p = 0.0001984126984126984
    p = 0.001388888888888889 + r * p
    p = 0.008333333333333333 + r * p
    p = 0.041666666666666664 + r * p
    p = 0.16666666666666666 + r * p
    p = 0.5 + r * p
    q = r * (1.0 + r * p)
    return q, n.to(tl.int32)


@triton.jit
def _exp(y):
    """fp32 e^y within ~3e-7 relative for every y; inf above ~88.7, subnormal results rounded once, 0 below ~-104.

    Cody–Waite: y = n·ln2 + r exactly (|r| <= ln2/2, no FMA needed, so the interpreter rounds alike), then
    e^r = 2^(r·log2e) by ``tl.math.exp2`` (one MUFU.EX2 on the GPU, at most 2 ulp; the argument's own
    rounding costs < 3e-8 since |r·log2e| <= 1/2) and 2^n from exponent bits in two steps, so that neither
    factor leaves the normal range: ex2's flush-to-zero never sees a subnormal result.
    """
    yc = tl.clamp(y, -110.0, 89.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN through every step
    n = tl.floor(yc * _LOG2E + 0.5)
    r = yc - n * _LN2_HI  # exact
    r = r - n * _LN2_LO
    k = n.to(tl.int32)  # in [-159, 128]
    k1 = k >> 1
    return (tl.math.exp2(r * _LOG2E) * _pow2(k1)) * _pow2(k - k1)


@triton.jit
def _expm1_neg(y):
    """Accurate e^y - 1 for y <= 0 (no cancellation near 0): (e^r - 1)·2^n + (2^n - 1)."""
    q, n = _exp_reduced(tl.maximum(y, -30.0))  # below -30 the result rounds to -1
    p = _pow2(n)
    return tl.where(y != y, y, q * p + (p - 1.0))


@triton.jit
def _tanh(u):
    """Sign-symmetric tanh: tanh|u| = -m/(2+m) with m = expm1(-2|u|), accurate near 0 as well."""
    m = _expm1_neg(-2.0 * tl.abs(u))
    t = tl.math.div_rn(-m, 2.0 + m)
    return tl.where(u < 0, -t, t)


@triton.jit
def _sigmoid(x):
    """1/(1+e^-x) for x >= 0, e^x/(1+e^x) for x < 0: one exp, never overflows, accurate in both tails."""
    z = _exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0, z) / (1.0 + z)  # div.full: 2 ulp, a third of div_rn's instructions


@triton.jit
def _sqrtsoftplus(x):
    """sqrt(softplus(x)) within 1e-6 relative of float64 for every x (spec requirement on [-100, 100]).

    With z = e^-|x| and L = log1p(z)/z: x >= 0 gives sqrt(x + z·L); x < 0 gives e^(x/2)·sqrt(L), which never
    forms the (possibly subnormal) softplus itself. L = 2/(2+z)·(1 + t²/3 + t⁴/5 + ...), t = z/(2+z) <= 1/3,
    truncated after t^14 (error < 2e-9).
    """
    h = _exp(-0.5 * tl.abs(x))  # e^(-|x|/2)
    z = h * h  # e^-|x|; its rounding in the subnormal range only touches L's 1 - z/2
    rd = tl.math.div_rn(1.0, 2.0 + z)  # one correctly rounded reciprocal serves both quotients below
    t = z * rd
    t2 = t * t
    series = 0.06666666666666667  # Horner from 1/15 down to 1/1
    series = 0.07692307692307693 + t2 * series
    series = 0.09090909090909091 + t2 * series
    series = 0.1111111111111111 + t2 * series
    series = 0.14285714285714285 + t2 * series
    series = 0.2 + t2 * series
    series = 0.3333333333333333 + t2 * series
    series = 1.0 + t2 * series
    log1p_over_z = (2.0 * series) * rd
    pos = tl.sqrt_rn(tl.maximum(x, 0.0) + z * log1p_over_z)  # max() only keeps the unused x < 0 lanes quiet
    neg = h * tl.sqrt_rn(log1p_over_z)
    return tl.where(x >= 0, pos, neg)  # NaN takes the second branch and stays NaN


@triton.jit
def _activate(x, row_max, row_sum, softcap, SCORING: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Activation of logits ``x`` (fp32); for softmax ``row_max``/``row_sum`` broadcast against ``x``."""
    if SCORING == 0:
        a = _sigmoid(x)
    elif SCORING == 1:
        a = _sqrtsoftplus(x)
    else:
        if HAS_SOFTCAP:
            x = softcap * _tanh(tl.math.div_rn(x, softcap))
        a = _exp(x - row_max) * (1.0 / row_sum)
    return a


@triton.jit
def _mono(v):
    """int32 that orders like the fp32 ``v``, NaN mapped just below -inf.

    -0.0 would land just below +0.0, but keys are never -0.0: ``a >= +0`` and ``+0 + -0 = +0``.
    """
    bits = v.to(tl.int32, bitcast=True)
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(v != v, _MONO_NAN, mono)


@triton.jit
def _unmono(m):
    """fp32 value of a ``_mono`` image (the map is its own inverse)."""
    return (m ^ ((m >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _top2(a1, a2, b1, b2):
    """Combine two (largest, second largest) pairs, counting a value held by both sides twice."""
    return tl.maximum(a1, b1), tl.maximum(tl.minimum(a1, b1), tl.maximum(a2, b2))


@triton.jit
def _key(value, index):
    """int64 key of (fp32 value, int32 index): larger value first, then lower index; NaN below -inf."""
    return (_mono(value).to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _key_index(key):
    """int32 index of a key."""
    return 0x7FFFFFFF - key.to(tl.int32)


@triton.jit
def _fused_gate_kernel(
    scores_ptr,
    bias_ptr,
    ntnp_ptr,
    weights_ptr,
    ids_ptr,
    M,
    n_valid,
    routed_scaling_factor,
    softcap,
    E: tl.constexpr,
    G: tl.constexpr,
    GS: tl.constexpr,
    G_PAD: tl.constexpr,
    GS_PAD: tl.constexpr,
    TOPK: tl.constexpr,
    K_R: tl.constexpr,
    K_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE_OUTPUT: tl.constexpr,
    NTNP_FROM_PTR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    row_off = rows.to(tl.int64) * E
    # [BLOCK_M, GS_PAD, G_PAD]: Triton's coalescing puts the lanes along the contiguous axis (j), so each thread
    # holds one member of every group and whole-row reductions must reduce the group axis (in-thread) first.
    j3 = tl.arange(0, GS_PAD)[None, :, None]
    g3 = tl.arange(0, G_PAD)[None, None, :]
    col = g3 * GS + j3  # expert id of each tile position, [1, GS_PAD, G_PAD]
    col_ok = (g3 < G) & (j3 < GS)

    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(scores_ptr + row_off[:, None, None] + col, mask=row_ok[:, None, None] & col_ok, other=0.0)
    x = x.to(tl.float32)
    if HAS_BIAS:
        b = tl.load(bias_ptr + col, mask=col_ok, other=0.0)
    if NTNP_FROM_PTR:
        n_valid = tl.load(ntnp_ptr).to(tl.int32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    # ---- activation a and selection key s = a + bias --------------------------------------------------------
    row_max = tl.zeros([BLOCK_M], dtype=tl.float32)  # used by softmax only
    row_sum = tl.full([BLOCK_M], 1.0, tl.float32)
    if SCORING == 2:
        if HAS_SOFTCAP:
            x = softcap * _tanh(tl.math.div_rn(x, softcap))
        xm = tl.where(col_ok, x, float("-inf"))
        # tl.max's NaN behaviour differs between GPU and interpreter: take the max of the rest and then make
        # it NaN explicitly when the row holds a NaN, as torch.amax does.
        row_nan = tl.max(tl.max((xm != xm).to(tl.int32), axis=2), axis=1)
        row_max = tl.max(tl.max(tl.where(xm != xm, float("-inf"), xm), axis=2), axis=1)
        row_max = tl.where(row_nan > 0, float("nan"), row_max)
        e = tl.where(col_ok, _exp(xm - row_max[:, None, None]), 0.0)
        row_sum = tl.sum(tl.sum(e, axis=2), axis=1)
        a = e * (1.0 / row_sum)[:, None, None]  # monotone in e, so ranking is unchanged; <= 1.5 ulp
    else:
        a = _activate(x, row_max, row_sum, softcap, SCORING, False)
    s = a + b if HAS_BIAS else a

    key = tl.where(col_ok, _key(s, col), _KEY_MIN)

    # ---- grouped selection: group score = sum of the two largest keys; keep the TOPK_GROUP best groups -----
    if G > 1:
        v = tl.where(col_ok, _mono(s), _MONO_MIN)
        if GS > 1:
            # one reduction of (largest, second largest) int32 pairs: a repeated value survives as both
            first, second = tl.reduce((v, tl.full(v.shape, _MONO_MIN, tl.int32)), 1, _top2)  # [BLOCK_M, G_PAD]
            gscore = _unmono(first) + _unmono(second)
        else:
            gscore = _unmono(tl.max(v, axis=1))
        g2 = tl.arange(0, G_PAD)[None, :]
        gkey = tl.where(g2 < G, _key(gscore, g2), _KEY_MIN)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gkey, axis=1)
            gkey = tl.where(gkey == best[:, None], _KEY_MIN, gkey)
        kept = (gkey == _KEY_MIN) & (g2 < G)  # real groups never start at _KEY_MIN
        key = tl.where(col_ok, _key(tl.where(kept[:, None, :], s, float("-inf")), col), _KEY_MIN)

    # ---- exact top-K_R: one int64 max per slot (group axis first: in-thread), then knock the winner
    # out by its id: a 32-bit compare, where comparing whole keys costs two ----------------------------------
    kk = tl.arange(0, K_PAD)[None, :]
    ids = tl.zeros([BLOCK_M, K_PAD], dtype=tl.int32)
    for k in tl.static_range(K_R):
        idx = _key_index(tl.max(tl.max(key, axis=2), axis=1))
        key = tl.where(col == idx[:, None, None], _KEY_MIN, key)
        ids = tl.where(kk == k, idx[:, None], ids)

    # ---- weights: recompute a at the chosen ids (the row is in L1/L2), fused shared slots, scaling --------------
    routed = kk < K_R
    xk = tl.load(scores_ptr + row_off[:, None] + ids, mask=row_ok[:, None] & routed, other=0.0).to(tl.float32)
    w = _activate(xk, row_max[:, None], row_sum[:, None], softcap, SCORING, HAS_SOFTCAP)
    w = tl.where(routed, w, 0.0)
    routed_sum = tl.sum(w, axis=1)[:, None]
    is_shared = (kk >= K_R) & (kk < TOPK)
    w = tl.where(is_shared, tl.math.div_rn(routed_sum, routed_scaling_factor), w)
    ids = tl.where(is_shared, E + kk - K_R, ids)
    if RENORMALIZE:
        w = tl.math.div_rn(w, tl.where(routed_sum > 0, routed_sum, 1.0))
    if SCALE_OUTPUT:
        w = w * routed_scaling_factor
    padded = (rows >= n_valid)[:, None]
    w = tl.where(padded, 0.0, w)
    ids = tl.where(padded, -1, ids)

    out_off = rows.to(tl.int64)[:, None] * TOPK + kk
    out_mask = row_ok[:, None] & (kk < TOPK)
    tl.store(weights_ptr + out_off, w, mask=out_mask)
    tl.store(ids_ptr + out_off, ids, mask=out_mask)


def launch_config(num_tokens: int, num_experts: int, num_expert_group: int = 1) -> tuple[int, int]:
    """``(BLOCK_M, num_warps)`` for a router launch: rows per program and warps per program.

    Always one warp: a multi-warp tile reduces across warps through shared memory with barriers on every
    top-k pass, and a sweep on one H200 (scripts/sweep_router.py, CUDA-graph replay, M = 8192) found
    (rows, warps) = (4, 4) at 33.7 µs against (1, 1) at 18.9 µs for 256 experts top-8; 1-warp shapes won at
    every size measured (M = 1: (1, 1) 2.96 µs, (2, 4) 3.97 µs). One row per program below 4096 tokens (short
    programs, lowest latency); from 4096 tokens up to 512 keys per program (16 per thread): 2 rows for 256
    experts (DSV3 grouped 25.2 µs against 25.8 for one row; DSV4 sqrtsoftplus 19.5), 4 for 128 (Qwen3 softmax
    12.7 against 13.7), one row from 384 experts up (Kimi-K2 24.0). Those numbers are for the previous kernel
    body; the shape rule is what they support.
    """
    tile = _pow2_at_least(num_expert_group) * _pow2_at_least(num_experts // num_expert_group)
    block_m = max(1, min(4, 512 // tile)) if num_tokens >= 4096 else 1
    return block_m, 1


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fused_gate(
    scores: torch.Tensor,
    bias: torch.Tensor | None,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    scoring_func: str,
    num_fused_shared_experts: int,
    renormalize: bool,
    routed_scaling_factor: float,
    apply_routed_scaling_factor_on_output: bool,
    num_expert_group: int,
    topk_group: int,
    moe_softcapping: float,
    num_token_non_padded: torch.Tensor | None,
    n_valid: int,
) -> None:
    """Launch the router kernel, writing ``weights``/``ids`` (already validated, contiguous, [M, topk]).

    ``num_token_non_padded`` is a 0-d device tensor read inside the kernel (no host sync), or None, in which
    case rows at or past ``n_valid`` (a host int in [0, M]) are padding.
    """
    M, E = scores.shape
    topk = weights.shape[1]
    if M == 0:
        return
    scores = scores.contiguous()
    block_m, num_warps = launch_config(M, E, num_expert_group)
    gs = E // num_expert_group
    extra = {}
    if _runtime.pdl_enabled(None, scores.device):
        extra["launch_pdl"] = True
    _fused_gate_kernel[(triton.cdiv(M, block_m),)](
        scores,
        bias if bias is not None else scores,
        num_token_non_padded if num_token_non_padded is not None else scores,
        weights,
        ids,
        M,
        n_valid,
        float(routed_scaling_factor),
        float(moe_softcapping),
        E=E,
        G=num_expert_group,
        GS=gs,
        G_PAD=_pow2_at_least(num_expert_group),
        GS_PAD=_pow2_at_least(gs),
        TOPK=topk,
        K_R=topk - num_fused_shared_experts,
        K_PAD=_pow2_at_least(topk),
        TOPK_GROUP=topk_group,
        SCORING=SCORING_CODES[scoring_func],
        HAS_SOFTCAP=scoring_func == "softmax" and moe_softcapping > 0,
        HAS_BIAS=bias is not None,
        RENORMALIZE=bool(renormalize),
        SCALE_OUTPUT=bool(apply_routed_scaling_factor_on_output),
        NTNP_FROM_PTR=num_token_non_padded is not None,
        BLOCK_M=block_m,
        USE_PDL="launch_pdl" in extra,
        num_warps=num_warps,
        **extra,
    )
