"""Dispatch + experts on the GPU: correctness at full model sizes, and device time against floors and anchors.

``check(device)`` runs the Triton dispatch and experts on the full DeepSeek-V3, Kimi-K2 and DeepSeek-V4-Flash
expert shapes in bf16 (weights ~ N(0, 0.02^2) like trained ones, a padded slot in the batch), and compares:
the plan with the reference plan (exact), gemm2_out with the fp32 reference on the same weights (relative
error <= 1e-2), and a CUDA-graph replay of dispatch + experts on new inputs with the eager result (exact).

``run(ceilings, quick)`` times DeepSeek-V3 routed experts (E=256, H=7168, I=2048, top-8, bf16; routing: random
distinct top-8 per token) under CUDA-graph replay, one row per stage and token count:

- ``dispatch``, ``gemm1+swiglu``, ``gemm2``: each launch on its own (the GEMMs with the plan prepared);
- ``routed experts``: GEMM1 + GEMM2 + the weighted combine over k (finalize, without a shared expert) and
  without dispatch, which is what the anchor (the best public Triton MoE, best config) measured;
- ``routed experts + dispatch``: the whole stage as a model runs it (prefill against dense GEMMs: ``prefill.py``).

Floors: the touched experts' weight bytes at the measured read bandwidth, and 2·M·K·3·H·I flops at the
measured bf16 GEMM rate. A torch baseline (``torch._grouped_mm``, else a per-expert loop) runs the same GEMMs.

``python -m moefuse.bench.experts [--quick] [--no-check]`` runs both standalone. Importing needs no GPU.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from moefuse.bench import report, timing
from moefuse.config import preset
from moefuse.dispatch import moe_dispatch
from moefuse.experts import configs, moe_experts, moe_experts_torch, pick_block_m
from moefuse.experts.bf16 import gemm1_swiglu, gemm2
from moefuse.finalize import moe_finalize_fuse_shared
from moefuse.testing import rel_error

TOKENS = (1, 16, 128, 1024, 4096)
QUICK_TOKENS = (1, 128, 4096)
CHECK_MODELS = ("deepseek-v3", "kimi-k2", "deepseek-v4-flash")
CHECK_TOKENS = (1, 5, 64, 300)
TOLERANCE = 1e-2
WEIGHT_STD = 0.02

COLUMNS = [
    ("stage", "stage"), ("M", "M"), ("experts_touched", "experts"), ("block_m", "BLOCK_M"), ("us", "moefuse µs"),
    ("mem_floor_us", "weight-read floor µs"), ("compute_floor_us", "compute floor µs"), ("x_floor", "× floor"),
    ("anchor_us", "best public Triton µs"), ("speedup", "speedup"), ("torch_us", "torch µs"),
]
TITLE = "experts: DeepSeek-V3 routed experts (E=256, H=7168, I=2048, top-8, bf16, CUDA-graph replay)"
CHECK_COLUMNS = [
    ("model", "model"), ("M", "M"), ("check", "check"), ("err", "rel err"), ("tol", "tol"), ("ok", "ok"),
]


def _weights(E: int, H: int, I: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 gate_up_proj [E, 2I, H] and down_proj [E, H, I], ~ N(0, 0.02^2), made in place (no fp32 copy)."""
    w1 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=device).normal_(0, WEIGHT_STD, generator=gen)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=device).normal_(0, WEIGHT_STD, generator=gen)
    return w1, w2


