"""Where does a one-token layer's graph replay spend its time, kernel by kernel, default against batch-invariant?
(GPU.)

Under Nsight Compute (kernels serialized, clocks fixed) the invariant fp8 layer's GEMM1 in halves takes what the
default's split GEMM1 takes, yet under graph replay the invariant routed experts with the shared slot take 167 µs
against 154. This probe captures each layer's one-token forward in a CUDA graph, replays it under torch.profiler
(which traces the kernels a graph launches) with a sync between replays, and prints, per kernel in start order, the
median start offset from the replay's first kernel and the median duration, with the replay's span and the idle or
overlapped time before each kernel (its start minus the latest end so far). One JSON object a line.

    python -m research.layer_graph_timeline [--cases deepseek-v3:fp8 deepseek-v4-flash:mxfp4] [--tokens 1] [--no-pdl]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from statistics import median

import torch

from moefuse import _runtime
from moefuse.config import preset
from moefuse.layer import MoELayer

Kernel = tuple[str, float, float]  # name, start and end in µs


def replays_of(kernels: Sequence[Kernel], replays: int) -> list[list[Kernel]]:
    """The kernels cut into ``replays`` replays of equally many, in start order (each replay launches the same
    graph: the same kernels)."""
    ordered = sorted(kernels, key=lambda k: k[1])
    if not replays or len(ordered) % replays:
        raise ValueError(f"{len(ordered)} kernels do not split into {replays} replays")
    n = len(ordered) // replays
    return [ordered[i * n:(i + 1) * n] for i in range(replays)]


def _keyed(run: Sequence[Kernel]) -> dict[tuple[str, int], int]:
    """Each kernel of a replay by its name and occurrence (two streams may start theirs in another order)."""
    seen: dict[str, int] = {}
    keys = {}
    for i, (name, _, _) in enumerate(run):
        keys[(name, seen.get(name, 0))] = i
        seen[name] = seen.get(name, 0) + 1
    return keys


def timeline(runs: Sequence[Sequence[Kernel]]) -> dict:
    """Per kernel (by name and occurrence, in the first replay's start order): the median start offset from the
    replay's first kernel, the median duration, and the median gap before it (its start minus the latest end of the
    kernels that started before it: negative where it overlaps them); the median span of a replay."""
    keyed = [_keyed(run) for run in runs]
    rows = []
    for key in keyed[0]:
        starts, durations, gaps = [], [], []
        for run, index in zip(runs, keyed):
            i = index[key]
            t0 = run[0][1]
            _, start, end = run[i]
            starts.append(start - t0)
            durations.append(end - start)
            gaps.append(start - max(k[2] for k in run[:i]) if i else 0.0)
        rows.append({"kernel": key[0][:48], "start_us": round(median(starts), 2),
                     "us": round(median(durations), 2), "gap_us": round(median(gaps), 2)})
    span = median(max(k[2] for k in run) - run[0][1] for run in runs)
    return {"span_us": round(span, 2), "kernels": rows}


def _graph(call: Callable[[], object]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def profile_replays(call: Callable[[], object], replays: int) -> dict:
    graph = _graph(call)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy")]
    return timeline(replays_of(kernels, replays))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", help="preset:format",
                        default=["deepseek-v3:fp8", "deepseek-v4-flash:mxfp4", "deepseek-v3:bf16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1])
    parser.add_argument("--replays", type=int, default=21)
    parser.add_argument("--no-pdl", action="store_true", help="every kernel launched without programmatic dependent "
                        "launch (no kernel starts under its predecessor's tail)")
    args = parser.parse_args(argv)
    if args.no_pdl:
        _runtime.pdl_enabled = lambda enable_pdl, device: False
    gen = torch.Generator("cuda").manual_seed(0)
    for case in args.cases:
        model, fmt = case.split(":")
        layer = MoELayer(preset(model), device="cuda", quant=None if fmt == "bf16" else fmt).init_random_(0)
        for M in args.tokens:
            x = torch.randn(M, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
            for invariant in (False, True):
                layer.batch_invariant = invariant
                with torch.no_grad():
                    row = profile_replays(lambda: layer(x), args.replays)
                print(json.dumps({"model": model, "format": fmt, "M": M, "batch_invariant": invariant,
                                  "pdl": not args.no_pdl, **row}),
                      flush=True)
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
