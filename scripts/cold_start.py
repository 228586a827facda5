"""Cold start on a GPU: first call vs warm call before and after ``moefuse.warmup``, and what warm-up costs.

Per weight format (``--formats``: bf16 and fp8 on DeepSeek-V3, MXFP4 on DeepSeek-V4-Flash unless ``--preset``
names one), each measurement runs in a fresh Python process with its own Triton cache folder (``TRITON_CACHE_DIR``):

1. fresh cache, no warm-up: a full-size layer's first call at each token count vs a warm call at it;
2. fresh cache: ``warmup(layer, max_tokens)`` (seconds, variants), then the same first-vs-warm calls;
3. the cache that (2) left on disk, a new process: the warm-up again (what a container with a shipped cache pays);
4. with ``--all-presets``: warm-up of every preset in that format on a fresh cache (variants, seconds).

Writes ``results/cold_start.json`` and ``results/COLD_START.md``; the formats not run keep their earlier blocks.

    python scripts/cold_start.py [--formats bf16 fp8 mxfp4] [--preset NAME] [--max-tokens 4096] [--all-presets]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENS = (1, 7, 300, 512, 4096)
PRESETS = {"bf16": "deepseek-v3", "fp8": "deepseek-v3", "mxfp4": "deepseek-v4-flash"}  # as each ships


def child(fmt: str, preset: str, max_tokens: int, do_warmup: bool, first_calls: bool) -> dict:
    import torch

    from moefuse import MoELayer, warmup
    from moefuse import preset as get_preset

    quant = None if fmt == "bf16" else fmt
    layer = MoELayer(get_preset(preset), dtype=torch.bfloat16, device="cuda", quant=quant).init_random_(0)
    out: dict = {"preset": preset}
    if do_warmup:
        report = warmup(layer, max_tokens, progress=False)
        out |= {"warmup_s": report.seconds, "variants": report.compiled, "batch_sizes": len(report.token_counts),
                "graphs": report.graphs}
    if first_calls:
        rows = []
        with torch.no_grad():
            # The first call of a process may pay once for things no batch size owns (seen: 0.15 ms more at one
            # token after warm-up when that was the first call); a call at 2 tokens takes it, and is reported.
            x = torch.randn(2, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            start = time.perf_counter()
            layer(x)
            torch.cuda.synchronize()
            out["process_first_ms"] = (time.perf_counter() - start) * 1e3
            for tokens in TOKENS:
                # A new activation every call, so each call routes to other experts (as decode steps do): the
                # warm calls read weights no less cold than the first.
                xs = torch.randn(8, tokens, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
                times = []
                for x in xs:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    layer(x)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - start) * 1e3)
                first, warm = times[0], times[1:]
                rows.append({"M": tokens, "first_ms": first, "warm_ms": statistics.median(warm)})
        out["calls"] = rows
    return out


def run_child(cache: str, *args: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    proc = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(fmt: str, preset: str, max_tokens: int, all_presets: bool) -> dict:
    """One format's block: the three processes above (and every preset's warm-up with ``all_presets``)."""
    import torch
    import triton

    record: dict = {"format": fmt, "preset": preset, "date": datetime.date.today().isoformat(),
                    "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "max_tokens": max_tokens}
    m = str(max_tokens)
    with tempfile.TemporaryDirectory() as cold, tempfile.TemporaryDirectory() as shipped:
        print(f"{fmt} 1/3 fresh cache, no warm-up", file=sys.stderr, flush=True)
        record["no_warmup"] = run_child(cold, fmt, preset, m, "0", "1")
        print(f"{fmt} 2/3 fresh cache, warm-up", file=sys.stderr, flush=True)
        record["warmup_fresh"] = run_child(shipped, fmt, preset, m, "1", "1")
        print(f"{fmt} 3/3 warm disk cache, warm-up", file=sys.stderr, flush=True)
        record["warmup_disk"] = run_child(shipped, fmt, preset, m, "1", "0")
    if all_presets:
        from moefuse.config import PRESETS as ALL

        record["presets"] = []
        for name in sorted(ALL):
            print(f"{fmt} preset {name}: fresh-cache warm-up", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory() as cache:
                record["presets"].append(run_child(cache, fmt, name, m, "1", "0"))
    return record


def section(record: dict) -> str:
    """One format's block of COLD_START.md."""
    from moefuse.bench.report import format_table

    fmt, preset = record["format"], record["preset"]
    rows = []
    for before, after in zip(record["no_warmup"]["calls"], record["warmup_fresh"]["calls"]):
        rows.append({"M": before["M"], "b_first": before["first_ms"], "b_warm": before["warm_ms"],
                     "b_x": before["first_ms"] / before["warm_ms"], "a_first": after["first_ms"],
                     "a_warm": after["warm_ms"], "a_x": after["first_ms"] / after["warm_ms"]})
    calls = format_table(rows, [("M", "M"), ("b_first", "first call ms, no warm-up"), ("b_warm", "warm ms"),
                                ("b_x", "first / warm"), ("a_first", "first call ms after warm-up"),
                                ("a_warm", "warm ms"), ("a_x", "first / warm")],
                         f"{preset}, full size, {fmt}: first call vs warm call (wall clock, synchronised)")
    summary = [{"cache": "fresh", **record["warmup_fresh"]},
               {"cache": "on disk (from the run above)", **record["warmup_disk"]}]
    summary += [{"cache": "fresh", **r} for r in record.get("presets", [])]
    warm = format_table(summary, [("preset", "preset"), ("cache", "Triton cache"), ("warmup_s", "warm-up s"),
                                  ("variants", "kernel variants"), ("batch_sizes", "batch sizes run"),
                                  ("graphs", "decode graphs")], f"{fmt}: moefuse.warmup(layer, {record['max_tokens']})")
    head = (f"## {fmt}\n\nMeasured on {record['date']}, {record['gpu']}, torch {record['torch']}, Triton "
            f"{record['triton']}. Before the rows, each process makes one call at 2 tokens: "
            f"{record['no_warmup']['process_first_ms']:.2f} ms without warm-up, "
            f"{record['warmup_fresh']['process_first_ms']:.2f} ms after it.")
    return "\n\n".join([head, warm, calls])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", choices=sorted(PRESETS), default=["bf16"])
    parser.add_argument("--preset", help="one preset for every format (default: each format's model)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--all-presets", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--child", nargs=5, metavar=("FORMAT", "PRESET", "MAX", "WARMUP", "CALLS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        fmt, preset, max_tokens, do_warmup, calls = args.child
        print(json.dumps(child(fmt, preset, int(max_tokens), do_warmup == "1", calls == "1")))
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cold_start.json"
    blocks = {block["format"]: block for block in json.loads(path.read_text())["blocks"]} if path.exists() else {}
    for fmt in args.formats:
        blocks[fmt] = measure(fmt, args.preset or PRESETS[fmt], args.max_tokens, args.all_presets)
    ordered = [blocks[f] for f in PRESETS if f in blocks]
    path.write_text(json.dumps({"blocks": ordered}, indent=1))
    text = ("# Cold start\n\nWritten by `scripts/cold_start.py`. Each warm-up row and each first-call table comes from "
            "a fresh process with its own Triton cache folder; layers at full size with random weights.\n\n"
            + "\n\n".join(section(b) for b in ordered))
    (out / "COLD_START.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
