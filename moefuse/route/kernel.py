"""Triton router kernel: activation, grouped selection, exact top-k and weights in one pass over the logits.

Contract of ``_fused_gate_kernel``:

- Inputs: ``scores`` [M, E] fp32/bf16/fp16, contiguous row-major (upcast to fp32 in registers); ``bias`` [E]
  fp32 when ``HAS_BIAS``; ``ntnp`` a 0-d int32/int64 tensor read when ``NTNP_FROM_PTR`` (else ``n_valid``).
- Outputs: ``weights`` fp32 [M, TOPK] and ``ids`` int32 [M, TOPK], contiguous, written once per row.
- Grid: ``cdiv(M, BLOCK_M)`` programs; program ``p`` owns rows ``[p·BLOCK_M, (p+1)·BLOCK_M)``.
- Slots: lane ``l`` of the program's warp holds NC consecutive padded positions ``p = l·NC + c`` of each row
  (``p = g·GS_PAD + j`` for expert ``g·GS + j`` when grouped, the expert id itself when not; masked where no
  expert sits), as a tuple of NC [BLOCK_M, 32] tensors (loaded as vectors) in the warp that owns the row. So every
  thread's slots lie in one group (or hold whole groups) and the lanes are in expert order.
- Every slot gets one int64 key that orders exactly as the spec orders experts (value, then lower id; NaN below
  ``-inf``). Each thread sorts its keys in registers with a sorting network (``_sort_network``: Batcher's
  odd-even merge sort, pruned to the comparators the first K_R outputs need).
- Grouped selection: the network first sorts runs of ``RUN = min(NC, GS_PAD)`` slots, so each run's first
  two keys are its top-2; a butterfly over the group's lanes gives the group score, ``TOPK_GROUP`` passes of
  int32 ``tl.max``/``tl.min`` over the lanes pick the groups (lower group wins ties), dropped runs are reset
  to their (sorted) keys ``(-inf, id)``, and the rest of the network merges the runs.
- Top-k: pass k takes the row's best list head by two int32 warp reductions (REDUX on sm_90): the max of the
  value words, then the max of the index words among the heads holding it. Only the winning thread shifts
  its list up, and only the positions a later pass can still read.

Numerics: ``tl.exp`` is ``ex2(x·log2e)``, which carries the rounding of ``x·log2e`` into the result (relative error
growing with |x|). ``_exp`` reduces exactly first (Cody–Waite, no FMA, so the interpreter rounds alike) and
only calls ``tl.math.exp2`` on |r| <= 1/2 (MUFU.EX2 on the GPU, <= 2 ulp; numpy under the interpreter), with
2^n from exponent bits. Divisions that only scale use ``/`` (div.full, <= 2 ulp) or a reciprocal; sqrtsoftplus
refines its reciprocal and ``rsqrt`` by one Newton step each: 2.3e-7 relative at most over 4M points of
[-100, 100] on an H200 (the spec's bound is 1e-6), with no branch to a slow path.
"""

from __future__ import annotations

import functools

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
    truncated after t^14 (error < 2e-9). The reciprocal and the square root are hardware approximations
    refined by one Newton step each (FMA residuals): as accurate as ``div_rn``/``sqrt_rn`` to within an ulp,
    without their branches to a slow path, which serialised the 8 keys per thread.
    """
    h = _exp(-0.5 * tl.abs(x))  # e^(-|x|/2)
    z = h * h  # e^-|x|; its rounding in the subnormal range only touches L's 1 - z/2
    d = 2.0 + z
    rd = 1.0 / d  # div.full (<= 2 ulp), then one Newton step on the exact residual: <= 1 ulp, no slow path
    rd = tl.fma(rd, tl.fma(-d, rd, 1.0), rd)
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
    # One square root serves both signs: y > 0 always (x + z·L >= log 2 for x >= 0, L > 0.69 for x < 0).
    y = tl.where(x >= 0, x + z * log1p_over_z, log1p_over_z)
    r = tl.math.rsqrt(y)  # MUFU.RSQ, then one Newton step on the exact residual: <= 1 ulp, no slow path
    root = y * r
    root = tl.fma(tl.fma(-root, root, y), 0.5 * r, root)
    root = tl.where(y == float("inf"), y, root)  # rsqrt(inf) = 0 would give inf·0
    return tl.where(x >= 0, root, h * root)  # NaN takes the second branch and stays NaN


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
def _hi(key):
    """The ``_mono`` image of a key's value (its high word)."""
    return (key >> 32).to(tl.int32)


