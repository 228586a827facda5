"""``moefuse bench``: every stage benchmark on the GPU, one table each, a results file and a plot.

Each stage module (``moefuse.bench.<stage>``) exposes ``run(ceilings, quick) -> rows``, ``COLUMNS`` and ``TITLE``,
and optionally ``check(device) -> rows`` with ``CHECK_COLUMNS``. This driver measures the ceilings once, runs the
checks and benchmarks with progress on stderr, prints the tables, and rewrites ``<stage>.json`` for each stage
it ran, then ``RESULTS.md``, ``results.png`` (every configuration, one panel each) and ``summary.png`` (one line per
stage and format: × its floor and × the best public kernel, against tokens) from every stage file in
``results_dir`` (each record tagged with its date, GPU and versions, so stages benchmarked in separate runs stay
honest about it).
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

STAGES = ("router", "finalize", "experts", "prefill", "layer", "quant", "host", "invariance")
# x axis, series to draw and the key that splits a stage's rows into panels.
PLOTS: dict[str, dict[str, Any]] = {
    "router": {"x": "M", "group": "config",
               "series": {"us": "moefuse", "floor_us": "floor", "anchor_us": "best public"}},
    "finalize": {"x": "M", "group": "config", "series": {"us": "moefuse", "floor_us": "floor", "unfused_us": "unfused",
                                                         "torch_compile_us": "torch.compile"}},
    "experts": {"x": "M", "group": "stage", "series": {"us": "moefuse", "mem_floor_us": "memory floor",
                                                       "anchor_us": "best public Triton", "torch_us": "torch"}},
    "prefill": {"x": "M", "group": "stage",
                "series": {"us": "moefuse", "other_us": "other kernels", "mem_floor_us": "memory floor",
                           "cublas_us": "cuBLAS bmm", "sgmm_us": "torch._scaled_grouped_mm",
                           "grouped_us": "torch grouped, same routing"}},
    "quant": {"x": "M", "group": "model",
              "series": {"us": "moefuse", "read_floor_us": "read floor", "routed_us": "moefuse + dispatch + combine",
                         "peer_us": "vLLM fp8 (+ dispatch + combine)", "bf16_us": "bf16"}},
    "invariance": {"x": "M", "group": "format",
                   "series": {"layer_us": "layer", "layer_inv_us": "layer, batch-invariant",
                              "experts_us": "experts", "experts_inv_us": "experts, batch-invariant"}},
    "layer": {"x": "M", "group": "model",
              "series": {"us": "moefuse", "plain_us": "no deferral", "mem_floor_us": "memory floor",
                         "hf_grouped_mm_us": "transformers"}},
}

# The summary figure (``summary.png``): one line per stage and format, on DeepSeek-V3's shapes (DeepSeek-V4-Flash's
# for MXFP4, the format it ships in). Each names its stage file, the rows it takes (``where``), the time key, the
# floor keys (the floor is the largest of them: the roofline bound measured in the same run), and optionally the
# key of a public peer's time on the same rows with that peer's name (and ``ours_vs_peer``: our time on the peer's
# scope, where it is not the line's). ``kind`` and ``fmt`` pick colour and dash.
SUMMARY: list[dict[str, Any]] = [
    {"label": "router (gate)", "stage": "router", "where": {"config": "DSV3 256 g8k4 top8"}, "us": "us",
     "floor": ("floor_us",), "peer": "anchor_us", "peer_name": "best public Triton router",
     "kind": "router", "fmt": "fp32"},
    {"label": "finalize + shared add", "stage": "finalize", "where": {"config": "H=7168 top-8"}, "us": "us",
     "floor": ("floor_us",), "kind": "finalize", "fmt": "bf16"},
    {"label": "routed experts, bf16", "stage": "experts", "where": {"stage": "routed experts"}, "us": "us",
     "floor": ("mem_floor_us", "compute_floor_us"), "peer": "anchor_us", "peer_name": "best public Triton MoE",
     "kind": "experts", "fmt": "bf16"},
    {"label": "dispatch + experts + finalize, bf16", "stage": "prefill", "where": {"stage": "prefill, uniform routing"},
     "us": "us", "peer": "cublas_us", "peer_name": "cuBLAS dense equivalent, same run",
     "kind": "experts", "fmt": "bf16", "marker": "D", "dash": "-."},
    {"label": "dispatch + experts + finalize, fp8", "stage": "prefill",
     "where": {"stage": "prefill fp8, uniform routing"}, "us": "us", "peer": "sgmm_us",
     "peer_name": "torch._scaled_grouped_mm dense equivalent, same run", "kind": "experts", "fmt": "fp8",
     "marker": "D"},
    {"label": "dispatch + experts + finalize, bf16", "stage": "prefill", "where": {"stage": "prefill, uniform routing"},
     "us": "us", "peer": "grouped_us", "peer_name": "torch._grouped_mm on the same routing, same run",
     "kind": "experts", "fmt": "bf16", "marker": "P", "dash": "-."},
    {"label": "dispatch + experts + finalize, fp8", "stage": "prefill",
     "where": {"stage": "prefill fp8, uniform routing"}, "us": "us", "peer": "grouped_us",
     "peer_name": "torch._scaled_grouped_mm on the same routing, same run", "kind": "experts", "fmt": "fp8",
     "marker": "P"},
    {"label": "routed experts, fp8", "stage": "quant", "where": {"format": "fp8", "model": "deepseek-v3"}, "us": "us",
     "floor": ("read_floor_us", "mma_floor_us"), "peer": "peer_us", "ours_vs_peer": "routed_us",
     "peer_name": "vLLM Triton fp8 (dispatch + experts + combine, as its anchor run measured it)",
     "kind": "experts", "fmt": "fp8"},
    {"label": "routed experts, MXFP4 (V4-Flash)", "stage": "quant",
     "where": {"format": "mxfp4", "model": "deepseek-v4-flash"}, "us": "us", "floor": ("read_floor_us", "mma_floor_us"),
     "peer": "peer_us", "ours_vs_peer": "routed_us",
     "peer_name": "triton_kernels MXFP4 (dispatch + experts + combine, its H100 anchor scaled by read rate)",
     "kind": "experts", "fmt": "mxfp4"},
    {"label": "layer, bf16", "stage": "layer", "where": {"model": "deepseek-v3"}, "us": "us",
     "floor": ("mem_floor_us", "compute_floor_us"), "peer": "hf_grouped_mm_us",
     "peer_name": "transformers grouped_mm block", "kind": "layer", "fmt": "bf16"},
    {"label": "layer, bf16, batch-invariant", "stage": "invariance",
     "where": {"model": "deepseek-v3", "format": "bf16"}, "us": "layer_inv_us", "floor": ("layer_floor_us",),
     "peer": "layer_us", "peer_name": "the default layer, same run", "kind": "layer", "fmt": "bf16", "dash": ":"},
    {"label": "layer, fp8", "stage": "quant", "where": {"format": "fp8", "model": "deepseek-v3"}, "us": "layer_us",
     "floor": ("layer_floor_us",), "kind": "layer", "fmt": "fp8"},
    {"label": "layer, MXFP4 (V4-Flash)", "stage": "quant", "where": {"format": "mxfp4", "model": "deepseek-v4-flash"},
     "us": "layer_us", "floor": ("layer_floor_us",), "kind": "layer", "fmt": "mxfp4"},
]
_KIND_STYLE = {"router": ("C0", "^"), "finalize": ("C1", "v"), "experts": ("C2", "o"), "layer": ("C3", "s")}
_FMT_DASH = {"fp32": "-", "bf16": "-", "fp8": "--", "mxfp4": ":"}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value == value and value > 0 else None


def summary_series(records: dict[str, Any]) -> list[dict[str, Any]]:
    """The summary figure's lines from stage records (``{stage: {"environment", "rows"}}``), without drawing.

    One entry per line and panel: ``panel`` ("floor": time / the largest recorded floor; "peer": our time / the
    peer's, below 1 where moefuse is faster), ``label``, ``spec`` (its ``SUMMARY`` entry), sorted ``points``
    ``(tokens, ratio)`` and ``notes`` ``(tokens, ratio, text)`` for points whose MMA precision (``mma``) differs from
    the line's first, so a line that changes precision says where.
    """
    series = []
    for spec in SUMMARY:
        rows = [r for r in (records.get(spec["stage"]) or {}).get("rows", [])
                if all(r.get(k) == v for k, v in spec["where"].items()) and _number(r.get("M"))]
        rows.sort(key=lambda r: r["M"])
        for panel, ratio in (("floor", _floor_ratio), ("peer", _peer_ratio)):
            points, notes = [], []
            for row in rows:
                value = ratio(spec, row)
                if value is None:
                    continue
                points.append((row["M"], value))
                if panel == "floor" and row.get("mma") and row["mma"] != rows[0].get("mma"):
                    notes.append((row["M"], value, row["mma"]))
            if points:
                label = spec["label"] if panel == "floor" else f"{spec['label']} vs {spec['peer_name']}"
                series.append({"panel": panel, "label": label, "spec": spec, "points": points, "notes": notes})
    return series


def _floor_ratio(spec: dict[str, Any], row: dict[str, Any]) -> float | None:
    us = _number(row.get(spec["us"]))
    floors = [f for f in (_number(row.get(k)) for k in spec.get("floor", ())) if f]
    return us / max(floors) if us and floors else None


def _peer_ratio(spec: dict[str, Any], row: dict[str, Any]) -> float | None:
    """Our time over the peer's on the same row: ``ours_vs_peer`` names our time on the peer's scope where it is not
    the line's own (the fp8 peer's includes dispatch and the combine)."""
    us, peer = _number(row.get(spec.get("ours_vs_peer", spec["us"]))), _number(row.get(spec.get("peer", "")))
    return us / peer if us and peer else None


def summary_plot(records: dict[str, Any], path: Path) -> bool:
    """One figure, two panels against tokens (log x): × floor, and × the best public kernel; False if no data.

    ``records`` maps a stage to its results record (``<stage>.json``: ``environment`` and ``rows``). The title
    gives the GPU(s) and the range of the runs' dates; each stage's own date is in RESULTS.md.
    """
    series = summary_series(records)
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    fig, axes = plt.subplots(1, 2, figsize=(14, 7.2))
    titles = {"floor": "× floor", "peer": "× best public kernel"}
    ylabels = {"floor": "device time / floor (the larger of the memory and compute floors, same run)",
               "peer": "moefuse time / the peer's time (below 1: moefuse faster)"}
    yticks = {"floor": [0.9, 1, 1.25, 1.5, 2, 3, 4], "peer": [0.2, 0.3, 0.5, 0.7, 0.85, 1, 1.2, 1.4]}
    for ax, panel in zip(axes, ("floor", "peer")):
        xs_all: set[float] = set()
        for line in (s for s in series if s["panel"] == panel):
            spec = line["spec"]
            color, marker = _KIND_STYLE[spec["kind"]]
            xs, ys = zip(*line["points"])
            xs_all.update(xs)
            ax.plot(xs, ys, color=color, marker=spec.get("marker", marker), ms=5, lw=1.8,
                    ls=spec.get("dash", _FMT_DASH[spec["fmt"]]), label=line["label"])
            for x, y, text in line["notes"]:
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(-7, 2), ha="right", va="bottom",
                            fontsize=8, color=color)
        ax.axhline(1.0, color="black", lw=1, zorder=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        lo, hi = ax.get_ylim()
        ticks = [t for t in yticks[panel] if lo <= t <= hi] or [1.0]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_yticklabels([f"{t:g}×" for t in ticks])
        if xs_all:
            xticks = [x for x in (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536) if min(xs_all) <= x <= max(xs_all)]
            ax.xaxis.set_major_locator(FixedLocator(xticks))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([f"{x // 1024}k" if x >= 1024 else str(x) for x in xticks])
            ax.set_xlim(min(xs_all) / 1.5, max(xs_all) * 1.5)
        ax.set_title(titles[panel], fontsize=13)
        ax.set_ylabel(ylabels[panel], fontsize=9)
        ax.set_xlabel("tokens in the batch", fontsize=10)
        ax.grid(True, which="major", color="0.9")
        ax.tick_params(labelsize=9)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2 if panel == "floor" else 1, fontsize=9,
                  frameon=False)
    envs = [r["environment"] for r in records.values() if isinstance(r, dict) and r.get("environment")]
    dates = sorted(e["date"] for e in envs if e.get("date"))
    gpus = ", ".join(sorted({e["gpu"] for e in envs if e.get("gpu")})) or "unknown GPU"
    when = (dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}") if dates else "undated"
    fig.suptitle(f"moefuse on {gpus}, runs of {when}:\nDeepSeek-V3 shapes (MXFP4: DeepSeek-V4-Flash), "
                 "device time under CUDA-graph replay; each stage on one GPU", fontsize=12)
    fig.text(0.5, 0.01, "Peers: moefuse/bench/anchors_<gpu>.json (each stage's GPU model, their own runs); cuBLAS "
             "and torch's grouped GEMMs in the same run. Each stage's GPU, date and full tables: results/RESULTS.md.",
             ha="center", fontsize=8, color="0.35")
    fig.tight_layout(rect=(0, 0.03, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


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
    """RESULTS.md, results.png and summary.png from every ``<stage>.json`` in ``out`` (each tagged with its run)."""
    records = {stage: json.loads((out / f"{stage}.json").read_text()) for stage in STAGES
               if (out / f"{stage}.json").exists()}
    parts = ["# moefuse GPU results\n\nWritten by `moefuse bench`. Times are device time per call under CUDA-graph "
             "replay (median of many replays, inputs rotated past the L2 where they are small); floors come from "
             "ceilings measured in the same run. Each stage says when and on what it ran.\n\n"
             "![summary](summary.png)\n\n![results](results.png)"]
    for stage, record in records.items():
        env, module = record["environment"], importlib.import_module(f"moefuse.bench.{stage}")
        ceilings = ", ".join(f"{k} {v:.3g}" for k, v in record["ceilings"].items())
        parts.append(f"## {stage}\n\n{env['date']}, {env['gpu']}, torch {env['torch']}, Triton {env['triton']}, "
                     f"Python {env['python']}. Ceilings: {ceilings}" + (f". {env['note']}" if env.get("note") else ""))
        if record.get("checks"):
            parts.append(report.format_table(record["checks"], module.CHECK_COLUMNS, f"{stage}: checks"))
        parts.append(report.format_table(record["rows"], module.COLUMNS, module.TITLE))
    (out / "RESULTS.md").write_text("\n\n".join(parts) + "\n")
    latest = max((r["environment"] for r in records.values()), key=lambda e: e["date"], default=None)
    if latest:
        plot({"environment": latest, "stages": {s: r["rows"] for s, r in records.items()}}, out / "results.png")
        summary_plot(records, out / "summary.png")


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
    _progress(f"wrote {out}/<stage>.json, {out / 'RESULTS.md'}, {out / 'results.png'}, {out / 'summary.png'}")
    return 0 if ok else 1
