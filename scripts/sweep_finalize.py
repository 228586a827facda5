"""Sweep the finalize kernel's column tile (BLOCK_H, warps) on a GPU for small and large M.

    python scripts/sweep_finalize.py

The data behind ``moefuse.finalize.kernel.finalize_tile``.
"""

from __future__ import annotations

import argparse

import torch

from moefuse.bench import report, timing
from moefuse.finalize import kernel, moe_finalize_fuse_shared

SHAPES = [(256, 1), (512, 1), (512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8)]


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    chosen = kernel.finalize_tile
    rows = []
    for hidden, top_k in ((7168, 8), (4096, 6), (2048, 8)):
        for tokens in (1, 16, 128, 4096):
            sets = []
            for _ in range(timing.rotations(tokens * top_k * hidden * 2 * 2)):
                perm = torch.randperm(tokens * top_k, device="cuda").to(torch.int32)
                sets.append((torch.randn(tokens * top_k, hidden, device="cuda", dtype=torch.bfloat16), perm,
                             torch.rand(tokens, top_k, device="cuda"),
                             torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)))
            times = {}
            for shape in SHAPES:
                kernel.finalize_tile = lambda *a, shape=shape: shape
                try:
                    times[shape] = timing.graph_time_us(
                        [lambda s=s: moe_finalize_fuse_shared(*s, top_k) for s in sets], replays=30)
                finally:
                    kernel.finalize_tile = chosen
            default = chosen(tokens, hidden, torch.bfloat16)
            best = min(times, key=times.get)
            print(f"H={hidden} k={top_k} M={tokens:5d} " + " ".join(f"{s}:{t:.2f}" for s, t in times.items()),
                  flush=True)
            rows.append({"config": f"H={hidden} top-{top_k}", "M": tokens, "best": str(best), "best_us": times[best],
                         "default": str(default), "default_us": times.get(default)})
    print(report.format_table(rows, [("config", "config"), ("M", "M"), ("best", "best (BLOCK_H, warps)"),
                                     ("best_us", "µs"), ("default", "finalize_tile"), ("default_us", "µs")]))


if __name__ == "__main__":
    main()
