"""The fp8 experts' error over few rows, against the float64 spec emulation, on tall tiles (GPU).

The inputs are drawn as ``tests/test_fuzz.py`` draws them (gate and up ~ N(0, 4), routing skewed towards low ids) on
its narrowest fp8 shape (E = 77, H = 256, I = 128), one token to sixteen, top-8 (top-1 and -2 for one token): the
max and RMS relative error over the rows the plan computes, their median, 99th percentile and largest over the
seeds. ``tests/tolerances.py`` takes its few-row RMS bound from this.

    python scripts/few_rows_error.py [--seeds 600]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import test_fuzz  # noqa: E402  (its input draws)

from moefuse.dispatch import moe_dispatch  # noqa: E402
from moefuse.experts import moe_experts  # noqa: E402
from moefuse.experts.reference import moe_experts_fp8_torch  # noqa: E402
from moefuse.testing import rel_error, rms_rel_error  # noqa: E402

CASE: dict[str, Any] = {"fmt": "fp8", "act": "bf16", "scales": "fp32", "E": 77, "H": 256, "I": 128, "skew": 10.0,
                        "invalid": 0.0, "ids": "int32"}
TOKENS_TOPK = ((1, 1), (1, 2), (1, 8), (4, 8), (16, 8))


def measure(M: int, K: int, seed: int, device: torch.device) -> tuple[float, float]:
    """(max, RMS) relative error of one draw on 128-row tiles."""
    c: dict[str, Any] = {**CASE, "M": M, "K": K}
    gen = torch.Generator(device).manual_seed(seed)
    w1, w2 = test_fuzz._weights(gen, c)
    x = test_fuzz._hidden(gen, M, c["H"], torch.bfloat16, "contiguous", 0)
    plan = moe_dispatch(test_fuzz._ids(gen, c), c["E"], 128)
    got = moe_experts(x, w1, w2, plan, backend="triton")
    ref = moe_experts_fp8_torch(x, w1, w2, plan, dtype=torch.float64,
                                out=torch.zeros(M * K, c["H"], dtype=torch.float64, device=device))
    n = int(plan.expert_offsets[-1])
    return rel_error(got[:n], ref[:n]), rms_rel_error(got[:n], ref[:n])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=600)
    args = parser.parse_args()
    device = test_fuzz.DEVICE
    print("| rows | seeds | RMS median | RMS p99 | RMS largest | max median | max largest |")
    print("|---|---|---|---|---|---|---|")
    for M, K in TOKENS_TOPK:
        errors = torch.tensor([measure(M, K, seed, device) for seed in range(args.seeds)], dtype=torch.float64)
        big, rms = errors[:, 0], errors[:, 1]
        print(f"| {M * K} | {args.seeds} | {rms.median():.2e} | {rms.quantile(0.99):.2e} | {rms.max():.2e} | "
              f"{big.median():.2e} | {big.max():.2e} |", flush=True)


if __name__ == "__main__":
    main()
