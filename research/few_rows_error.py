"""The fp8 experts' error over few rows, against the float64 spec emulation, on tall tiles (GPU).

The inputs are drawn as ``tests/test_fuzz.py`` draws them (gate and up ~ N(0, 4), routing skewed towards low ids) on
its narrowest fp8 shape (E = 77, H = 256, I = 128), one token to sixteen, top-8 (top-1 and -2 for one token): the
max and RMS relative error over the rows the plan computes, their median, 99th percentile and largest over the
seeds. ``tests/tolerances.py`` takes its few-row RMS bound from this.

    python -m research.few_rows_error [--seeds 600]
"""

from __future__ import annotations

import argparse
import math

import torch

from moefuse.dispatch import moe_dispatch
from moefuse.experts import moe_experts
from moefuse.experts.reference import moe_experts_fp8_torch
from moefuse.formats import BlockFP8
from moefuse.testing import rel_error, rms_rel_error

E, H, I, SKEW = 77, 256, 128, 10.0  # noqa: E741 (SPEC's name)
TOKENS_TOPK = ((1, 1), (1, 2), (1, 8), (4, 8), (16, 8))


def draw(M: int, K: int, gen: torch.Generator, device: torch.device):
    """One fuzz draw of this case, in ``tests/test_fuzz.py``'s order and distributions (its ``_weights``,
    ``_hidden`` and ``_ids`` for fp8 weights with fp32 scales, contiguous bf16 rows, no -1 slots, int32 ids), so a
    seed gives the inputs the fuzz would: (x, w1, w2, ids)."""
    w1 = torch.randn(E, 2 * I, H, generator=gen, device=device) * (2 / math.sqrt(H))  # gate and up ~ N(0, 4)
    w2 = torch.randn(E, H, I, generator=gen, device=device) / math.sqrt(I)
    x = torch.randn(M, H, generator=gen, device=device).to(torch.bfloat16)
    keys = torch.rand(M, E, generator=gen, device=device) - SKEW * torch.arange(E, device=device)
    ids = keys.argsort(dim=1, descending=True)[:, :K]
    ids = torch.where(torch.rand(M, K, generator=gen, device=device) < 0.0, -1, ids)  # the fuzz's draw of -1 slots
    return x, BlockFP8.quantize(w1), BlockFP8.quantize(w2), ids.to(torch.int32)


def measure(M: int, K: int, seed: int, device: torch.device) -> tuple[float, float]:
    """(max, RMS) relative error of one draw on 128-row tiles."""
    x, w1, w2, ids = draw(M, K, torch.Generator(device).manual_seed(seed), device)
    plan = moe_dispatch(ids, E, 128)
    got = moe_experts(x, w1, w2, plan, backend="triton")
    ref = moe_experts_fp8_torch(x, w1, w2, plan, dtype=torch.float64,
                                out=torch.zeros(M * K, H, dtype=torch.float64, device=device))
    n = int(plan.expert_offsets[-1])
    return rel_error(got[:n], ref[:n]), rms_rel_error(got[:n], ref[:n])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=600)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print("| rows | seeds | RMS median | RMS p99 | RMS largest | max median | max largest |")
    print("|---|---|---|---|---|---|---|")
    for M, K in TOKENS_TOPK:
        errors = torch.tensor([measure(M, K, seed, device) for seed in range(args.seeds)], dtype=torch.float64)
        big, rms = errors[:, 0], errors[:, 1]
        print(f"| {M * K} | {args.seeds} | {rms.median():.2e} | {rms.quantile(0.99):.2e} | {rms.max():.2e} | "
              f"{big.median():.2e} | {big.max():.2e} |", flush=True)


if __name__ == "__main__":
    main()
