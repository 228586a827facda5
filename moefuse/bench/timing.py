"""Device timing under CUDA-graph replay, and the ceilings every time is compared with.

A benchmark hands over a list of closures, each a complete call on its own set of inputs. The closures are
captured back to back into one CUDA graph, so launch gaps shrink to what a real decode step sees, and the
sets rotate so a time is not a time of the L2 cache. The graph is replayed many times and the median per-call
time is reported.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def graph_time_us(calls: Sequence[Callable[[], object]], *, replays: int = 50, warmup: int = 3,
                  min_calls: int = 10) -> float:
    """Median device time of one call, in microseconds, with the calls captured into one CUDA graph.

    Each replay runs every closure in ``calls`` (repeated until there are at least ``min_calls``); the time of a
    replay divided by the number of calls is one sample. Several calls per replay keep the graph's own launch
    (a few µs) out of a small kernel's time. Closures must be capturable (no host sync).
    """
    if not calls:
        raise ValueError("calls must not be empty")
    calls = list(calls) * -(-min_calls // len(calls))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):  # compile, autotune and allocate outside the graph
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(samples)


def event_time_us(fn: Callable[[], object], *, reps: int = 30, warmup: int = 3) -> float:
    """Median device time of ``fn`` called eagerly, CUDA events around each call, after ``warmup`` calls: for a call
    that cannot be captured in a CUDA graph (one that synchronises with the host)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def time_or_none(calls: Sequence[Callable[[], object]], *, replays: int = 20) -> float | None:
    """``graph_time_us`` of a baseline, or None (reported on stderr) when it cannot be compiled or captured here:
    a baseline that fails on some stack is a missing cell in the table, not a failed benchmark."""
    try:
        return graph_time_us(calls, replays=replays)
    except Exception as exc:  # noqa: BLE001
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        print(f"  baseline failed: {type(exc).__name__}: {first_line}", file=sys.stderr)
        return None


def rotations(bytes_per_set: int, *, l2_bytes: int = 60 << 20, at_most: int = 32) -> int:
    """How many input sets to rotate through so that together they overflow the L2 cache twice over."""
    return max(1, min(at_most, -(-2 * l2_bytes // max(bytes_per_set, 1))))


@dataclass(frozen=True)
class Ceilings:
    """What this GPU can do, measured in the same run as the benchmark."""

    empty_us: float  # graph-replay time of an empty kernel: the launch floor of any kernel
    copy_tbps: float  # device-to-device copy, bytes read + written per second / 1e12
    read_tbps: float  # a streaming sum over a large buffer, bytes read per second / 1e12
    gemm_tflops: float  # large bf16 matrix product on random data

    def memory_floor_us(self, nbytes: int) -> float:
        """Empty-kernel time plus ``nbytes`` at the measured copy bandwidth."""
        return self.empty_us + nbytes / (self.copy_tbps * 1e12) * 1e6


def _empty_kernel_us() -> float:
    import triton

    @triton.jit
    def _empty(x_ptr):
        pass

    x = torch.empty(1, device="cuda")
    return graph_time_us([lambda: _empty[(1,)](x)], replays=100, min_calls=20)


def measure_ceilings(*, gemm: bool = True) -> Ceilings:
    """Measure the launch floor, copy and read bandwidth, and (optionally) the bf16 GEMM rate."""
    n = 1 << 30  # bytes: 1 GiB, far past the L2
    # An SM kernel (neg: one read, one write per element), not copy_: a same-dtype copy_ is a memcpy, which a
    # CUDA graph hands to the copy engines, measured at ~2.6 TB/s here against ~4.3 TB/s for SM kernels.
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_us = graph_time_us([lambda: torch.neg(src, out=dst)], replays=20)
    total = torch.empty((), device="cuda")
    read_us = graph_time_us([lambda: torch.sum(src, dim=0, out=total)], replays=20)
    del src, dst
    tflops = float("nan")
    if gemm:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        c = torch.empty_like(a)
        mm_us = graph_time_us([lambda: torch.mm(a, b, out=c)], replays=10)
        tflops = 2 * 8192**3 / (mm_us * 1e-6) / 1e12
    torch.cuda.empty_cache()
    return Ceilings(
        empty_us=_empty_kernel_us(),
        copy_tbps=2 * n / (copy_us * 1e-6) / 1e12,
        read_tbps=n / (read_us * 1e-6) / 1e12,
        gemm_tflops=tflops,
    )


def environment() -> dict[str, str]:
    """The facts a results row is tagged with: date, GPU, versions."""
    import datetime
    import platform

    import triton

    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
