"""Where should each MXFP4 W4A16 tile height take over? And W4A8's? (GPU.)

``configs.MXFP4_HEIGHTS`` switches 16 -> 32 -> 64 -> 128-row tiles by the rows per touched expert (13, 32, 58),
limits measured when 128-row tiles still ran W4A8. Per model and token count, the routed experts (dispatch, both
GEMMs, combine; W4A16, the same bits on every height) on plans forced to each height, alternating, under CUDA-graph
replay, beside the height the rule picks. Prints one JSON object a line: µs a height (the median of ``--repeats``),
and whether every height gave the tokens the same bits.

``--w4a8``: the same for ``activation_quant="fp8"`` on the heights W4A8 has kernels of (its decode kernels' 16 and 32
rows, ``mxfp4/w4a8_decode.py``, and 128), with W4A16 at its own rule's height beside them (``w4a16_us``): is W4A8
no slower than W4A16, and do its two kernels give a token the same bits (``same_bits``)?

    python -m research.mxfp4_heights [--models deepseek-v4-flash] [--tokens 384 512 ...] [--repeats 3] [--w4a8]
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
from moefuse.experts.mxfp4 import w4a8, w4a8_decode
from moefuse.layer import MoELayer, routed_experts

HEIGHTS = (16, 32, 64, 128)
TOKENS = (384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["deepseek-v4-flash"])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--repeats", type=int, default=3, help="alternating timings a height, the median kept")
    parser.add_argument("--w4a8", action="store_true", help="W4A8 (activation_quant='fp8') on its kernels' heights")
    args = parser.parse_args(argv)
    quant = "fp8" if args.w4a8 else None
    heights = (*sorted(w4a8_decode.LAUNCH), w4a8.BLOCK_M) if args.w4a8 else HEIGHTS
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
            calls = {h: partial(routed_experts, x, gate_up, down, weights, ids, swiglu_limit=c.swiglu_limit,
                                activation_quant=quant, block_m=h) for h in heights}
            w4a16_rule = plan_block_m(M, gate_up, c.top_k, x.dtype)
            if args.w4a8:  # W4A16 beside it, at its own rule's height
                calls["w4a16"] = partial(routed_experts, x, gate_up, down, weights, ids, swiglu_limit=c.swiglu_limit,
                                         block_m=w4a16_rule)
            with torch.no_grad():
                outs = [calls[h]().view(torch.int16) for h in heights]
            times: dict = defaultdict(list)
            for _ in range(args.repeats):
                for key, call in calls.items():
                    with torch.no_grad():
                        times[key].append(timing.graph_time_us([call], replays=30))
            us = {str(h): round(sorted(v)[len(v) // 2], 1) for h, v in times.items() if h != "w4a16"}
            best = min(us, key=us.__getitem__)
            rule = plan_block_m(M, gate_up, c.top_k, x.dtype, quant)
            row = {"model": model, "M": M, "rows_per_expert": round(rows / touched, 1), "us": us, "rule": rule,
                   "best": int(best), "rule_x_best": round(us[str(rule)] / us[best], 3),
                   "same_bits": all(torch.equal(outs[0], out) for out in outs[1:])}
            if args.w4a8:
                w4a16_us = sorted(times["w4a16"])[len(times["w4a16"]) // 2]
                row.update(w4a16_us=round(w4a16_us, 1), rule_x_w4a16=round(us[str(rule)] / w4a16_us, 3))
            print(json.dumps(row), flush=True)
        del layer, gate_up, down
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
