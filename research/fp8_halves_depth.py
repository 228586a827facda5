"""Does fp8 GEMM1 in halves run slower than the default's split because each program keeps fewer bytes in flight?
(GPU.)

At one token with its shared slot, DeepSeek-V3's batch-invariant GEMM1 runs 288 gate and up halves stepping one
128-deep box on 3 stages (about 32 KB of weights in flight a program, 24 of 132 SMs holding three), and took 107.9
µs in the layer's graph replay where the default's 432 programs, K split three ways and stepping two boxes on 2
stages (64 KB in flight a program, two an SM), took 97.6; halves of 64 columns (576 programs, half the bytes each)
took 126.4. If the bytes in flight per SM set the time, halves stepping two boxes deep should close the gap. This
times the invariant routed experts with the slot and GEMM1 alone (torch.profiler) with the halves on one-box steps
(3 stages) and on two-box steps (2 and 3 stages: 96 and 144 KB of shared memory), the default's call beside them,
and checks that every launch gives the same bits (a step's boxes are promoted one by one, in K order).
Prints one JSON object a line.

    python -m research.fp8_halves_depth [--model deepseek-v3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import replace
from functools import partial

import torch

from moefuse.bench import timing
from moefuse.config import preset
from moefuse.experts.fp8 import kernels as fp8_kernels
from moefuse.layer import MoELayer, routed_experts
from research.fp8_decode_probe import kernel_us

LAUNCHES = {"one_box_s3": (1, 3), "two_boxes_s2": (2, 2), "two_boxes_s3": (2, 3)}  # boxes a step, stages


def _depth(boxes: int, stages: int):  # noqa: ANN202 - a stand-in for fp8_kernels.fp8_tiles
    """``fp8_tiles`` with the halves' launch stepping ``boxes`` boxes on ``stages`` stages."""
    original = fp8_kernels.fp8_tiles

    def tiles(t, block_m, gemm1, a_bytes, split_k=1, budget=fp8_kernels.SMEM_BUDGET, halves=False):  # noqa: ANN001, ANN202
        got = original(t, block_m, gemm1, a_bytes, split_k, budget, halves)
        return replace(got, block_k=boxes * fp8_kernels.BLOCK, num_stages=stages) if halves else got

    return tiles


def _gemm1_us(call) -> float:  # noqa: ANN001
    """Device µs of GEMM1 a call (eager launches under torch.profiler)."""
    return round(kernel_us([call], rounds=20, kernels=("gemm1",))["gemm1_us"], 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--repeats", type=int, default=3, help="alternating timings of every launch, the median kept")
    args = parser.parse_args(argv)
    gen = torch.Generator("cuda").manual_seed(0)
    layer = MoELayer(preset(args.model), device="cuda", quant="fp8").init_random_(0)
    c = layer.config
    x = torch.randn(1, c.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    slot = layer.shared_slot_weights()
    calls = {}
    with torch.no_grad():
        for invariant in (False, True):
            layer.batch_invariant = invariant
            weights, ids = layer.gate(x, num_fused_shared_experts=1, unit_shared_weight=True)
            calls[invariant] = partial(routed_experts, x, *slot, weights, ids, swiglu_limit=c.swiglu_limit,
                                       activation_quant=layer.activation_quant, batch_invariant=invariant)
    original = fp8_kernels.fp8_tiles
    times: dict = defaultdict(list)
    row: dict = {"model": args.model, "M": 1}
    try:
        with torch.no_grad():
            for _ in range(args.repeats):
                times["default"].append(timing.graph_time_us([calls[False]], replays=50))
                for name, (boxes, stages) in LAUNCHES.items():
                    fp8_kernels.fp8_tiles = _depth(boxes, stages)
                    times[name].append(timing.graph_time_us([calls[True]], replays=50))
                    fp8_kernels.fp8_tiles = original
            row["default_gemm1"] = _gemm1_us(calls[False])
            bits = None
            for name, (boxes, stages) in LAUNCHES.items():
                fp8_kernels.fp8_tiles = _depth(boxes, stages)
                row[f"{name}_gemm1"] = _gemm1_us(calls[True])
                out = calls[True]()
                bits = out if bits is None else bits
                row[f"{name}_same_bits"] = bool(torch.equal(out, bits))
                fp8_kernels.fp8_tiles = original
    finally:
        fp8_kernels.fp8_tiles = original
    for key, values in times.items():
        row[key] = round(sorted(values)[len(values) // 2], 1)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
