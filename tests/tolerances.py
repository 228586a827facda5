"""Tolerances of the routed experts against the float64 spec emulation, per format and tile path.

One table for every test that compares ``moe_experts`` (or a layer built on it) with ``backend="reference"`` in
float64. Each entry is the largest error measured by ``scripts/error_table.py`` on an H200 (``results/errors.md``:
the distribution per format, tile height and shape over many seeds) with headroom, so a seed the table never saw
does not fail, and an O(1) error (a wrong scale, row or expert) always does. Keys:

- ``"bf16"``, ``"fp16"``, ``"fp32"``: plain weights in the activations' dtype (one rounding of the intermediate and
  of the output; fp32 sums).
- ``"fp8"``: :class:`moefuse.formats.BlockFP8` (W8A8, SPEC §5). Tiles of 16 and 32 rows sum GEMM1 in fp32
  (mma.sync); taller tiles run wgmma, whose fp8 sums keep fewer bits and flip e4m3 roundings of the intermediate.
- ``"mxfp4"``: :class:`moefuse.formats.MXFP4` with bf16 activations (W4A16, SPEC §6): exact weights, fp32 sums.
- ``"w4a8"``: MXFP4 with ``activation_quant="fp8"`` (SPEC §6): wgmma fp8 sums, as the fp8 tall tiles.
"""

from __future__ import annotations

import torch

# (max relative error, RMS relative error) over the rows a plan computes; beside each, the largest max / RMS that
# results/errors.md measured for it (H200, 2026-12-03, 8 seeds on the narrow shapes and 2 on the wide, every shape).
# Headroom is 2.5-5x on the max: the max over a few seeds grows with more of them, and an O(1) bug errs 20x past it.
_TABLE = {
    ("bf16", "short"): (1e-2, 5e-3),  # 3.7e-3 / 1.7e-3: the output's bf16 rounding (2^-9 relative) dominates
    ("bf16", "tall"): (1e-2, 5e-3),  # the same
    ("fp16", "short"): (2e-3, 1e-3),  # 3.9e-4 / 2.3e-4
    ("fp16", "tall"): (2e-3, 1e-3),  # the same
    ("fp32", "short"): (1e-5, 1e-5),  # 3.0e-6 / 2.5e-6 (fp32 sums over H = 7,168)
    ("fp32", "tall"): (1e-5, 1e-5),  # the same
    # 5.4e-3 / 1.7e-3 in the table, but a GEMM1 sum that lands near an e4m3 tie flips one rounding of the
    # intermediate on any path (one e4m3 step, 1/8 of a value): a GPU run measured 1.95e-2 on a 16-row tile once
    # (H200, 2026-12-03, seed 1603806832). Rare, so the table's 8 seeds did not see it; the RMS stays small.
    ("fp8", "short"): (5e-2, 1e-2),
    # 2.9e-2 / 4.4e-3 in the table (96 tokens and more): wgmma's fp8 sums flip e4m3 roundings of the intermediate.
    # On narrow shapes and few rows both near the max (``experts_tolerance``): over 600 seeds of E = 77, H = 256,
    # I = 128 on one H100 the largest max error was 4.53e-2 on 8 rows, 4.42e-2 on 32 (2026-12-05), too
    # close to the 5e-2 once here; a GPU fuzz run met 1.34e-2 RMS on 10 rows (persistent kernels, which match the tl
    # tall tiles' table cells to three digits; 2026-12-04).
    ("fp8", "tall"): (7.5e-2, 2e-2),
    ("mxfp4", "short"): (1e-2, 5e-3),  # 3.4e-3 / 1.7e-3
    ("mxfp4", "tall"): (1e-2, 5e-3),  # the same (fp32 sums on every tile height)
    # 1.9e-2 / 3.7e-3 in the table (H, I >= 512). At the narrowest widths W4A8 takes, a row's 128 e4m3-rounded
    # activations average out less: the GPU fuzz run met 1.10e-2 RMS on one row of E = 1, H = I = 128 (seed 157,
    # 2026-12-04), with a max of 1.09e-2: the RMS of one short row is about its max. The largest met
    # since: 1.55e-2 RMS on the 3 rows of one token, E = 6, H = 384, I = 128 (test_w4a8_matches_float64, seed
    # 500794227, 2026-12-04).
    ("w4a8", "short"): (5e-2, 2e-2),  # the decode kernels (16 and 32 rows): the same arithmetic as "tall"
    ("w4a8", "tall"): (5e-2, 2e-2),
}


def tile_path(block_m: int) -> str:
    """``"short"`` for tiles of 16 or 32 rows (mma.sync), ``"tall"`` for 64 and 128 (wgmma where the format has
    it)."""
    return "short" if block_m <= 32 else "tall"


def experts_tolerance(fmt: str, block_m: int, rows: int | None = None) -> tuple[float, float]:
    """``(max, rms)`` relative error allowed for format ``fmt`` (a key above) on tiles of ``block_m`` rows, the RMS
    over ``rows`` compared rows where given.

    The table's RMS bounds hold over many rows. Over few rows the RMS is nearly the max: a flipped e4m3 rounding of
    one intermediate value moves every output of its row, so a row's errors do not average out. Measured on one H100
    (``research/few_rows_error.py``, 2026-12-05: tall fp8 tiles, E = 77, H = 256, I = 128, skewed routing,
    600 seeds a row count), the largest RMS over 1 / 8 / 32 / 128 rows was 3.27e-2 / 1.99e-2 / 1.14e-2 / 7.4e-3 (and
    2.25e-2 on 2 rows, the GPU fuzz run that failed the fixed 2e-2): it falls about as ``rows ** -0.25``. So the
    RMS bound is ``max / rows ** 0.25`` where that exceeds the table's, 2.2x or more over each of those on tall fp8
    (max 7.5e-2); an O(1) error still fails both bounds."""
    max_tol, rms_tol = _TABLE[(fmt, tile_path(block_m))]
    if rows:
        rms_tol = max(rms_tol, max_tol / rows ** 0.25)
    return max_tol, rms_tol


# fp32 experts where no fixed relative tolerance holds (sums whose terms cancel): an output may also err up to this
# many times the RMS rounding error ``moefuse.testing.fp32_spread`` predicts for it. In an emulation of the GPU's
# fp32 arithmetic (``research/fp32_error_model.py``: sums along K one fused multiply-add at a time, SwiGLU's exp and
# division each off by up to 8 ulps) over 100 draws each of ten shapes from H x I = 1 x 1 to 1,024 x 1,024 and
# 3,072 x 128, the largest error was 2.7 of the prediction (medians 0.26-1.7; the kernel on an H100, 40 draws each:
# 2.5), so 16 leaves 6x; an intermediate rounded to fp16 instead erred past 16 of them and 1e-5 of the output in
# every draw of the wide shapes (medians 177-315 predictions) and 51-99 of 100 where a GEMM sums one term to three
# (H or I of 1 to 3).
FP32_SPREADS = 16

# The router linear's fp32 sums: error relative to the sum of |x_k w_k| each logit adds up (a bound that cancellation
# in the logit itself cannot break; relative to the largest logit, one logit of E = 1 summing 141 terms that nearly
# cancel measured 1.04e-6 on an H100 in the batch-invariant kernel, 2026-12-06).
ROUTER_TOL = 1e-5


def router_error(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """The largest ``|out - x @ w.T|`` in float64 over the sum of ``|x_k w_k|`` it adds up, over every logit."""
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    return ((out.double() - ref).abs() / scale.clamp_min(1e-30)).max().item() if out.numel() else 0.0
