"""Finalize stage on the GPU: correctness on real shapes and device time against the memory floor.

``check(device)`` runs the Triton kernel on full-size bf16 shapes (rows in random order, absent slots, a
token with no rows, padding rows and columns) against the float64 reference, compares PDL on/off, and checks
that a captured CUDA graph replays to the eager result on new data.

``run(ceilings, quick)`` times, for each model shape and token count, under CUDA-graph replay with rotating
input sets: the fused kernel; the bytes it must move (every present row of H, the shared output, the output,
indices and weights) as TB/s and as a share of the measured copy bandwidth; the memory floor; the PyTorch
reference eager and under ``torch.compile``; and the unfused alternative (combine with our kernel, then a
separate ``torch.add`` of the shared output), which is what a non-deferred MoE block does.

``python -m moefuse.bench.finalize [--quick]`` runs both standalone. Importing this module needs no GPU.
"""

from __future__ import annotations

import argparse
import functools

import torch

from moefuse.bench import report, timing
from moefuse.finalize import moe_finalize_fuse_shared, moe_finalize_fuse_shared_torch
from moefuse.testing import max_ulp_distance, rel_error

# (label, H, top_k): DeepSeek-V3 / Kimi-K2, DeepSeek-V4-Flash, Qwen3-30B-A3B (SPEC §4).
CONFIGS = (("H=7168 top-8", 7168, 8), ("H=4096 top-6", 4096, 6), ("H=2048 top-8", 2048, 8))
TOKENS = (1, 16, 128, 1024, 4096, 16384)
QUICK_TOKENS = (1, 128, 4096)
CHECK_TOKENS = (1, 77, 2048)

COLUMNS = [
    ("config", "config"), ("M", "M"), ("us", "moefuse µs"), ("floor_us", "floor µs"), ("x_floor", "× floor"),
    ("tbps", "TB/s"), ("pct_copy", "% copy BW"), ("unfused_us", "unfused µs"), ("x_unfused", "speedup vs unfused"),
    ("eager_us", "PyTorch eager µs"), ("torch_compile_us", "torch.compile µs"), ("mbytes", "MB moved"),
]
TITLE = "finalize: fused combine + shared add (bf16, CUDA-graph replay)"
CHECK_COLUMNS = [
    ("config", "config"), ("M", "M"), ("shared", "shared"), ("err", "rel err vs float64"),
    ("max_ulps", "ulps vs fp32 ref"), ("pdl_equal", "PDL on == off"), ("graph_equal", "graph replay == eager"),
    ("ok", "ok"),
]


