"""Sweep the router's launch shape (rows per program, warps) on a GPU and print the best per (config, M).

    python scripts/sweep_router.py [--tokens 1 512 8192]

Prints one line per (config, M, rows, warps) and a table of the fastest shape next to what
``moefuse.route.kernel.launch_config`` picks today: the data behind that function's rule.
"""

from __future__ import annotations

import argparse

import torch

from moefuse.bench import report, router, timing
from moefuse.route import kernel, moe_fused_gate

SHAPES = [(1, 1), (2, 1), (4, 1), (8, 1)]  # one warp: the kernel spreads a row over the 32 lanes of a warp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 512, 4096, 8192])
    args = parser.parse_args(argv)
    chosen = kernel.launch_config
    rows = []
    for config in router.CONFIGS:
        opts = router._options(config)
        experts, topk = config[1], opts["topk"]
        for tokens in args.tokens:
            nbytes = tokens * experts * 4 + tokens * topk * 8
            sets = [router._inputs(tokens, experts) for _ in range(timing.rotations(nbytes))]
            outs = [(torch.empty(tokens, topk, device="cuda"), torch.empty(tokens, topk, dtype=torch.int32,
                                                                           device="cuda")) for _ in sets]
            times = {}
            for shape in SHAPES:
                kernel.launch_config = lambda *a, shape=shape: shape
                try:
                    times[shape] = timing.graph_time_us(
                        [lambda s=s, o=o: moe_fused_gate(*s, **opts, out=o) for s, o in zip(sets, outs)], replays=20)
                except Exception as exc:  # a shape may not compile (registers, shared memory)
                    print(f"{config[0]} M={tokens} {shape}: {type(exc).__name__}", flush=True)
                finally:
                    kernel.launch_config = chosen
            default = chosen(tokens, experts, opts["num_expert_group"])
            best = min(times, key=times.get)
            print(f"{config[0]:30s} M={tokens:5d} " + " ".join(f"{s}:{t:.2f}" for s, t in times.items()), flush=True)
            rows.append({"config": config[0], "M": tokens, "best": str(best), "best_us": times[best],
                         "default": str(default), "default_us": times.get(default)})
    print(report.format_table(rows, [("config", "config"), ("M", "M"), ("best", "best (rows, warps)"),
                                     ("best_us", "µs"), ("default", "launch_config"), ("default_us", "µs")]))


if __name__ == "__main__":
    main()
