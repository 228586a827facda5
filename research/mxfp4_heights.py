"""Where should each MXFP4 W4A16 tile height take over? (GPU.)

``configs.MXFP4_HEIGHTS`` switches 16 -> 32 -> 64 -> 128-row tiles by the rows per touched expert (13, 32, 58),
limits measured when 128-row tiles still ran W4A8. Per model and token count, the routed experts (dispatch, both
GEMMs, combine; W4A16, the same bits on every height) on plans forced to each height, alternating, under CUDA-graph
replay, beside the height the rule picks. Prints one JSON object a line: µs a height (the median of ``--repeats``).

    python -m research.mxfp4_heights [--models deepseek-v4-flash] [--tokens 384 512 ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from functools import partial

import torch

from moefuse.bench import timing
from moefuse.config import preset
from moefuse.experts import plan_block_m
from moefuse.layer import MoELayer, routed_experts

HEIGHTS = (16, 32, 64, 128)
TOKENS = (384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["deepseek-v4-flash"])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--repeats", type=int, default=3, help="alternating timings a height, the median kept")
    args = parser.parse_args(argv)
    gen = torch.Generator("cuda").manual_seed(0)
    for model in args.models:
        layer = MoELayer(preset(model), device="cuda", quant="mxfp4").init_random_(0)
        c = layer.config
        gate_up, down = layer.experts.weights()
        for M in args.tokens:
            x = torch.randn(M, c.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
            with torch.no_grad():
                weights, ids = layer.gate(x)
            rows = M * c.top_k
            touched = int(torch.unique(ids).numel())
            times: dict = defaultdict(list)
            for _ in range(args.repeats):
                for height in HEIGHTS:
                    call = partial(routed_experts, x, gate_up, down, weights, ids, swiglu_limit=c.swiglu_limit,
                                   block_m=height)
                    with torch.no_grad():
                        times[height].append(timing.graph_time_us([call], replays=30))
            us = {str(h): round(sorted(v)[len(v) // 2], 1) for h, v in times.items()}
            best = min(us, key=us.__getitem__)
            rule = plan_block_m(M, gate_up, c.top_k, x.dtype)
            print(json.dumps({"model": model, "M": M, "rows_per_expert": round(rows / touched, 1), "us": us,
                              "rule": rule, "best": int(best), "rule_x_best": round(us[str(rule)] / us[best], 3)}),
                  flush=True)
        del layer, gate_up, down
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
