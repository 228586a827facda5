"""``moefuse bench``: every stage benchmark on the GPU, one table each, a results file and a plot.

Each stage module (``moefuse.bench.<stage>``) exposes ``run(ceilings, quick) -> rows``, ``COLUMNS`` and ``TITLE``,
and optionally ``check(device) -> rows`` with ``CHECK_COLUMNS``. This driver measures the ceilings once, runs the
checks and benchmarks with progress on stderr, prints the tables, and rewrites ``<stage>.json`` for each stage
it ran, then ``RESULTS.md`` and ``results.png`` from every stage file in ``results_dir`` (each record tagged with
its date, GPU and versions, so stages benchmarked in separate runs stay honest about it).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from moefuse.bench import report, timing

STAGES = ("router", "finalize", "experts", "layer", "quant", "host")
# x axis, series to draw and the key that splits a stage's rows into panels.
PLOTS: dict[str, dict[str, Any]] = {
    "router": {"x": "M", "group": "config",
               "series": {"us": "moefuse", "floor_us": "floor", "anchor_us": "best public"}},
    "finalize": {"x": "M", "group": "config", "series": {"us": "moefuse", "floor_us": "floor", "unfused_us": "unfused",
                                                         "torch_compile_us": "torch.compile"}},
    "experts": {"x": "M", "group": "stage", "series": {"us": "moefuse", "mem_floor_us": "memory floor",
                                                       "anchor_us": "best public Triton", "torch_us": "torch"}},
    "quant": {"x": "M", "group": "model",
              "series": {"us": "moefuse", "read_floor_us": "read floor", "peer_us": "vLLM fp8", "bf16_us": "bf16"}},
    "layer": {"x": "M", "group": "model",
              "series": {"us": "moefuse", "plain_us": "no deferral", "mem_floor_us": "memory floor",
                         "hf_grouped_mm_us": "transformers"}},
}


def _progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def plot(results: dict[str, Any], path: Path) -> None:
    """Time against tokens, one panel per stage configuration, log-log, with floors and baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for stage, rows in results["stages"].items():
        spec = PLOTS.get(stage)
        if not spec or not rows:
            continue
        for group in dict.fromkeys(str(row.get(spec["group"])) for row in rows):
            panels.append((stage, group, [r for r in rows if str(r.get(spec["group"])) == group], spec))
    if not panels:
        return
    cols = 4
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(4.2 * cols, 3.2 * -(-len(panels) // cols)),
                             squeeze=False)
    for ax, (stage, group, rows, spec) in zip(axes.flat, panels):
        for key, label in spec["series"].items():
            points = [(r[spec["x"]], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", ms=3, label=label, ls="--" if "floor" in key else "-")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{stage}: {group}", fontsize=8)
        ax.set_xlabel("tokens", fontsize=7)
        ax.set_ylabel("µs", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    env = results["environment"]
    fig.suptitle(f"moefuse on {env['gpu']}, {env['date']}, torch {env['torch']}, Triton {env['triton']}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the title
    fig.savefig(path, dpi=110)


def _write_report(out: Path) -> None:
    """RESULTS.md and results.png from every ``<stage>.json`` in ``out`` (each tagged with its own run)."""
    records = {stage: json.loads((out / f"{stage}.json").read_text()) for stage in STAGES
               if (out / f"{stage}.json").exists()}
    parts = ["# moefuse GPU results\n\nWritten by `moefuse bench`. Times are device time per call under CUDA-graph "
             "replay (median of many replays, inputs rotated past the L2 where they are small); floors come from "
             "ceilings measured in the same run. Each stage says when and on what it ran.\n\n![results](results.png)"]
    for stage, record in records.items():
        env, module = record["environment"], importlib.import_module(f"moefuse.bench.{stage}")
        ceilings = ", ".join(f"{k} {v:.3g}" for k, v in record["ceilings"].items())
        parts.append(f"## {stage}\n\n{env['date']}, {env['gpu']}, torch {env['torch']}, Triton {env['triton']}, "
                     f"Python {env['python']}. Ceilings: {ceilings}")
        if record.get("checks"):
            parts.append(report.format_table(record["checks"], module.CHECK_COLUMNS, f"{stage}: checks"))
        parts.append(report.format_table(record["rows"], module.COLUMNS, module.TITLE))
    (out / "RESULTS.md").write_text("\n\n".join(parts) + "\n")
    latest = max((r["environment"] for r in records.values()), key=lambda e: e["date"], default=None)
    if latest:
        plot({"environment": latest, "stages": {s: r["rows"] for s, r in records.items()}}, out / "results.png")


def main(stages: list[str] | tuple[str, ...] = STAGES, quick: bool = False, results_dir: str = "results") -> int:
    """Run the stage benchmarks; rewrite ``<stage>.json`` for each, then RESULTS.md and the plot from all."""
    import torch

    if not torch.cuda.is_available():
        print("moefuse bench needs a CUDA GPU", file=sys.stderr)
        return 2
    unknown = set(stages) - set(STAGES)
    if unknown:
        print(f"unknown stages {sorted(unknown)}; choose from {STAGES}", file=sys.stderr)
        return 2
    out = Path(results_dir)
    out.mkdir(parents=True, exist_ok=True)
    _progress("measuring ceilings (copy, read, bf16 GEMM, empty kernel)")
    ceilings = timing.measure_ceilings()
    print(report.format_table([dataclasses.asdict(ceilings)], [(k, k) for k in dataclasses.asdict(ceilings)],
                              "Ceilings measured in this run"), flush=True)
    ok = True
    for i, stage in enumerate(stages, 1):
        module = importlib.import_module(f"moefuse.bench.{stage}")
        record: dict[str, Any] = {"environment": timing.environment(), "ceilings": dataclasses.asdict(ceilings),
                                  "quick": quick, "checks": []}
        if hasattr(module, "check"):
            _progress(f"[{i}/{len(stages)}] {stage}: correctness on real shapes")
            record["checks"] = module.check("cuda")
            ok &= all(row.get("ok", True) for row in record["checks"])
            print(report.format_table(record["checks"], module.CHECK_COLUMNS, f"{stage}: checks"), flush=True)
        _progress(f"[{i}/{len(stages)}] {stage}: timing")
        record["rows"] = module.run(ceilings, quick=quick)
        print(report.format_table(record["rows"], module.COLUMNS, module.TITLE), flush=True)
        (out / f"{stage}.json").write_text(json.dumps(record, indent=1, default=str))
    _write_report(out)
    _progress(f"wrote {out}/<stage>.json, {out / 'RESULTS.md'}, {out / 'results.png'}")
    return 0 if ok else 1