def _routing(M: int, E: int, K: int, device: torch.device, gen: torch.Generator, gain: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-K ids per token and their softmax weights (fp32), from logits N(0, 1) + ``gain``·log(p_e):
    p is a Zipf(1) popularity (p_e ∝ 1/rank) over a random order of the experts, so ``gain`` 0 routes uniformly
    and larger gains concentrate the tokens on fewer experts, as trained routers do (0.6: the busiest expert gets
    about 20x the mean load at 1024 tokens of DeepSeek-V3; 3.0: a few dozen experts get everything)."""
    logits = torch.randn(M, E, device=device, generator=gen)
    if gain:
        rank = torch.randperm(E, device=device, generator=gen).float() + 1
        logits += gain * torch.log(1 / rank / (1 / rank).sum())
    weights, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return weights, ids.int()


def load_stats(ids: torch.Tensor, E: int) -> tuple[int, float]:
    """(experts touched, busiest expert's rows over the mean of the touched ones) of a routing."""
    counts = torch.bincount(ids.reshape(-1).long().clamp(min=0), minlength=E).float()
    touched = counts > 0
    return int(touched.sum()), float(counts.max() / counts[touched].mean())


def check(device: str | torch.device = "cuda") -> list[dict[str, Any]]:
    """Full-size bf16 correctness of dispatch + experts; one row per (model, M, check)."""
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(0)
    rows: list[dict[str, Any]] = []
    for name in CHECK_MODELS:
        cfg = preset(name)
        E, H, I, K, limit = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k, cfg.swiglu_limit
        w1, w2 = _weights(E, H, I, device, gen)
        # With the clamp, activations 4x larger push ~15% of the gate values past the limit of 10.
        scale = 4.0 if limit is not None else 1.0
        for M in CHECK_TOKENS:
            x = torch.randn(M, H, device=device, generator=gen).mul_(scale).bfloat16()
            _, ids = _routing(M, E, K, device, gen)
            ids[-1, 0] = -1  # a padded slot: no row
            block_m = pick_block_m(M, E, H, I, K, torch.bfloat16)
            plan = moe_dispatch(ids, E, block_m, backend="triton")
            ref_plan = moe_dispatch(ids, E, block_m, backend="reference")
            same_plan = all(torch.equal(getattr(plan, f), getattr(ref_plan, f)) for f in (
                "expert_offsets", "permuted_to_expanded", "expanded_to_permuted", "tile_expert", "tile_row_start"))
            rows.append({"model": name, "M": M, "check": "plan == reference", "ok": same_plan})
            out = moe_experts(x, w1, w2, plan, swiglu_limit=limit, backend="triton")
            ref = moe_experts_torch(x, w1, w2, plan, swiglu_limit=limit, dtype=torch.float32,
                                    out=torch.empty(plan.num_rows, H, device=device))
            n_valid = int(plan.expert_offsets[-1])
            err = rel_error(out[:n_valid], ref[:n_valid])
            rows.append({"model": name, "M": M, "check": "gemm2_out vs fp32", "err": err, "tol": TOLERANCE,
                         "ok": err <= TOLERANCE})
        rows.append(_graph_check(name, w1, w2, limit, device, gen))
        del w1, w2
        torch.cuda.empty_cache()
    return rows


def _graph_check(name: str, w1: torch.Tensor, w2: torch.Tensor, limit: float | None, device: torch.device,
                 gen: torch.Generator) -> dict[str, Any]:
    """Capture dispatch + experts once, replay on new inputs copied into the static buffers: equal to eager."""
    E, H, I, K, M = w1.shape[0], w1.shape[2], w1.shape[1] // 2, preset(name).top_k, 64
    block_m = pick_block_m(M, E, H, I, K, torch.bfloat16)
    x = torch.randn(M, H, device=device, generator=gen).bfloat16()
    _, ids = _routing(M, E, K, device, gen)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        plan = moe_dispatch(ids, E, block_m)
        return moe_experts(x, w1, w2, plan, swiglu_limit=limit), plan.expert_offsets

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_offsets = step()
    x.copy_(torch.randn(M, H, device=device, generator=gen).bfloat16())
    ids.copy_(_routing(M, E, K, device, gen)[1])
    graph.replay()
    torch.cuda.synchronize()
    eager_out, eager_offsets = step()
    n_valid = int(eager_offsets[-1])
    same = torch.equal(static_offsets, eager_offsets) and torch.equal(static_out[:n_valid], eager_out[:n_valid])
    return {"model": name, "M": M, "check": "graph replay == eager", "ok": same}


def _torch_baseline(x, w1, w2, plan, n_valid: int) -> Callable[[], object]:
    """The same two GEMMs with PyTorch: ``torch._grouped_mm`` on permuted rows, else one matmul per expert."""
    I = w1.shape[1] // 2
    tokens = plan.permuted_to_expanded[:n_valid].long() // plan.top_k
    ends = plan.expert_offsets[1:]

    def grouped() -> torch.Tensor:
        gate_up = torch._grouped_mm(x[tokens], w1.transpose(1, 2), offs=ends)
        act = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]
        return torch._grouped_mm(act, w2.transpose(1, 2), offs=ends)

    if hasattr(torch, "_grouped_mm"):
        return grouped
    offsets = plan.expert_offsets.tolist()  # host copy before capture: the loop is static

    def loop() -> None:
        for e in range(w1.shape[0]):
            s, t = offsets[e], offsets[e + 1]
            if s < t:
                gate_up = x[tokens[s:t]] @ w1[e].T
                (torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]) @ w2[e].T

    return loop


