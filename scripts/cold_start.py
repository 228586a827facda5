"""Cold start on a GPU: first call vs warm call before and after ``moefuse.warmup``, and what warm-up costs.

Each measurement runs in a fresh Python process with its own Triton cache folder (``TRITON_CACHE_DIR``):

1. fresh cache, no warm-up: a full-size layer's first call at each token count vs a warm call at it;
2. fresh cache: ``warmup(layer, max_tokens)`` (seconds, variants), then the same first-vs-warm calls;
3. the cache that (2) left on disk, a new process: the warm-up again (what a container with a shipped cache pays);
4. with ``--all-presets``: warm-up of every preset on a fresh cache (variants, seconds).

Writes ``results/cold_start.json`` and ``results/COLD_START.md``.

    python scripts/cold_start.py [--preset deepseek-v3] [--max-tokens 4096] [--all-presets]
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


def child(preset: str, max_tokens: int, do_warmup: bool, first_calls: bool) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from moefuse import MoELayer, warmup
    from moefuse import preset as get_preset

    layer = MoELayer(get_preset(preset), dtype=torch.bfloat16, device="cuda").init_random_(0)
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
    env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--all-presets", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--child", nargs=4, metavar=("PRESET", "MAX", "WARMUP", "CALLS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        preset, max_tokens, do_warmup, calls = args.child
        print(json.dumps(child(preset, int(max_tokens), do_warmup == "1", calls == "1")))
        return

    import torch
    import triton

    sys.path.insert(0, str(ROOT))
    from moefuse.bench.report import format_table

    record: dict = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "triton": triton.__version__, "max_tokens": args.max_tokens}
    m = str(args.max_tokens)
    with tempfile.TemporaryDirectory() as cold, tempfile.TemporaryDirectory() as shipped:
        print("1/3 fresh cache, no warm-up", file=sys.stderr, flush=True)
        record["no_warmup"] = run_child(cold, args.preset, m, "0", "1")
        print("2/3 fresh cache, warm-up", file=sys.stderr, flush=True)
        record["warmup_fresh"] = run_child(shipped, args.preset, m, "1", "1")
        print("3/3 warm disk cache, warm-up", file=sys.stderr, flush=True)
        record["warmup_disk"] = run_child(shipped, args.preset, m, "1", "0")
    if args.all_presets:
        from moefuse.config import PRESETS

        record["presets"] = []
        for name in sorted(PRESETS):
            print(f"preset {name}: fresh-cache warm-up", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory() as cache:
                record["presets"].append(run_child(cache, name, m, "1", "0"))

    rows = []
    for before, after in zip(record["no_warmup"]["calls"], record["warmup_fresh"]["calls"]):
        rows.append({"M": before["M"], "b_first": before["first_ms"], "b_warm": before["warm_ms"],
                     "b_x": before["first_ms"] / before["warm_ms"], "a_first": after["first_ms"],
                     "a_warm": after["warm_ms"], "a_x": after["first_ms"] / after["warm_ms"]})
    calls = format_table(rows, [("M", "M"), ("b_first", "first call ms, no warm-up"), ("b_warm", "warm ms"),
                                ("b_x", "first / warm"), ("a_first", "first call ms after warm-up"),
                                ("a_warm", "warm ms"), ("a_x", "first / warm")],
                         f"{args.preset}, full size, bf16: first call vs warm call (wall clock, synchronised)")
    summary = [{"preset": args.preset, "cache": "fresh", **record["warmup_fresh"]},
               {"preset": args.preset, "cache": "on disk (from the run above)", **record["warmup_disk"]}]
    summary += [{"cache": "fresh", **r} for r in record.get("presets", [])]
    warm = format_table(summary, [("preset", "preset"), ("cache", "Triton cache"), ("warmup_s", "warm-up s"),
                                  ("variants", "kernel variants"), ("batch_sizes", "batch sizes run"),
                                  ("graphs", "decode graphs")], f"moefuse.warmup(layer, {args.max_tokens})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cold_start.json").write_text(json.dumps(record, indent=1))
    head = (f"# Cold start\n\nWritten by `scripts/cold_start.py` on {record['date']}, {record['gpu']}, torch "
            f"{record['torch']}, Triton {record['triton']}. Each block is a fresh process with its own Triton cache. "
            f"Before the rows, each process makes one call at 2 tokens: "
            f"{record['no_warmup']['process_first_ms']:.2f} ms without warm-up, "
            f"{record['warmup_fresh']['process_first_ms']:.2f} ms after it.")
    (out / "COLD_START.md").write_text("\n\n".join([head, warm, calls]) + "\n")
    print(warm)
    print()
    print(calls)


if __name__ == "__main__":
    main()