@triton.jit
def _set(t, i: tl.constexpr, v):
    """Tuple ``t`` with item ``i`` replaced by ``v``."""
    return t[:i] + (v,) + t[i + 1:]


@triton.jit
def _sort(keys, NET: tl.constexpr):
    """Run the comparators ``NET = (i0, j0, i1, j1, ...)`` (i < j) over a tuple of keys: the larger goes to i."""
    for t in tl.static_range(len(NET) // 2):
        a = keys[NET[2 * t]]
        b = keys[NET[2 * t + 1]]
        hi = tl.where(a > b, a, b)
        # the smaller by xor: a second select would be rewritten as a min with its own (64-bit) compare
        keys = _set(_set(keys, NET[2 * t], hi), NET[2 * t + 1], a ^ b ^ hi)
    return keys


@triton.jit
def _column(p, G: tl.constexpr, GS: tl.constexpr, GS_PAD: tl.constexpr):
    """Expert id of padded position ``p`` (g·GS_PAD + j when grouped, the id itself when not)."""
    if G > 1:
        p = (p // GS_PAD) * GS + p % GS_PAD
    return p


@triton.jit
def _valid(p, E: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, GS_PAD: tl.constexpr):
    """Whether padded position ``p`` holds an expert."""
    if G > 1:
        ok = (p // GS_PAD < G) & (p % GS_PAD < GS)
    else:
        ok = p < E
    return ok


@triton.jit
def _slots(x, VEC: tl.constexpr):
    """The VEC (1, 2 or 4) slices ``x[:, :, t]`` of ``x`` [A, 32, VEC] as a tuple: free, the axis is in-thread."""
    if VEC == 1:
        out = (tl.reshape(x, [x.shape[0], x.shape[1]]),)
    elif VEC == 2:
        a, b = tl.split(x)
        out = (a, b)  # type: ignore[assignment]
    else:
        even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], 2, 2]))  # t = (0, 2) and (1, 3)
        a, c = tl.split(even)
        b, d = tl.split(odd)
        out = (a, b, c, d)  # type: ignore[assignment]
    return out