def run(ceilings: timing.Ceilings, quick: bool = False) -> list[dict[str, Any]]:
    """Time DeepSeek-V3 routed experts; see the module docstring for the rows."""
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    cfg = preset("deepseek-v3")
    E, H, I, K = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    w1, w2 = _weights(E, H, I, device, gen)
    anchor_rows = report.anchors(torch.cuda.get_device_name())["routed_experts_best_public_triton"]["rows"]
    anchors = {row["tokens"]: row["best_config_us"] for row in anchor_rows}
    rows: list[dict[str, Any]] = []
    for M in QUICK_TOKENS if quick else TOKENS:
        x = torch.randn(M, H, device=device, generator=gen).bfloat16()
        weights, ids = _routing(M, E, K, device, gen)
        config = configs.pick(M, E, H, I, K, torch.bfloat16, configs.arch_of(device))
        plan = moe_dispatch(ids, E, config.block_m)
        n_valid = int(plan.expert_offsets[-1])
        touched = int(torch.unique(ids).numel())
        per_expert_bytes = 3 * H * I * 2
        inter = torch.empty(M * K, I, dtype=torch.bfloat16, device=device)
        out = torch.empty(M * K, H, dtype=torch.bfloat16, device=device)

        def experts_and_combine() -> None:
            moe_experts(x, w1, w2, plan, out=out)
            moe_finalize_fuse_shared(out, plan.expanded_to_permuted, weights, None, K)

        def whole() -> None:
            step_plan = moe_dispatch(ids, E, config.block_m)
            y = moe_experts(x, w1, w2, step_plan)
            moe_finalize_fuse_shared(y, step_plan.expanded_to_permuted, weights, None, K)

        base = {"M": M, "experts_touched": touched, "block_m": config.block_m}
        mem_floor = touched * per_expert_bytes / (ceilings.read_tbps * 1e12) * 1e6
        compute_floor = 2 * M * K * 3 * H * I / (ceilings.gemm_tflops * 1e12) * 1e6
        gemm1_us = timing.time_or_none([lambda: gemm1_swiglu(x, w1, plan, inter, config.gemm1)])
        gemm2_us = timing.time_or_none([lambda: gemm2(inter, w2, plan, out, config.gemm2)])
        stage_us = timing.time_or_none([experts_and_combine])
        total_us = timing.time_or_none([whole])
        anchor = anchors.get(M)
        rows += [
            base | {"stage": "dispatch", "us": timing.time_or_none([lambda: moe_dispatch(ids, E, config.block_m)])},
            base | {"stage": "gemm1+swiglu", "us": gemm1_us, "mem_floor_us": mem_floor * 2 / 3,
                    "compute_floor_us": compute_floor * 2 / 3},
            base | {"stage": "gemm2", "us": gemm2_us, "mem_floor_us": mem_floor / 3,
                    "compute_floor_us": compute_floor / 3},
            base | {"stage": "routed experts", "us": stage_us, "mem_floor_us": mem_floor,
                    "compute_floor_us": compute_floor, "anchor_us": anchor,
                    "torch_us": timing.time_or_none([_torch_baseline(x, w1, w2, plan, n_valid)])},
            base | {"stage": "routed experts + dispatch", "us": total_us, "mem_floor_us": mem_floor,
                    "compute_floor_us": compute_floor},
        ]
        for row in rows[-5:]:
            us = row["us"]
            if isinstance(us, float):
                floor = max(row.get("mem_floor_us") or 0.0, row.get("compute_floor_us") or 0.0)
                row["x_floor"] = us / floor if floor else None
                row["speedup"] = row["anchor_us"] / us if row.get("anchor_us") else None
    del w1, w2
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer token counts")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    args = parser.parse_args(argv)
    ok = True
    if not args.no_check:
        checks = check("cuda")
        ok = all(row["ok"] for row in checks)
        print(report.format_table(checks, CHECK_COLUMNS, "experts: checks"), flush=True)
    ceilings = timing.measure_ceilings()
    print(report.format_table(run(ceilings, quick=args.quick), COLUMNS, TITLE), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
