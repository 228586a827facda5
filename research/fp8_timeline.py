"""Per-program timelines of the fp8 experts' GEMM1 and GEMM2 at one token, from %globaltimer stamps: when each
program starts (after its PDL wait), when its K loop ends, when it ends (a split's last arriver after the
reduction and the epilogue), and on which SM. What a kernel's time is made of: the slowest program's loop, the
spread of loop times among programs reading the same bytes, and the epilogue.

    git apply research/fp8_stamps.patch     # the stamps; never on main (see below)
    python -m research.fp8_timeline --json out.json [--splits 1,2,4] [--presets deepseek-v3,glm-4.5-air]
    git checkout moefuse/experts/fp8/kernels.py

``fp8_stamps.patch`` (against ``experts/fp8/kernels.py`` as of d31e36c) adds a stamp buffer,
``kernels.stamps(device)``, and five stores a program. The loop-end stamp is read when the last step's MMAs are
issued (its boxes have arrived), not when they complete. Each preset runs the op's tiles with GEMM1 split as
``--splits`` says (0: the op's own split) on fresh routings, seven times; the run of median GEMM1 span is kept.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moefuse.config import preset
from moefuse.experts import experts_workspace
from moefuse.experts.fp8 import kernels
from research import fp8_decode_probe as probe

RUNS = 7
GEMM1_ROWS = 2 * 128  # weight rows a GEMM1 program reads: its 128 columns' gate and up rows (one byte an element)
TICK_US = 0.1  # the grid the aggregate rate is sampled on


def run_lengths(K: int, step: int, split: int) -> list[int]:
    """The K extent of each of ``split`` runs of ``step``-deep steps, as ``kernels._split_range`` cuts them."""
    steps = -(-K // step)
    per = -(-steps // split) * step
    return [max(0, min((run + 1) * per, K) - run * per) for run in range(split)]


def summarize(stamps: torch.Tensor, nbytes: torch.Tensor) -> dict[str, Any]:
    """One kernel's stamps [programs, 4] (start, loop end, end, SM; ns) and each program's bytes [programs]:
    µs from the first start. Programs that ran no loop (an unused tile: loop end 0) are left out. The aggregate
    read rate spreads each program's bytes evenly over its loop (an estimate: no program reads evenly)."""
    ran = stamps[:, 1] > 0
    st, nbytes = stamps[ran].double(), nbytes[ran].double()
    base = st[:, 0].min()
    start, loop_end, end = ((st[:, i] - base) / 1e3 for i in range(3))
    loop = loop_end - start
    span = float(end.max())
    ticks = torch.arange(0.0, span, TICK_US, dtype=torch.float64)
    active = (start[None, :] <= ticks[:, None]) & (loop_end[None, :] > ticks[:, None])
    rate = (active * (nbytes / loop.clamp(min=1e-3))[None, :]).sum(1) / 1e6  # TB/s
    return {
        "programs": int(ran.sum()), "sms": int(torch.unique(st[:, 3]).numel()),
        "most_per_sm": int(torch.bincount(st[:, 3].long()).max()),
        "span_us": span, "last_start_us": float(start.max()),
        "loop_min_us": float(loop.min()), "loop_median_us": float(loop.median()), "loop_max_us": float(loop.max()),
        "first_loop_end_us": float(loop_end.min()), "last_loop_end_us": float(loop_end.max()),
        "epilogue_us": float((end - loop_end).max()),
        "tbps_over_span": float(nbytes.sum()) / span / 1e6,
        "tbps_peak_estimate": float(rate.max()) if rate.numel() else 0.0,
    }


def measure(name: str, splits: Sequence[int], device: torch.device) -> list[dict[str, Any]]:
    """``name``'s fp8 experts at one token (its top-k slots), per split: GEMM1's and GEMM2's summaries of the run
    of median GEMM1 span."""
    cfg = preset(name)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size  # noqa: E741 (SPEC's name)
    w1, w2 = probe.random_fp8(E, 2 * I, H, device), probe.random_fp8(E, H, I, device)
    shape, _ = probe.make_shape(1, cfg.top_k, w1, w2, torch.Generator(device).manual_seed(7))
    workspace = experts_workspace(device)
    stamps = kernels.stamps(shape.x.device)
    rows = []
    for split in splits:
        split = split or shape.op_split
        calls = [lambda p=p, o=o, s=split: kernels.experts_fp8(shape.x, w1, w2, p, o, shape.tiles.gemm1,
                                                               shape.tiles.gemm2, split_k=s, workspace=workspace)
                 for p, o in zip(shape.plans, shape.outs)]
        for call in calls:
            call()
        # each program's bytes, from the tiles the op launches (fp8_tiles): GEMM1 program p · split + s reads run s
        t1 = kernels.fp8_tiles(shape.tiles.gemm1, shape.plans[0].block_m, True, 2, split)
        t2 = kernels.fp8_tiles(shape.tiles.gemm2, shape.plans[0].block_m, False, 1)
        slots = stamps.shape[1]
        runs_bytes = torch.tensor(run_lengths(H, t1.block_k, split), dtype=torch.float64) * GEMM1_ROWS
        g1_bytes = runs_bytes.repeat(-(-slots // split))[:slots]
        g2_bytes = torch.full((slots,), float(t2.block_n * I), dtype=torch.float64)
        runs: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for i in range(RUNS):
            calls[(i + 1) % len(calls)]()  # another routing first: this one's weights are not in L2
            stamps.zero_()
            torch.cuda.synchronize()
            calls[i % len(calls)]()
            torch.cuda.synchronize()
            st = stamps.cpu()
            runs.append((summarize(st[0], g1_bytes), summarize(st[1], g2_bytes)))
        runs.sort(key=lambda r: r[0]["span_us"])
        gemm1, gemm2 = runs[len(runs) // 2]
        spans = [round(r[0]["span_us"], 2) for r in runs]
        for gemm, summary in (("gemm1", gemm1), ("gemm2", gemm2)):
            rows.append({"model": name, "slots": cfg.top_k, "split": split, "op_split": shape.op_split,
                         "kernel": gemm, **summary, **({"gemm1_spans_us": spans} if gemm == "gemm1" else {})})
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--splits", default="0", help="GEMM1's splits, comma-separated (0: the op's)")
    parser.add_argument("--presets", default="deepseek-v3,kimi-k2,deepseek-v4-flash,glm-4.5-air,qwen3-30b-a3b")
    args = parser.parse_args(argv)
    if not hasattr(kernels, "stamps"):
        raise SystemExit("the kernels carry no stamps: git apply research/fp8_stamps.patch first")
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for name in args.presets.split(","):
        rows += measure(name, [int(s) for s in args.splits.split(",")], device)
        if args.json:
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                             "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