@triton.jit
def _load_scores(ptrs, mask, run_stride, RUNS: tl.constexpr):
    """fp32 scores at ``ptrs``: with RUNS > 1 the runs' partial sums, RUNS [M, E] blocks ``run_stride`` apart,
    added in run order, ((p0 + p1) + p2) + ..., as ``route.linear``'s run sum adds them."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for r in tl.static_range(1, RUNS):
        x += tl.load(ptrs + r * run_stride, mask=mask, other=0.0)
    return x


# Integers that vary with the token count are not specialised: no new variant per batch size (moefuse.warmup).
@triton.jit(do_not_specialize=["M", "n_valid"])
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
    GS_PAD: tl.constexpr,
    NC: tl.constexpr,
    RUN: tl.constexpr,
    VEC: tl.constexpr,
    SORT_RUNS: tl.constexpr,
    SORT_MERGE: tl.constexpr,
    TOPK: tl.constexpr,
    K_R: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE_OUTPUT: tl.constexpr,
    NTNP_FROM_PTR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr,
    RUNS: tl.constexpr,
    UNIT_SHARED: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    run_stride = M.to(tl.int64) * E  # between the runs' partial sums (RUNS > 1)
    row_ok = rows < M
    row_off = rows.to(tl.int64) * E
    # Slot c of lane l is padded position p = l·NC + c: a thread holds NC consecutive positions, so its slots
    # fall in one group (or hold whole groups), and lanes in expert order.
    lane = tl.arange(0, 32)[None, :]
    cols = ()
    oks = ()
    for c in tl.static_range(NC):
        cols = cols + (_column(lane * NC + c, G, GS, GS_PAD),)  # type: ignore[assignment]
        oks = oks + (_valid(lane * NC + c, E, G, GS, GS_PAD),)  # type: ignore[assignment]

    # loads of VEC consecutive slots per thread, vectorised, then split into slots. The tile is [32, BLOCK_M, VEC]
    # and permuted after the load: Triton's coalescing orders equally strided axes by position, and the lanes
    # must come first (rows first would cost a layout conversion per slot).
    p3 = tl.arange(0, 32)[:, None, None] * NC + tl.arange(0, VEC)[None, None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    xs = ()
    bs = ()
    for v in tl.static_range(NC // VEC):
        col3 = _column(p3 + v * VEC, G, GS, GS_PAD)
        ok3 = _valid(p3 + v * VEC, E, G, GS, GS_PAD)
        x3 = _load_scores(scores_ptr + row_off[None, :, None] + col3, row_ok[None, :, None] & ok3, run_stride, RUNS)
        xs = xs + _slots(tl.permute(x3, (1, 0, 2)), VEC)
        if HAS_BIAS:
            bs = bs + _slots(tl.permute(tl.load(bias_ptr + col3, mask=ok3, other=0.0), (1, 0, 2)), VEC)
    if NTNP_FROM_PTR:
        n_valid = tl.load(ntnp_ptr).to(tl.int32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    # ---- activation a and selection key s = a + bias, one int64 key per slot --------------------------------
    row_max = tl.zeros([BLOCK_M], dtype=tl.float32)  # used by softmax only
    row_sum = tl.full([BLOCK_M], 1.0, tl.float32)
    if SCORING == 2:
        # tl.max's NaN behaviour differs between GPU and interpreter: take the max of the rest and then make
        # it NaN explicitly when the row holds a NaN, as torch.amax does.
        lane_nan = tl.zeros([BLOCK_M, 32], dtype=tl.int32)
        lane_max = tl.full([BLOCK_M, 32], float("-inf"), tl.float32)
        for c in tl.static_range(NC):
            x = xs[c]  # type: ignore[var-annotated]
            if HAS_SOFTCAP:
                x = softcap * _tanh(tl.math.div_rn(x, softcap))
            x = tl.where(oks[c], x, float("-inf"))
            xs = _set(xs, c, x)
            lane_nan = tl.maximum(lane_nan, (x != x).to(tl.int32))
            lane_max = tl.maximum(lane_max, tl.where(x != x, float("-inf"), x))
        row_max = tl.max(lane_max, axis=1)
        row_max = tl.where(tl.max(lane_nan, axis=1) > 0, float("nan"), row_max)
        lane_sum = tl.zeros([BLOCK_M, 32], dtype=tl.float32)  # in slot order, as Triton sums in-thread
        for c in tl.static_range(NC):
            xs = _set(xs, c, tl.where(oks[c], _exp(xs[c] - row_max[:, None]), 0.0))
            lane_sum = lane_sum + xs[c]
        row_sum = tl.sum(lane_sum, axis=1)
    keys = ()
    for c in tl.static_range(NC):
        if SCORING == 2:
            a = xs[c] * (1.0 / row_sum)[:, None]  # monotone in e, so ranking is unchanged; <= 1.5 ulp
        else:
            a = _activate(xs[c], row_max, row_sum, softcap, SCORING, False)
        s = a + bs[c] if HAS_BIAS else a
        keys = keys + (tl.where(oks[c], _key(s, cols[c]), _KEY_MIN),)  # type: ignore[assignment]

    # ---- per-thread sort: each run of RUN slots in descending key order (the whole thread when G == 1) -----
    keys = _sort(keys, SORT_RUNS)

    # ---- grouped selection: group score = sum of the two largest keys; keep the TOPK_GROUP best groups -----
    if G > 1:
        # A run's first two keys are its largest; a group spans GS_PAD // RUN lanes, whose pairs are combined.
        LG: tl.constexpr = GS_PAD // RUN
        gks = ()
        gids = ()
        for r in tl.static_range(NC // RUN):
            first = _hi(keys[r * RUN])
            if RUN > 1:
                second = _hi(keys[r * RUN + 1])
            else:
                second = tl.full(first.shape, _MONO_MIN, tl.int32)
            if LG > 1:
                first, second = tl.reduce((tl.reshape(first, [BLOCK_M, 32 // LG, LG]),
                                           tl.reshape(second, [BLOCK_M, 32 // LG, LG])), 2, _top2)
                first = tl.reshape(tl.broadcast_to(first[:, :, None], [BLOCK_M, 32 // LG, LG]), [BLOCK_M, 32])
                second = tl.reshape(tl.broadcast_to(second[:, :, None], [BLOCK_M, 32 // LG, LG]), [BLOCK_M, 32])
            gscore = _unmono(first) + _unmono(second) if GS > 1 else _unmono(first)
            gid = (lane * NC + r * RUN) // GS_PAD
            gks = gks + (tl.where(gid < G, _mono(gscore), _MONO_MIN),)  # type: ignore[assignment]
            gids = gids + (gid,)  # type: ignore[assignment]
        # one int32 max per kept group, then the lowest group id holding it; the chosen group drops to _MONO_MIN
        for _ in tl.static_range(TOPK_GROUP):
            m = gks[0]  # type: ignore[misc]
            for r in tl.static_range(1, NC // RUN):
                m = tl.maximum(m, gks[r])
            m = tl.max(m, axis=1)[:, None]
            best = tl.where(gks[0] == m, gids[0], G)  # type: ignore[misc]
            for r in tl.static_range(1, NC // RUN):
                best = tl.minimum(best, tl.where(gks[r] == m, gids[r], G))
            best = tl.min(best, axis=1)[:, None]
            for r in tl.static_range(NC // RUN):
                gks = _set(gks, r, tl.where(gids[r] == best, _MONO_MIN, gks[r]))
        # dropped groups' experts get key (-inf, id): their runs become the (sorted) slot order
        for c in tl.static_range(NC):
            kept = (gks[c // RUN] == _MONO_MIN) & (gids[c // RUN] < G)  # real groups never start at _MONO_MIN
            dropped = tl.where(oks[c], _key(tl.full(cols[c].shape, float("-inf"), tl.float32), cols[c]), _KEY_MIN)
            keys = _set(keys, c, tl.where(kept, keys[c], dropped))

    # ---- merge the runs: each thread's first min(NC, K_R) keys in descending order -------------------------
    keys = _sort(keys, SORT_MERGE)

    # ---- exact top-K_R: the best list head is one int32 max of the value words, then one int32 max of the index
    # words among the heads holding it (both REDUX); the winning thread shifts its list up -----------------------
    ids = tl.zeros([BLOCK_M, 32], dtype=tl.int32)  # slot k in lane k (TOPK <= 32): the layout of the keys
    for k in tl.static_range(K_R):
        hi = _hi(keys[0])
        lo = keys[0].to(tl.int32)
        m = tl.max(hi, axis=1)[:, None]
        best = tl.max(tl.where(hi == m, lo, -1), axis=1)[:, None]
        win = lo == best
        for i in tl.static_range(NC):
            if i < K_R - 1 - k:  # positions a later pass can still read
                if i + 1 < NC:
                    keys = _set(keys, i, tl.where(win, keys[i + 1], keys[i]))
                else:
                    keys = _set(keys, i, tl.where(win, _KEY_MIN, keys[i]))
        ids = tl.where(lane == k, 0x7FFFFFFF - best, ids)

    # ---- weights: recompute a at the chosen ids (the row is in L1/L2), fused shared slots, scaling --------------
    routed = lane < K_R
    xk = _load_scores(scores_ptr + row_off[:, None] + ids, row_ok[:, None] & routed, run_stride, RUNS)
    w = _activate(xk, row_max[:, None], row_sum[:, None], softcap, SCORING, HAS_SOFTCAP)
    w = tl.where(routed, w, 0.0)
    routed_sum = tl.sum(w, axis=1)[:, None]
    is_shared = (lane >= K_R) & (lane < TOPK)
    w = tl.where(is_shared, tl.math.div_rn(routed_sum, routed_scaling_factor), w)
    ids = tl.where(is_shared, E + lane - K_R, ids)
    if RENORMALIZE:
        w = tl.math.div_rn(w, tl.where(routed_sum > 0, routed_sum, 1.0))
    if SCALE_OUTPUT:
        w = w * routed_scaling_factor
    if UNIT_SHARED:
        w = tl.where(is_shared, 1.0, w)
    padded = (rows >= n_valid)[:, None]
    w = tl.where(padded, 0.0, w)
    ids = tl.where(padded, -1, ids)

    out_off = rows.to(tl.int64)[:, None] * TOPK + lane
    out_mask = row_ok[:, None] & (lane < TOPK)
    tl.store(weights_ptr + out_off, w, mask=out_mask)
    tl.store(ids_ptr + out_off, ids, mask=out_mask)


def launch_config(num_tokens: int, num_experts: int, num_expert_group: int = 1) -> tuple[int, int]:
    """``(BLOCK_M, num_warps)`` for a router launch: rows per program and warps per program.

    Always one warp: the kernel spreads a row over the 32 lanes of one warp, so a multi-row program only adds
    independent work per thread (overlap), never shorter chains. One row per program below 4096 tokens
    (shortest latency). Above, the rows a program takes are what a sweep of launch shapes on one H200 picked
    (``scripts/sweep_router.py``, CUDA-graph replay; the figures are in docs/PERF-NOTES.md): up to 128 experts, 4
    rows at M = 4096 and 2 from 8192; 256 experts, one row at 4096 and 2 from 8192; one row from 384 experts up.
    Only gaps well above the sweep's run-to-run noise (a few tenths of a µs) shaped the rule.
    """
    del num_expert_group  # the padded row width decides, grouped or not
    width = _pow2_at_least(num_experts)
    if num_tokens < 4096 or width > 256:
        return 1, 1
    if width <= 128:
        return (4 if num_tokens < 8192 else 2), 1
    return (1 if num_tokens < 8192 else 2), 1


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _sort_network(n: int, run: int, keep: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Comparators of Batcher's odd-even merge sort of ``n`` keys (descending), as flat ``(i0, j0, i1, j1, ...)``.

    Returns ``(runs, merge)``: ``runs`` sorts each run of ``run`` consecutive keys, ``merge`` merges the sorted
    runs. Only comparators that reach the first ``keep`` outputs are kept, and, when ``run > 1``, the first two
    keys of every run after ``runs`` (the group top-2). Padding past ``n`` would hold the smallest key, so its
    comparators do nothing and are left out.
    """
    size = _pow2_at_least(n)
    comparators = []  # (p, i, j): the merge of sorted blocks of p into blocks of 2p
    p = 1
    while p < size:
        k = p
        while k:
            for j in range(k % p, size - k, 2 * k):
                for i in range(j, min(j + k, size - k)):
                    if i // (2 * p) == (i + k) // (2 * p) and i + k < n:
                        comparators.append((p, i, i + k))
            k //= 2
        p *= 2
    live = set(range(min(keep, n)))
    runs: list[tuple[int, int]] = []
    merge: list[tuple[int, int]] = []
    for p, i, j in reversed(comparators):
        if p < run and not runs:  # entering the run sort: the group top-2 reads every run's first two keys
            live |= {h for r in range(0, n, run) for h in (r, r + 1) if h < n}
        if i in live or j in live:
            live |= {i, j}
            (runs if p < run else merge).append((i, j))
    return tuple(x for c in reversed(runs) for x in c), tuple(x for c in reversed(merge) for x in c)


