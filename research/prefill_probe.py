"""The persistent warp-specialized grouped GEMMs (``experts/persistent.py``) against the ``tl``
kernels (``experts/bf16.py``, the plan's 128-row tiles and the table's) and cuBLAS on the same work, on one GPU.

    python -m research.prefill_probe [--check] [--time] [--fp8] [--ragged] [--ncu-kernel tl|persistent] [--json FILE]

``--check``: the persistent kernels against the ``tl`` kernels and the float64 reference on DeepSeek-V3 shapes and
on narrow, ragged, clamped and empty-expert cases (max relative error per case). ``--time``: µs under CUDA-graph
replay, GEMMs only (the gather included for the persistent path), DeepSeek-V3 experts at 2,048 / 4,096 / 8,192 tokens
with exactly balanced routing (every expert M·K/E rows), random uniform routing and Zipf 0.6 / 1.0 at 4,096, beside
cuBLAS ``bmm`` on the same work as dense batches; each with items claimed from a counter (the default), every
grid-th item a program, and one item a program (the schedules measured before the counter became the default).
``--fp8``: the same for fp8 block-scale weights (``tl`` against persistent), and the persistent kernels' error
against SPEC §5's float64 emulation.
``--ragged``: where ragged routing's cost goes (measured on an H200, 2026-12-04): the default experts (``tl`` bf16, the
persistent fp8 kernels) and torch's grouped GEMMs on the same row counts (``bench.prefill.grouped_calls``) at 4,096
and 8,192 tokens, on balanced routing, on ``pmD`` (even experts D rows over the mean, odd ones D under: the same
rows, more items) and on uniform and Zipf routing; then fp8's time fitted, by least squares over the 4,096-token
controlled routings, as ``a`` per 128-row item + ``b`` per 64-row MMA block + ``c``, and that fit's prediction for
the other rows (the fixed part taken from 8,192's balanced row there).
``--ncu-kernel``: one GEMM1 launch of that kernel at 4,096 tokens with ``--routing``, for Nsight Compute (``ncu
--launch-skip 2 --launch-count 1``); with ``--gemm2``, one GEMM2 launch (``ncu -k`` the GEMM2 kernel,
``--launch-skip 2``).
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

from moefuse.bench import timing
from moefuse.bench.experts import _routing
from moefuse.bench.prefill import cublas_dense_equivalent, grouped_calls, scaled_grouped_mm_calls
from moefuse.dispatch import moe_dispatch
from moefuse.experts import configs, moe_experts, persistent, plan_block_m
from moefuse.experts.bf16 import gemm1_swiglu, gemm2
from moefuse.experts.reference import moe_experts_fp8_torch, moe_experts_torch
from moefuse.formats import BlockFP8
from moefuse.testing import rel_error, rms_rel_error

E, H, I, K = 256, 7168, 2048, 8  # DeepSeek-V3
# The schedules measured beside the default one (items claimed from a counter; keyword arguments of
# persistent.launch), timed for both operand types: every grid-th item a program (static); one item a program.
SCHEDULES: dict[str, dict[str, Any]] = {
    "static": {"dynamic": False},
    "item_per_program": {"programs": 1 << 30, "dynamic": False},
}


def balanced_ids(M: int, E: int, K: int, device: torch.device) -> torch.Tensor:
    """[M, K] ids, distinct per token, every expert exactly M·K/E times (M·K a multiple of E, K at most E)."""
    return ids_from_counts(torch.full((E,), M * K // E), M, K, device)


def ids_from_counts(counts: torch.Tensor, M: int, K: int, device: torch.device) -> torch.Tensor:
    """[M, K] ids, distinct per token, expert e exactly ``counts[e]`` times (each at most M, summing to M·K)."""
    flat = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts.to(device))
    return flat.view(K, M).t().contiguous().int()  # slot i -> token i % M: an expert's run meets distinct tokens


def weights(E: int, H: int, I: int, device: torch.device, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator(device).manual_seed(seed)
    w1 = torch.empty(E, 2 * I, H, dtype=dtype, device=device).normal_(0, 0.02, generator=gen)
    w2 = torch.empty(E, H, I, dtype=dtype, device=device).normal_(0, 0.02, generator=gen)
    return w1, w2


def check(device: torch.device) -> list[dict]:
    rows = []
    cases = [  # (E, H, I, K, M, routing, limit, dtype)
        (256, 7168, 2048, 8, 4096, "balanced", None, torch.bfloat16),
        (256, 7168, 2048, 8, 600, "uniform", None, torch.bfloat16),
        (9, 256, 128, 2, 37, "uniform", None, torch.bfloat16),
        (9, 256, 128, 2, 1, "uniform", 7.0, torch.bfloat16),
        (77, 512, 384, 6, 1000, "zipf", 0.5, torch.bfloat16),
        (16, 1024, 256, 4, 300, "empty", None, torch.float16),
        (300, 768, 256, 8, 513, "uniform", None, torch.bfloat16),
    ]
    for E_, H_, I_, K_, M, routing, limit, dtype in cases:
        w1, w2 = weights(E_, H_, I_, device, dtype, seed=E_ + M)
        gen = torch.Generator(device).manual_seed(M)
        x = torch.randn(M, H_, device=device, generator=gen).to(dtype)
        if routing == "balanced":
            ids = balanced_ids(M, E_, K_, device)
        else:
            ids = _routing(M, E_, K_, device, gen, 2.0 if routing == "zipf" else 0.0)[1]
            if routing == "empty":  # half the experts get nothing, a quarter of the slots are -1
                ids = torch.where(ids >= E_ // 2, ids - E_ // 2, ids)
                ids[::4, 0] = -1
        plan = moe_dispatch(ids, E_, persistent.BLOCK_M)
        n = int(plan.expert_offsets[-1])
        out = torch.zeros(plan.num_rows, H_, dtype=dtype, device=device)
        assert persistent.eligible(x, w1, w2, plan, out), (E_, H_, I_)
        persistent.experts_persistent(x, w1, w2, plan, out, limit)
        tl_out = moe_experts(x, w1, w2, plan, swiglu_limit=limit)
        static = torch.empty_like(out)
        persistent.experts_persistent(x, w1, w2, plan, static, limit, dynamic=False)
        row = {"case": f"E={E_} H={H_} I={I_} K={K_} M={M} {routing} limit={limit} {str(dtype)[6:]}",
               "vs_tl": rel_error(out[:n].float(), tl_out[:n].float()),
               "bitwise_equal_to_tl": bool(torch.equal(out[:n], tl_out[:n])),
               "static_bitwise_equal": bool(torch.equal(out[:n], static[:n]))}
        if E_ * H_ * I_ < 1e9 or M <= 600:
            ref = moe_experts_torch(x, w1, w2, plan, swiglu_limit=limit, dtype=torch.float64)
            row["vs_f64"] = rel_error(out[:n].double(), ref[:n])
            row["tl_vs_f64"] = rel_error(tl_out[:n].double(), ref[:n])
        rows.append(row)
        print(row, flush=True)
        del w1, w2
    return rows


def time_all(device: torch.device) -> list[dict]:
    w1, w2 = weights(E, H, I, device)
    gen = torch.Generator(device).manual_seed(1)
    rows = []
    for M, routing in [(4096, "balanced"), (4096, "uniform"), (2048, "balanced"), (8192, "balanced"),
                       (2048, "uniform"), (8192, "uniform"), (4096, "zipf-0.6"), (4096, "zipf-1.0"),
                       (1024, "uniform")]:
        x = torch.randn(M, H, device=device, generator=gen).bfloat16()
        ids = routed_ids(M, routing, device, gen)
        plan = moe_dispatch(ids, E, persistent.BLOCK_M)
        table_block_m = configs.pick_block_m(M, E, H, I, K, torch.bfloat16)
        table_plan = moe_dispatch(ids, E, table_block_m)
        out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=device)
        inter = torch.empty(plan.num_rows, I, dtype=torch.bfloat16, device=device)
        gathered = persistent.gather_rows(x, plan)
        tiles = configs.pick(M, E, H, I, K, torch.bfloat16, configs.arch_of(device), block_m=128)
        row: dict[str, Any] = {"M": M, "routing": routing, "table_block_m": table_block_m,
               "tiles": plan.tile_expert.numel(), "active_tiles": int((plan.tile_expert >= 0).sum()),
               "tl_128": timing.time_or_none([lambda: moe_experts(x, w1, w2, plan, out=out)]),
               "tl_table": timing.time_or_none([lambda: moe_experts(x, w1, w2, table_plan, out=out)]),
               "persistent": timing.time_or_none([lambda: persistent.experts_persistent(x, w1, w2, plan, out)]),
               "gather": timing.time_or_none([lambda: persistent.gather_rows(x, plan)]),
               "tl_gemm1": timing.time_or_none([lambda: gemm1_swiglu(x, w1, plan, inter, tiles.gemm1)]),
               "tl_gemm2": timing.time_or_none([lambda: gemm2(inter, w2, plan, out, tiles.gemm2)]),
               "p_gemm1": timing.time_or_none([lambda: persistent.launch(True, gathered, w1, plan, inter)]),
               "p_gemm2": timing.time_or_none([lambda: persistent.launch(False, inter, w2, plan, out)]),
               **{f"p_{name}": timing.time_or_none([partial(persistent.experts_persistent, x, w1, w2, plan, out, **kw)])
                  for name, kw in SCHEDULES.items()},
               "floor_us": int(torch.unique(ids).numel()) * 3 * H * I * 2 / 4.29e12 * 1e6}
        if routing == "balanced":
            row["cublas_bmm"] = cublas_dense_equivalent(M, E, H, I, K, device)
        best_tl = min(v for v in (row["tl_128"], row["tl_table"]) if v)
        row["persistent_vs_tl"] = row["persistent"] / best_tl if row["persistent"] else None
        if row.get("cublas_bmm"):
            row["persistent_vs_cublas"] = row["persistent"] / row["cublas_bmm"] if row["persistent"] else None
            row["tl_vs_cublas"] = best_tl / row["cublas_bmm"]
        rows.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def time_fp8(device: torch.device) -> list[dict]:
    """fp8 block-scale (SPEC §5): the ``tl`` kernels (128-row plan) against the persistent ones, DeepSeek-V3, and
    the persistent kernels' error against the float64 spec emulation on 256 tokens."""
    w1, w2 = weights(E, H, I, device)
    q1, q2 = BlockFP8.quantize(w1), BlockFP8.quantize(w2)
    del w1, w2
    gen = torch.Generator(device).manual_seed(2)
    rows = []
    for M, routing in [(4096, "balanced"), (4096, "uniform"), (8192, "uniform"), (4096, "zipf-1.0"),
                       (1024, "uniform")]:
        x = torch.randn(M, H, device=device, generator=gen).bfloat16()
        plan = moe_dispatch(routed_ids(M, routing, device, gen), E, persistent.BLOCK_M)
        out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=device)
        row = {"M": M, "routing": routing,
               "tl_fp8": timing.time_or_none([lambda: moe_experts(x, q1, q2, plan, out=out)]),
               "p_fp8": timing.time_or_none([lambda: persistent.experts_persistent_fp8(x, q1, q2, plan, out)]),
               **{f"p_fp8_{name}": timing.time_or_none([partial(
                   persistent.experts_persistent_fp8, x, q1, q2, plan, out, **kw)]) for name, kw in SCHEDULES.items()},
               "read_floor_us": int(torch.unique(plan.tile_expert[plan.tile_expert >= 0]).numel()) * 3 * H * I
               / 4.29e12 * 1e6}
        if M == 1024:  # the error against the spec's float64 emulation, on 256 of these tokens
            small = moe_dispatch(routed_ids(256, routing, device, gen), E, persistent.BLOCK_M)
            n = int(small.expert_offsets[-1])
            got = torch.empty(small.num_rows, H, dtype=torch.bfloat16, device=device)
            persistent.experts_persistent_fp8(x[:256], q1, q2, small, got)
            ref = moe_experts_fp8_torch(x[:256], q1, q2, small, dtype=torch.float64)
            row["err_vs_spec_256"] = rel_error(got[:n], ref[:n])
            row["rms_vs_spec_256"] = rms_rel_error(got[:n], ref[:n])
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def routed_ids(M: int, routing: str, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    if routing == "balanced":
        return balanced_ids(M, E, K, device)
    if routing.startswith("pm"):  # even experts D rows over the mean, odd ones D under
        d, mean = int(routing[2:]), M * K // E
        return ids_from_counts(torch.tensor([mean + (d if e % 2 == 0 else -d) for e in range(E)]), M, K, device)
    return _routing(M, E, K, device, gen, {"uniform": 0.0, "zipf-0.6": 0.6, "zipf-1.0": 1.0}[routing])[1]


RAGGED = [(4096, "balanced"), (4096, "pm1"), (4096, "pm16"), (4096, "pm64"), (4096, "uniform"), (4096, "zipf-0.6"),
          (4096, "zipf-1.0"), (8192, "balanced"), (8192, "uniform")]
FIT = ("balanced", "pm1", "pm16", "pm64", "uniform")  # the 4,096-token routings the fp8 fit takes


def fit_items_blocks(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least-squares ``(a, b, c)`` with µs ≈ a·items + b·blocks + c over ``(items, blocks, µs)`` points."""
    A = torch.tensor([[i, b, 1.0] for i, b, _ in points], dtype=torch.float64)
    y = torch.tensor([[us] for _, _, us in points], dtype=torch.float64)
    a, b, c = torch.linalg.lstsq(A, y).solution[:, 0].tolist()
    return a, b, c


def ragged(device: torch.device) -> list[dict]:
    """``--ragged`` (module docstring): µs under graph replay per routing, then the fp8 fit."""
    w1, w2 = weights(E, H, I, device)
    q1, q2 = BlockFP8.quantize(w1), BlockFP8.quantize(w2)
    gen = torch.Generator(device).manual_seed(1)
    rows = []
    for M, routing in RAGGED:
        ids = routed_ids(M, routing, device, gen)
        counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
        x = torch.randn(M, H, device=device, generator=gen).bfloat16()
        p16 = moe_dispatch(ids, E, plan_block_m(M, w1, K, torch.bfloat16))
        p8 = moe_dispatch(ids, E, plan_block_m(M, q1, K, torch.bfloat16))
        row = {"M": M, "routing": routing, "busiest": int(counts.max()),
               "items": int(((counts + 127) // 128).sum()), "blocks64": int(((counts + 63) // 64).sum()),
               "bf16": timing.time_or_none([lambda: moe_experts(x, w1, w2, p16)]),
               "grouped_bf16": timing.time_or_none([grouped_calls(counts, w1, w2)]),
               "fp8": timing.time_or_none([lambda: moe_experts(x, q1, q2, p8)]),
               "grouped_fp8": timing.time_or_none([grouped_calls(counts, q1.values, q2.values)])}
        if routing == "balanced":
            row["cublas_bmm"] = cublas_dense_equivalent(M, E, H, I, K, device)
        rows.append(row)
        print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    fit = [r for r in rows if r["M"] == 4096 and r["routing"] in FIT and r["fp8"]]
    if len(fit) >= 3:
        a, b, c = fit_items_blocks([(r["items"], r["blocks64"], r["fp8"]) for r in fit])
        fixed = {r["M"]: r["fp8"] - a * r["items"] - b * r["blocks64"]  # the pass grows with the rows
                 for r in rows if r["routing"] == "balanced" and r["fp8"]}
        fixed[4096] = c
        for r in rows:
            if r["M"] in fixed:
                r["fp8_fit"] = a * r["items"] + b * r["blocks64"] + fixed[r["M"]]
        print(f"fp8 fit: {a:.2f} µs per 128-row item + {b:.2f} per 64-row block + {c:.0f}", flush=True)
        rows.append({"fit_us_per_item": a, "fit_us_per_block64": b, "fit_us_fixed_4096": c})
    return rows


def ncu_launch(kernel: str, routing: str, device: torch.device, item_per_program: bool = False, fp8: bool = False,
               static: bool = False, second: bool = False) -> None:
    """Three GEMM1 launches at 4,096 tokens (ncu skips the first two: compile and warm-up); ``second`` (bf16):
    one GEMM1 launch, then three of GEMM2 on its intermediate (``-k`` GEMM2's kernel, ``--launch-skip 2``).
    ``fp8`` (persistent only): three fp8 block-scale experts calls, GEMM1 then GEMM2 each (``--launch-skip 4`` for
    the third GEMM1).
    ``sgmm``: ``torch._scaled_grouped_mm`` on the same work as dense groups, GEMM1 then GEMM2, three times."""
    if kernel == "sgmm":
        both = scaled_grouped_mm_calls(4096, E, H, I, K, device)
        for _ in range(3):
            both()
        torch.cuda.synchronize()
        return
    w1, w2 = weights(E, H, I, device)
    gen = torch.Generator(device).manual_seed(1)
    x = torch.randn(4096, H, device=device, generator=gen).bfloat16()
    plan = moe_dispatch(routed_ids(4096, routing, device, gen), E, persistent.BLOCK_M)
    programs = 1 << 30 if item_per_program else None
    if fp8:
        q1, q2 = BlockFP8.quantize(w1), BlockFP8.quantize(w2)
        out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            persistent.experts_persistent_fp8(x, q1, q2, plan, out, programs=programs, dynamic=not static)
        torch.cuda.synchronize()
        return
    inter = torch.empty(plan.num_rows, I, dtype=torch.bfloat16, device=device)
    tiles = configs.pick(4096, E, H, I, K, torch.bfloat16, configs.arch_of(device), block_m=128)
    rows = persistent.gather_rows(x, plan)
    if second:
        out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=device)
        gemm1_swiglu(x, w1, plan, inter, tiles.gemm1)
        for _ in range(3):
            if kernel == "tl":
                gemm2(inter, w2, plan, out, tiles.gemm2)
            else:
                persistent.launch(False, inter, w2, plan, out, programs=programs, dynamic=not static)
        torch.cuda.synchronize()
        return
    for _ in range(3):
        if kernel == "tl":
            gemm1_swiglu(x, w1, plan, inter, tiles.gemm1)
        else:
            persistent.launch(True, rows, w1, plan, inter, programs=programs, dynamic=not static)
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--fp8", action="store_true", help="time the fp8 block-scale kernels too")
    parser.add_argument("--ragged", action="store_true", help="where ragged routing's cost goes (docstring)")
    parser.add_argument("--ncu-kernel", choices=["tl", "persistent", "sgmm"])
    parser.add_argument("--routing", default="balanced", choices=["balanced", "uniform", "zipf-0.6", "zipf-1.0"])
    parser.add_argument("--item-per-program", action="store_true",
                        help="--ncu-kernel persistent: one program per item (the hardware schedules them)")
    parser.add_argument("--static", action="store_true",
                        help="--ncu-kernel persistent: every grid-th item a program, not claimed from a counter")
    parser.add_argument("--gemm2", action="store_true",
                        help="--ncu-kernel tl|persistent (bf16): GEMM2's launches, after one GEMM1 (--launch-skip 3)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    if args.ncu_kernel:
        ncu_launch(args.ncu_kernel, args.routing, device, args.item_per_program, args.fp8,
                   args.static, args.gemm2)
        return 0
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.check:
        result["check"] = check(device)
    if args.time:
        result["time"] = time_all(device)
    if args.fp8:
        result["fp8"] = time_fp8(device)
    if args.ragged:
        result["ragged"] = ragged(device)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
