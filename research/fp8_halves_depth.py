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

``--layers``: instead, the one-token layers the batch-invariance targets are set on, DeepSeek-V3 fp8 (its GEMM1 with
the shared slot, in halves of 128 columns) and DeepSeek-V4-Flash MXFP4 (its fp8 shared expert's GEMM1, in halves of
64 columns), default and invariant with the halves' launch as ``experts_fp8`` picks it and forced to each of
``LAYER_LAUNCHES``, alternating, under CUDA-graph replay.

    python -m research.fp8_halves_depth [--model deepseek-v3] [--repeats 3] [--layers]
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
# --layers: the halves' launch as experts_fp8 picks it, and forced ones
LAYER_LAUNCHES: dict[str, tuple[int, int] | None] = {
    "rule": None, "one_box_s3": (1, 3), "one_box_s4": (1, 4), "one_box_s6": (1, 6), "one_box_s8": (1, 8),
    "two_boxes_s3": (2, 3)}


def _depth(boxes: int, stages: int):  # noqa: ANN202 - a stand-in for fp8_kernels.fp8_tiles
    """``fp8_tiles`` with the halves' launch stepping ``boxes`` boxes on ``stages`` stages."""
    original = fp8_kernels.fp8_tiles

    def tiles(t, block_m, gemm1, a_bytes, split_k=1, budget=fp8_kernels.SMEM_BUDGET, *, half_columns=0,  # noqa: ANN001, ANN202
              wgmma=False):
        got = original(t, block_m, gemm1, a_bytes, split_k, budget, half_columns=half_columns, wgmma=wgmma)
        return replace(got, block_k=boxes * fp8_kernels.BLOCK, num_stages=stages) if half_columns else got

    return tiles


def _gemm1_us(call) -> float:  # noqa: ANN001
    """Device µs of GEMM1 a call (eager launches under torch.profiler)."""
    return round(kernel_us([call], rounds=20, kernels=("gemm1",))["gemm1_us"], 1)


def layers(repeats: int) -> None:
    """The one-token layers, default and invariant on each launch of the halves (µs, medians of ``repeats``)."""
    gen = torch.Generator("cuda").manual_seed(0)
    original = fp8_kernels.fp8_tiles
    for model, quant in (("deepseek-v3", "fp8"), ("deepseek-v4-flash", "mxfp4")):
        layer = MoELayer(preset(model), device="cuda", quant=quant).init_random_(0)
        x = torch.randn(1, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        times: dict = defaultdict(list)
        outs = {}
        try:
            with torch.no_grad():
                for _ in range(repeats):
                    layer.batch_invariant = False
                    times["default"].append(timing.graph_time_us([partial(layer, x)], replays=50))
                    layer.batch_invariant = True
                    for name, launch in LAYER_LAUNCHES.items():
                        fp8_kernels.fp8_tiles = original if launch is None else _depth(*launch)
                        layer.graphs.clear()
                        times[name].append(timing.graph_time_us([partial(layer, x)], replays=50))
                        outs[name] = layer(x).clone()
                        fp8_kernels.fp8_tiles = original
        finally:
            fp8_kernels.fp8_tiles = original
        row: dict = {"model": model, "format": quant, "M": 1, "layer": True}
        row.update({key: round(sorted(v)[len(v) // 2], 1) for key, v in times.items()})
        first = outs["rule"]
        row["same_bits"] = all(torch.equal(out, first) for out in outs.values())
        print(json.dumps(row), flush=True)
        del layer
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--repeats", type=int, default=3, help="alternating timings of every launch, the median kept")
    parser.add_argument("--layers", action="store_true", help="the one-token layers instead (see the docstring)")
    args = parser.parse_args(argv)
    if args.layers:
        layers(args.repeats)
        return
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