def _combine_then_add(inputs: dict, no_shared: dict, combined: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The unfused baseline: combine without the shared output, then a separate add."""
    return torch.add(moe_finalize_fuse_shared(**no_shared, out=combined), inputs["shared_output"], out=out)


def _inputs(
    num_tokens: int,
    hidden: int,
    top_k: int,
    *,
    shared: bool = True,
    absent: float = 0.0,
    pad_rows: int = 0,
    pad_cols: int = 0,
    device: torch.device | str = "cuda",
) -> dict:
    """One argument set of the op in bf16: rows in random order, a fraction ``absent`` of slots -1."""
    num_rows = num_tokens * top_k + pad_rows
    rows = torch.randperm(num_rows, device=device)[: num_tokens * top_k].int()
    if absent > 0:
        rows[torch.rand(rows.shape, device=device) < absent] = -1
        if num_tokens > 1:
            rows[:top_k] = -1  # a token whose experts all live elsewhere
    return {
        "gemm2_out": torch.randn(num_rows, hidden + pad_cols, device=device, dtype=torch.bfloat16),
        "expanded_idx_to_permuted_idx": rows,
        "expert_weights": torch.rand(num_tokens, top_k, device=device),
        "shared_output": torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16) if shared else None,
        "top_k": top_k,
    }


def _graph_replays_to_eager(inputs: dict) -> bool:
    """Capture the op on static inputs, refill them with new data, replay: equal to eager on the new data?"""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_finalize_fuse_shared(**inputs)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe_finalize_fuse_shared(**inputs)
    fresh = _inputs(inputs["expert_weights"].shape[0], static_out.shape[1], inputs["top_k"],
                    shared=inputs["shared_output"] is not None, absent=0.1,
                    pad_rows=inputs["gemm2_out"].shape[0] - inputs["expanded_idx_to_permuted_idx"].numel(),
                    pad_cols=inputs["gemm2_out"].shape[1] - static_out.shape[1], device=static_out.device)
    for key, value in fresh.items():
        if isinstance(value, torch.Tensor):
            inputs[key].copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(static_out, moe_finalize_fuse_shared(**inputs)))


def check(device: torch.device | str = "cuda") -> list[dict]:
    """Kernel vs float64 (≤ 1 bf16 ulp of the largest value), PDL on/off bit-equal, graph replay == eager.

    The ulp distance to the fp32 reference is reported, not judged: the GPU fuses multiply-add where the
    reference rounds twice, and where terms cancel to almost 0 that moves the result by many (tiny) ulps.
    """
    rows = []
    cases = [(config, tokens, True) for config in CONFIGS for tokens in CHECK_TOKENS]
    cases.append((CONFIGS[-1], 77, False))  # no shared expert (Qwen3): H = Hp
    for (label, hidden, top_k), tokens, shared in cases:
        inputs = _inputs(tokens, hidden, top_k, shared=shared, absent=0.1, pad_rows=64,
                         pad_cols=128 if shared else 0, device=device)
        out = moe_finalize_fuse_shared(**inputs, enable_pdl=True)
        exact = torch.empty(out.shape, dtype=torch.float64, device=device)
        moe_finalize_fuse_shared_torch(**inputs, out=exact, dtype=torch.float64)
        err = rel_error(out, exact)
        ulps = max_ulp_distance(out, moe_finalize_fuse_shared_torch(**inputs))
        pdl_equal = bool(torch.equal(out, moe_finalize_fuse_shared(**inputs, enable_pdl=False)))
        graph_equal = _graph_replays_to_eager(inputs)
        rows.append({
            "config": label, "M": tokens, "shared": shared, "err": err, "max_ulps": ulps, "pdl_equal": pdl_equal,
            "graph_equal": graph_equal,
            "ok": err <= torch.finfo(torch.bfloat16).eps and pdl_equal and graph_equal,
        })
    return rows


def _bytes_moved(tokens: int, hidden: int, top_k: int) -> int:
    """What any finalize must move with every slot present: top_k rows + shared in, out, indices and weights."""
    elem = torch.bfloat16.itemsize
    return tokens * top_k * hidden * elem + 2 * tokens * hidden * elem + tokens * top_k * (4 + 4)


def run(ceilings: timing.Ceilings, quick: bool = False) -> list[dict]:
    """Device time per call for every (config, M); see the module docstring for the columns."""
    rows = []
    for label, hidden, top_k in CONFIGS:
        torch._dynamo.reset()  # a fresh compile cache per config keeps the recompile limit out of the picture
        compiled = torch.compile(moe_finalize_fuse_shared_torch, dynamic=True)
        for tokens in QUICK_TOKENS if quick else TOKENS:
            nbytes = _bytes_moved(tokens, hidden, top_k)
            sets = [_inputs(tokens, hidden, top_k) for _ in range(timing.rotations(nbytes))]
            outs = [torch.empty_like(s["shared_output"]) for s in sets]
            combined = [torch.empty_like(s["shared_output"]) for s in sets]
            no_shared = [{**s, "shared_output": None} for s in sets]
            us = timing.graph_time_us(
                [functools.partial(moe_finalize_fuse_shared, **s, out=o) for s, o in zip(sets, outs)])
            unfused_us = timing.graph_time_us([
                functools.partial(_combine_then_add, s, n, c, o) for s, n, c, o in zip(sets, no_shared, combined, outs)
            ])
            eager_us = timing.time_or_none([functools.partial(moe_finalize_fuse_shared_torch, **s) for s in sets])
            compile_us = timing.time_or_none([functools.partial(compiled, **s) for s in sets])
            floor_us = ceilings.memory_floor_us(nbytes)
            tbps = nbytes / (us * 1e-6) / 1e12
            rows.append({
                "config": label, "M": tokens, "H": hidden, "top_k": top_k, "us": us, "mbytes": nbytes / 1e6,
                "tbps": tbps, "pct_copy": 100 * tbps / ceilings.copy_tbps, "floor_us": floor_us,
                "x_floor": us / floor_us, "unfused_us": unfused_us, "x_unfused": unfused_us / us,
                "eager_us": eager_us, "torch_compile_us": compile_us,
            })
            del sets, outs, combined, no_shared
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only M in {QUICK_TOKENS}")
    args = parser.parse_args(argv)
    print(report.format_table(check("cuda"), CHECK_COLUMNS, "finalize: bf16 vs float64 reference"), flush=True)
    print(report.format_table(run(timing.measure_ceilings(gemm=False), quick=args.quick), COLUMNS, TITLE))


if __name__ == "__main__":
    main()
