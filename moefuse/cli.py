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

from moefuse import formats
from moefuse._runtime import env_override
from moefuse.bench.report import format_table
from moefuse.bench.run import STAGES as BENCH_STAGES
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
    from moefuse.layer import MoELayer, moe_layer_torch

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
                         activation_quant=ACTIVATION_QUANTS[args.activation_quant]).init_random_(args.seed)
    except ValueError as error:  # a combination without kernels (e.g. --activation-quant none --quant fp8)
        print(f"moefuse: {error}", file=sys.stderr)
        return 2
    aq = layer.activation_quant
    gen = torch.Generator(device).manual_seed(args.seed + 1)
    x = torch.randn(args.tokens, config.hidden_size, generator=gen, device=device, dtype=dtype)

    progress(f"running {args.tokens} tokens")
    with torch.no_grad():
        out = layer(x)
        with env_override("MOEFUSE_ENABLE_DEFERRED_FINALIZE", "0"):
            out_plain = layer(x)
        progress("float64 reference")
        ref = moe_layer_torch(layer, x, route_dtype=torch.float32)

        rows = []
        if not args.no_timing:
            progress("timing stages")
            c = config
            weights, ids = layer.gate(x)
            gate_up, down = layer.experts.weights()
            block_m = plan_block_m(x.shape[0], gate_up, c.top_k, dtype, aq)
            plan = moe_dispatch(ids, c.num_experts, block_m, backend=backend)
            gemm2_out = moe_experts(x, gate_up, down, plan, swiglu_limit=c.swiglu_limit, activation_quant=aq,
                                    backend=backend)
            shared = layer._shared(x) if layer.shared_experts is not None else None

            def plain_layer() -> torch.Tensor:
                with env_override("MOEFUSE_ENABLE_DEFERRED_FINALIZE", "0"):
                    return layer(x)

            stages: dict[str, Callable[[], object]] = {
                "router (linear + fused gate)": lambda: layer.gate(x),
                "dispatch": lambda: moe_dispatch(ids, c.num_experts, plan.block_m, backend=backend),
                "experts (GEMM1 + SwiGLU + GEMM2)": lambda: moe_experts(
                    x, gate_up, down, plan, swiglu_limit=c.swiglu_limit, activation_quant=aq, backend=backend),
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

    return bench_main(stages=args.stages, quick=args.quick, results_dir=args.results_dir)


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
                       help=f"any of {', '.join(BENCH_STAGES)} (default: all)")
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