def gate_constexprs(
    E: int,
    topk: int,
    num_fused_shared_experts: int,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str,
    *,
    has_softcap: bool,
    has_bias: bool,
    renormalize: bool,
    scale_output: bool,
    ntnp_from_ptr: bool,
    block_m: int,
    use_pdl: bool,
    runs: int = 1,
    unit_shared: bool = False,
) -> dict:
    """The compile-time arguments of ``_fused_gate_kernel`` for one router problem (also used by
    ``scripts/sass.py router``)."""
    G = num_expert_group
    gs = E // G
    gs_pad = _pow2_at_least(gs)
    if G > 1:  # padded positions g·GS_PAD + j, so that groups align with threads
        nc = max(1, _pow2_at_least(G) * gs_pad // 32)
        run = min(nc, gs_pad)
    else:
        nc, run = -(-E // 32), 1
    k_r = topk - num_fused_shared_experts
    sort_runs, sort_merge = _sort_network(nc, run, k_r)
    return dict(
        E=E,
        G=G,
        GS=gs,
        GS_PAD=gs_pad,
        NC=nc,
        RUN=run,
        VEC=4 if nc % 4 == 0 else 2 if nc % 2 == 0 else 1,  # slots per vector load (16 bytes of fp32)
        SORT_RUNS=sort_runs,
        SORT_MERGE=sort_merge,
        TOPK=topk,
        K_R=k_r,
        TOPK_GROUP=topk_group,
        SCORING=SCORING_CODES[scoring_func],
        HAS_SOFTCAP=has_softcap,
        HAS_BIAS=has_bias,
        RENORMALIZE=renormalize,
        SCALE_OUTPUT=scale_output,
        NTNP_FROM_PTR=ntnp_from_ptr,
        BLOCK_M=block_m,
        USE_PDL=use_pdl,
        RUNS=runs,
        UNIT_SHARED=unit_shared,
    )


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
    invariant: bool = False,
    unit_shared_weight: bool = False,
) -> None:
    """Launch the router kernel, writing ``weights``/``ids`` (already validated, contiguous, [M, topk]).
    ``scores``: [M, E], or [R, M, E] fp32 partial sums the kernel adds in run order. ``invariant``: one row a program
    at every M (batch invariance: a row's sums laid out one way).

    ``num_token_non_padded`` is a 0-d device tensor read inside the kernel (no host sync), or None, in which
    case rows at or past ``n_valid`` (a host int in [0, M]) are padding.
    """
    M, E = scores.shape[-2:]
    topk = weights.shape[1]
    if M == 0:
        return
    scores = _runtime.laid_out_once(scores) if invariant else scores.contiguous()
    block_m, num_warps = (1, 1) if invariant else launch_config(M, E, num_expert_group)
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
        **gate_constexprs(
            E,
            topk,
            num_fused_shared_experts,
            num_expert_group,
            topk_group,
            scoring_func,
            has_softcap=scoring_func == "softmax" and moe_softcapping > 0,
            has_bias=bias is not None,
            renormalize=bool(renormalize),
            scale_output=bool(apply_routed_scaling_factor_on_output),
            ntnp_from_ptr=num_token_non_padded is not None,
            block_m=block_m,
            use_pdl="launch_pdl" in extra,
            runs=scores.shape[0] if scores.dim() == 3 else 1,
            unit_shared=unit_shared_weight,
        ),
        num_warps=num_warps,
        **extra,
    )
