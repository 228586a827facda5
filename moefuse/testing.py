"""Comparison helpers shared by the tests, the benchmarks and the command line.

Floats are compared by error normalised by the reference's magnitude (max and RMS), never elementwise
``allclose``: a kernel that is wrong on a few elements of a large tensor still fails, and a tolerance
means the same thing at every scale.
"""

from __future__ import annotations

import torch


def rel_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """``max|out - ref| / max(max|ref|, floor, tiny)`` in float64; ``inf`` when NaN/inf placement differs.
    ``floor``: the smallest scale to measure against, where the output's format rounds in absolute steps below it
    (fp16 under its smallest normal)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if out64.shape != ref64.shape:
        raise ValueError(f"shape mismatch: {tuple(out64.shape)} vs {tuple(ref64.shape)}")
    if out64.numel() == 0:
        return 0.0
    same_nonfinite = (out64.isnan() == ref64.isnan()).all() and (
        out64[out64.isinf()].tolist() == ref64[ref64.isinf()].tolist()
        and bool((out64.isinf() == ref64.isinf()).all())
    )
    if not same_nonfinite:
        return float("inf")
    finite = ref64.isfinite()
    if not bool(finite.any()):
        return 0.0
    diff = (out64[finite] - ref64[finite]).abs().max().item()
    scale = max(ref64[finite].abs().max().item(), floor, 1e-30)
    return diff / scale


def rms_rel_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """``||out - ref||_2 / max(||ref||_2, floor · sqrt(n))`` in float64 (0 when both are empty or zero);
    ``floor`` as :func:`rel_error` takes it."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    num = (out64 - ref64).norm().item()
    den = max(ref64.norm().item(), floor * ref64.numel() ** 0.5)
    return num / den if den > 0 else num


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output") -> None:
    """Fail unless ``rel_error(out, ref) <= tol`` (NaN/inf must sit in the same places)."""
    err = rel_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def max_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two same-dtype float tensors.

    NaN must sit in the same places in both (else a huge distance); +0 and -0 are 0 apart.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"need equal dtypes and shapes, got {a.dtype} {tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
    a, b = a.detach().cpu(), b.detach().cpu()
    if not torch.equal(a.isnan(), b.isnan()):
        return 2**31
    keep = ~a.isnan()
    if not bool(keep.any()):
        return 0

    def ordered(x: torch.Tensor) -> torch.Tensor:  # sign-magnitude bits -> a monotonic integer line
        bits = x[keep].view(_INT_VIEW[x.dtype]).long()
        magnitude = bits & (2 ** (8 * x.element_size() - 1) - 1)
        return torch.where(bits < 0, -magnitude, magnitude)

    return int((ordered(a) - ordered(b)).abs().max())
