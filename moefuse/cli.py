"""Command line: ``moefuse`` runs a MoE layer end to end and checks it; ``moefuse bench`` runs the GPU benchmarks.

``moefuse`` (the README's first command) builds a layer from a preset (DeepSeek-V3 by default) with seeded
random weights, full size on a GPU and scaled down on the CPU, runs a batch through it, compares the output with
the float64 reference and prints a table of per-stage times and the agreement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from moefuse import __version__, formats
from moefuse._runtime import defaults
from moefuse.bench.report import format_table
from moefuse.bench.run import STAGES as BENCH_STAGES
from moefuse.bench.sweep import FORMATS as SWEEP_FORMATS
from moefuse.bench.sweep import MODELS as SWEEP_MODELS
from moefuse.config import PRESETS, preset
from moefuse.formats import LAYER_FORMATS, resolve_activation_quant
from moefuse.testing import rel_error, rms_rel_error

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUANT_CHOICES = [name for name in LAYER_FORMATS if name is not None]  # --quant: the weight formats by name
# --activation-quant's words -> MoELayer(activation_quant=...)
# --activation-quant: what formats.ACTIVATION_QUANTS holds, None spelled "none"
ACTIVATION_QUANTS: dict[str, str | None] = {q or "none": q for q in formats.ACTIVATION_QUANTS}
ACTIVATION_QUANT_HELP = ("the routed experts' activations: the weight format's default (unquantized; fp8 for fp8 "
                         "experts), none, or fp8 (per token and 128 columns: W8A8, and W4A8 with --quant mxfp4)")


def progress(message: str) -> None:
    """One line of progress on stderr, so tables on stdout stay clean."""
    print(f"[moefuse {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _time_us(fn: Callable[[], object], device: torch.device, graph: bool) -> tuple[float, str]:
    """Time of one call and how it was taken: CUDA-graph replay on a GPU when ``graph``; else the median wall time
    of several synchronised eager calls after two warm-up calls (the reference backend reads values back to the
    host, which a graph cannot capture)."""
    if device.type == "cuda" and graph:
        from moefuse.bench.timing import graph_time_us

        return graph_time_us([fn], replays=20), "graph replay"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    samples = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples), "eager, wall clock"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run_layer(args: argparse.Namespace) -> int:
    from moefuse.dispatch import moe_dispatch
    from moefuse.experts import moe_experts, plan_block_m
    from moefuse.finalize import moe_finalize_fuse_shared
    from moefuse.layer import MoELayer
    from moefuse.reference import moe_layer_torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = preset(args.preset)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" or args.quant else "fp32")]
    if device.type != "cuda" and not args.full_size:
        config = config.scaled()  # same routing, small widths: the CPU runs the reference in seconds
    backend = args.backend
    progress(f"building {args.preset} layer on {device} (H={config.hidden_size}, I={config.intermediate_size}, "
             f"E={config.num_experts}, top-{config.top_k}, {str(dtype).removeprefix('torch.')}, backend={backend})")
    try:
        layer = MoELayer(config, dtype=dtype, device=device, backend=backend, quant=args.quant,
                         activation_quant=ACTIVATION_QUANTS[args.activation_quant],
                         batch_invariant=args.batch_invariant or None).init_random_(args.seed)
    except ValueError as error:  # a combination without kernels (e.g. --activation-quant none --quant fp8)
        print(f"moefuse: {error}", file=sys.stderr)
        return 2
    aq = layer.activation_quant
    gen = torch.Generator(device).manual_seed(args.seed + 1)
    x = torch.randn(args.tokens, config.hidden_size, generator=gen, device=device, dtype=dtype)

    progress(f"running {args.tokens} tokens")
    with torch.no_grad():
        out = layer(x)
        with defaults(deferred_finalize=False):
            out_plain = layer(x)
        progress("float64 reference")
        ref = moe_layer_torch(layer, x, route_dtype=torch.float32)

        rows = []
        if not args.no_timing:
            progress("timing stages")
            c = config
            weights, ids = layer.gate(x)
            gate_up, down = layer.experts.weights()
            invariant = args.batch_invariant or None
            block_m = plan_block_m(x.shape[0], gate_up, c.top_k, dtype, aq, batch_invariant=invariant)
            plan = moe_dispatch(ids, c.num_experts, block_m, backend=backend)
            gemm2_out = moe_experts(x, gate_up, down, plan, swiglu_limit=c.swiglu_limit, activation_quant=aq,
                                    backend=backend, batch_invariant=invariant)
            shared = layer._shared(x) if layer.shared_experts is not None else None

            def plain_layer() -> torch.Tensor:
                with defaults(deferred_finalize=False):
                    return layer(x)

            stages: dict[str, Callable[[], object]] = {
                "router (linear + fused gate)": lambda: layer.gate(x),
                "dispatch": lambda: moe_dispatch(ids, c.num_experts, plan.block_m, backend=backend),
                "experts (GEMM1 + SwiGLU + GEMM2)": lambda: moe_experts(
                    x, gate_up, down, plan, swiglu_limit=c.swiglu_limit, activation_quant=aq, backend=backend,
                    batch_invariant=invariant),
                "finalize + shared add": lambda: moe_finalize_fuse_shared(
                    gemm2_out, plan.expanded_to_permuted, weights, shared, c.top_k, backend=backend),
                "layer, deferred finalize": lambda: layer(x),
                "layer, no deferral": plain_layer,
            }
            if shared is not None:
                stages["shared expert"] = lambda: layer._shared(x)
            graph = backend != "reference"  # the reference reads expert offsets back to the host
            for name, fn in stages.items():
                us, how = _time_us(fn, device, graph)
                rows.append({"stage": name, "us": us, "how": how})

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    scaled = f", scaled down to H={config.hidden_size}, I={config.intermediate_size}"
    size = "" if config == preset(args.preset) else scaled
    quant = f", {args.quant} experts" if args.quant else ""
    if aq != resolve_activation_quant(layer.experts.weights()[0], "default"):  # not the format's default: say so
        quant += f", {aq} activations"
    title = f"{args.preset}{size}{quant}: {args.tokens} tokens on {where}, backend {backend}"
    columns = [("stage", "stage"), ("us", "time (µs)"), ("how", "timed by")]
    print(format_table(rows, columns, title) if rows else f"### {title}")
    tol = 1e-2 if dtype != torch.float32 else 1e-5
    checks: list[dict[str, Any]] = [
        {"what": "layer vs float64 reference (max-normalised)", "error": rel_error(out, ref), "tolerance": tol},
        {"what": "layer vs float64 reference (RMS)", "error": rms_rel_error(out, ref), "tolerance": tol},
        {"what": "deferred vs non-deferred", "error": rel_error(out, out_plain), "tolerance": tol},
    ]
    if args.batch_invariant and layer.backend != "reference" and args.tokens > 1:
        # The promise itself: the middle token run alone gives the bits it got inside the batch.
        with torch.no_grad():
            at = args.tokens // 2
            alone = layer(x[at:at + 1])[0]
        checks.append({"what": f"token {at} alone vs in the batch (bitwise)", "error": float(
            (alone.float() - out[at].float()).abs().max()) if not torch.equal(alone, out[at]) else 0.0,
            "tolerance": 0.0})
    ok = all(row["error"] <= row["tolerance"] for row in checks)
    for row in checks:
        row["ok"] = "yes" if row["error"] <= row["tolerance"] else "NO"
    print()
    print(format_table(checks, [("what", "check"), ("error", "error"), ("tolerance", "tolerance"), ("ok", "ok")]))
    return 0 if ok else 1


def run_warmup(args: argparse.Namespace) -> int:
    from moefuse.layer import MoELayer
    from moefuse.warmup import warmup

    if not torch.cuda.is_available():
        print("moefuse warmup needs a CUDA GPU (on the CPU nothing is compiled)", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype or "bf16"]
    weights = f", {args.quant} experts" if args.quant else ""
    progress(f"building {args.preset} layer ({str(dtype).removeprefix('torch.')}{weights})")
    try:
        layer = MoELayer(preset(args.preset), dtype=dtype, device="cuda", quant=args.quant,
                         activation_quant=ACTIVATION_QUANTS[args.activation_quant]).init_random_(0)
    except ValueError as error:
        print(f"moefuse warmup: {error}", file=sys.stderr)
        return 2
    report = warmup(layer, args.max_tokens)
    print(report)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from moefuse.bench.run import main as bench_main

    if "sweep" in args.stages:
        if args.stages != ["sweep"]:
            print("moefuse bench: run sweep on its own (moefuse bench sweep)", file=sys.stderr)
            return 2
        return run_sweep(args)
    return bench_main(stages=args.stages, quick=args.quick, results_dir=args.results_dir)


def run_sweep(args: argparse.Namespace) -> int:
    """``moefuse bench sweep``: the layer over a dense token grid per preset and format, to results/sweep_<gpu>.json
    and .png, and the cliffs found."""
    from pathlib import Path

    from moefuse.bench import sweep, timing

    if not torch.cuda.is_available():
        print("moefuse bench sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    progress("measuring ceilings")
    ceilings = timing.measure_ceilings()
    env = timing.environment()
    gpu = env["gpu"].removeprefix("NVIDIA ").split()[0].lower()
    # a quick sweep (every fourth size) is kept apart: merged into the dense one it would leave holes in its grid
    name = f"sweep_{gpu}" + ("_invariant" if args.batch_invariant else "") + ("_quick" if args.quick else "")
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    tags = {**env, "batch_invariant": args.batch_invariant, "passes": args.passes, "moefuse": __version__}
    path = out / f"{name}.json"
    # A sweep of some models and formats replaces those series of this GPU's sweep and keeps the rest
    base = sweep.load(path) if path.exists() else None
    if base is not None and base.get("gpu") != env["gpu"]:
        progress(f"{path} holds a sweep of another GPU ({base.get('gpu')}): this one replaces it")

    def save(done: list[dict]) -> None:
        merged, series = sweep.merge(base, done, tags)
        sweep.write(merged, path, {**{k: v for k, v in tags.items() if k != "passes"}, "series": series})

    rows = sweep.run(ceilings, quick=args.quick, models=args.models, formats=args.formats, progress=progress,
                     batch_invariant=args.batch_invariant, passes=args.passes, checkpoint=save)
    save(rows)
    data = sweep.load(path)
    try:
        sweep.plot(data, out / f"{name}.png")
    except ImportError:
        progress("matplotlib missing: no plot (pip install moefuse[bench])")
    print(format_table(sweep.summary(rows), sweep.SUMMARY_COLUMNS, f"{sweep.TITLE}: {env['gpu']}"))
    cliffs = data["cliffs"]
    print()
    print(format_table(cliffs, sweep.CLIFF_COLUMNS, f"cliffs (a size more than {sweep.TOLERANCE:.0%} faster than a "
                                                    "smaller one)") if cliffs else "no cliffs")
    losses = data["slower_than_transformers"]
    if losses:
        print()
        print(format_table(losses, sweep.COLUMNS, "sizes where transformers' grouped_mm block was faster"))
    progress(f"wrote {path}" + (f" (other series kept from {base['date']})" if base is not None
                                and len(data["rows"]) > len(rows) else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moefuse", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run a MoE layer end to end and check it (the default)")
    for p in (parser, run):
        p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS), help="model (SPEC §4)")
        p.add_argument("--tokens", type=_positive_int, default=128, help="tokens in the batch (>= 1)")
        p.add_argument("--backend", default="auto", choices=("auto", "triton", "reference"))
        p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                       help="activations (and unquantized weights); default: bf16 on GPU or with --quant, else fp32")
        p.add_argument("--quant", default=None, choices=QUANT_CHOICES,
                       help="expert weights in fp8 block-scale (SPEC §5) or MXFP4 (SPEC §6)")
        p.add_argument("--activation-quant", default="default", choices=sorted(ACTIVATION_QUANTS),
                       help=ACTIVATION_QUANT_HELP)
        p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
        p.add_argument("--full-size", action="store_true", help="on CPU, use the real widths too (slow)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--no-timing", action="store_true", help="skip the per-stage timing")
        p.add_argument("--batch-invariant", action="store_true",
                       help="batch-invariant kernels (a token's output the same bits in any batch), and check it")
    warm = sub.add_parser("warmup", help="compile every kernel variant of a preset layer up to a token count (GPU)")
    warm.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    warm.add_argument("--max-tokens", type=_positive_int, default=4096, help="largest batch to prepare for")
    warm.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16")
    warm.add_argument("--quant", default=None, choices=QUANT_CHOICES,
                      help="expert weights in fp8 block-scale or MXFP4, as the deployment runs them")
    warm.add_argument("--activation-quant", default="default", choices=sorted(ACTIVATION_QUANTS),
                      help=ACTIVATION_QUANT_HELP)
    bench = sub.add_parser("bench", help="GPU benchmarks: tables, results file and plot")
    bench.add_argument("stages", nargs="*", default=list(BENCH_STAGES),
                       help=f"any of {', '.join(BENCH_STAGES)} (default: all); or sweep alone: the layer over a "
                            "dense grid of token counts per preset and format, and the cliffs found")
    bench.add_argument("--models", nargs="+", default=list(SWEEP_MODELS), choices=sorted(PRESETS),
                       help="sweep: the presets (with --formats, the series it replaces in this GPU's sweep file; "
                            "the others are kept)")
    bench.add_argument("--formats", nargs="+", default=list(SWEEP_FORMATS), choices=list(SWEEP_FORMATS),
                       help="sweep: the expert weight formats")
    bench.add_argument("--batch-invariant", action="store_true", help="sweep: the batch-invariant layer")
    bench.add_argument("--passes", type=_positive_int, default=1,
                       help="sweep: passes over the grid, alternately forwards and backwards; each size's median")
    bench.add_argument("--quick", action="store_true", help="fewer sizes")
    bench.add_argument("--results-dir", default="results", help="where <stage>.json, RESULTS.md and the plot go")
    args = parser.parse_args(argv)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "warmup":
        return run_warmup(args)
    return run_layer(args)


if __name__ == "__main__":
    sys.exit(main())
