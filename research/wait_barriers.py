"""Does the warp-group barrier Triton 3.6 puts before each mbarrier wait cost the Gluon expert kernels time? (GPU.)

Triton 3.6 lowers ``mbarrier.wait`` in a partition of more than one warp after a ``bar.sync`` of the partition where
the barrier's allocation was waited on since the last barrier (in a ring, every step: a minimal two-partition kernel
shows it); Triton 3.9 emits none there (``scripts/sass.py``: one ``BAR.SYNC`` a K step in the MXFP4
consumers' loops against 3.6's two). Each consumer warp group of the ws kernels then meets at two barriers a step,
the one before the wait and the one before its arrival on the slot's empty barrier, and Nsight Compute puts the
consumers' largest stall at such barriers (docs/PERF-NOTES.md, MXFP4 W4A16).

Here each Gluon kernel the DeepSeek-V4-Flash routed experts launch runs twice over: as Triton builds it, and from
its own PTX with those barriers deleted (``strip_wait_barriers``; the compiler's ``ir_override`` option: the same
build up to the PTX, then ptxas on the edited text). Both are timed alternately under CUDA-graph replay in one
process, and their outputs compared bit for bit (the barriers order nothing the waits do not). Prints one JSON
object a token count: µs of each, the medians of ``--repeats`` alternations, and the barriers deleted a kernel.

    python -m research.wait_barriers [--tokens 1 16 128 1024 4096] [--formats W4A16 W4A8] [--repeats 5]

Where Triton emits no such barrier (3.9) there is nothing to delete and both columns time the same kernels.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

_SKIPPED = re.compile(r"\s*($|//|\.loc\b|\{|\.reg\b|[A-Za-z_$][\w$]*:)")  # between a barrier and the wait's loop


def strip_wait_barriers(ptx: str) -> tuple[str, int]:
    """``ptx`` without each ``bar.sync`` / ``barrier.sync`` whose next instruction is an ``mbarrier.try_wait``
    (comments, locations, braces, register declarations and labels between them skipped), and how many went."""
    lines = ptx.splitlines(keepends=True)
    keep = [True] * len(lines)
    for i, line in enumerate(lines):
        if not re.match(r"\s*(bar|barrier)\.sync\b", line):
            continue
        j = i + 1
        while j < len(lines) and _SKIPPED.match(lines[j]):
            j += 1
        if j < len(lines) and re.match(r"\s*(@!?%p\w+\s+)?mbarrier\.try_wait", lines[j]):
            keep[i] = False
    return "".join(line for line, k in zip(lines, keep) if k), keep.count(False)


class Stripped:
    """Stands in for a Gluon kernel (``kernel[grid](...)``): while ``on``, each launch runs the kernel built from its
    own PTX less the barriers before its waits, written once a compiled variant under ``folder``."""

    def __init__(self, kernel: Any, folder: Path):
        self.kernel, self.folder, self.on = kernel, folder, False
        self.deleted: dict[str, int] = {}  # PTX file: barriers deleted

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        if not self.on:
            return self.kernel[grid]

        def launch(*args: Any, **kwargs: Any) -> Any:
            compiled = self.kernel.run(*args, grid=grid, warmup=True, **kwargs)  # built, not launched
            compiled = compiled.result() if hasattr(compiled, "result") else compiled  # an asynchronous build
            path = self.folder / f"{compiled.hash}.ptx"
            if not path.exists():
                text, self.deleted[path.name] = strip_wait_barriers(compiled.asm["ptx"])
                path.write_text(text)
            return self.kernel.run(*args, grid=grid, warmup=False, ir_override=str(path), **kwargs)

        return launch


def main(argv: list[str] | None = None) -> None:
    import torch

    from moefuse.bench import timing
    from moefuse.config import preset
    from moefuse.experts.mxfp4 import w4a8, w4a8_decode, ws
    from moefuse.layer import MoELayer, routed_experts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024, 4096])
    parser.add_argument("--formats", nargs="+", default=["W4A16", "W4A8"], choices=["W4A16", "W4A8"])
    parser.add_argument("--repeats", type=int, default=5, help="alternating timings, the median kept")
    args = parser.parse_args(argv)
    kernels = [(ws, "_gemm1_ws_kernel"), (ws, "_gemm2_ws_kernel"), (w4a8_decode, "_gemm1_kernel"),
               (w4a8_decode, "_gemm2_kernel"), (w4a8, "_w4a8_kernel")]
    folder = Path(tempfile.mkdtemp(prefix="wait_barriers_"))
    proxies = []
    for module, name in kernels:
        proxies.append(Stripped(getattr(module, name), folder))
        setattr(module, name, proxies[-1])
    layer = MoELayer(preset("deepseek-v4-flash"), device="cuda", quant="mxfp4").init_random_(0)
    c = layer.config
    gate_up, down = layer.experts.weights()
    gen = torch.Generator("cuda").manual_seed(0)

    def switch(on: bool) -> None:
        for proxy in proxies:
            proxy.on = on

    try:
        for M in args.tokens:
            x = torch.randn(M, c.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
            with torch.no_grad():
                weights, ids = layer.gate(x)
            for fmt in args.formats:
                call = partial(routed_experts, x, gate_up, down, weights, ids, swiglu_limit=c.swiglu_limit,
                               activation_quant="fp8" if fmt == "W4A8" else None)
                outputs, times = {}, {"as_built": [], "stripped": []}
                for on in (False, True):
                    switch(on)
                    with torch.no_grad():
                        outputs[on] = call().clone()
                for _ in range(args.repeats):
                    for on in (False, True):
                        switch(on)
                        with torch.no_grad():
                            times["stripped" if on else "as_built"].append(
                                timing.graph_time_us([call], replays=50))
                switch(False)
                row = {"tokens": M, "format": fmt, "bitwise_equal": bool(torch.equal(outputs[False], outputs[True])),
                       **{f"{k}_us": round(statistics.median(v), 1) for k, v in times.items()},
                       "deleted": dict(sorted(proxies_deleted(proxies).items()))}
                row["stripped_over_as_built"] = round(row["stripped_us"] / row["as_built_us"], 4)
                print(json.dumps(row), flush=True)
    finally:
        switch(False)
        for (module, name), proxy in zip(kernels, proxies):
            setattr(module, name, proxy.kernel)


def proxies_deleted(proxies: list[Stripped]) -> dict[str, int]:
    """Barriers deleted, per PTX file written so far."""
    return {name: n for proxy in proxies for name, n in proxy.deleted.items()}


if __name__ == "__main__":
    main()
