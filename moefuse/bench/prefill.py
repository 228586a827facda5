"""Prefill on the GPU: the routed experts' whole stage at 1,024-8,192 tokens against dense GEMMs doing the same work.

``run(ceilings, quick)``, DeepSeek-V3 routed experts (E=256, H=7168, I=2048, top-8) under CUDA-graph replay, one row
per format, routing and token count of ``routed experts + dispatch`` (dispatch, GEMM1 + SwiGLU, GEMM2, the weighted
combine):

- ``prefill, <routing> routing``: bf16, beside cuBLAS's dense equivalent (``torch.bmm`` on M·K/E tokens per
  expert: the same bytes and flops as perfectly balanced routing);
- ``prefill fp8, <routing> routing``: the weights quantized to fp8 block-scale (W8A8, SPEC §5), beside
  ``torch._scaled_grouped_mm`` on the same tokens per expert (e4m3 with a scale per row and per weight column, GEMM1
  then GEMM2, no SwiGLU and no quantization pass: the dense equivalent, as cuBLAS's is for bf16);
- ``same routing``: torch's grouped GEMMs on the row counts this routing gives each expert (``torch._grouped_mm``
  for bf16, ``torch._scaled_grouped_mm`` for fp8; CUTLASS kernels on Hopper), GEMM1 then GEMM2 on rows already in
  expert order: the peer on the ragged work itself, which the dense equivalents above never see;
- ``kernels``: which grouped GEMMs the default runs (the persistent ones for fp8 on Hopper where the plan is
  128 rows tall, ``experts.plan_block_m``; else the ``tl`` ones); ``other µs``: the same stage on the other family
  (``persistent="all"`` and a 128-row plan, or ``persistent="none"`` and the tile table's plan);
- routing: uniform at every DENSE_TOKENS, and at SKEW_TOKENS also skewed (logits plus a Zipf popularity,
  ``experts._routing``), with the busiest expert's load over the mean.

The floor is the touched experts' weight bytes at the measured read bandwidth. Importing needs no GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moefuse import _runtime
from moefuse.bench import timing
from moefuse.bench.experts import _routing, _weights, load_stats
from moefuse.config import preset
from moefuse.dispatch import moe_dispatch
from moefuse.experts import moe_experts, plan_block_m
from moefuse.experts.persistent import BLOCK_M as PERSISTENT_BLOCK_M
from moefuse.finalize import moe_finalize_fuse_shared
from moefuse.formats import BlockFP8

SKEW_GAINS = {"uniform": 0.0, "zipf-0.6": 0.6, "zipf-1.0": 1.0, "zipf-3.0": 3.0}
SKEW_TOKENS = (1024, 4096)
DENSE_TOKENS = (1024, 2048, 4096, 8192)
COLUMNS = [
    ("stage", "stage"), ("M", "M"), ("experts_touched", "experts"), ("block_m", "BLOCK_M"),
    ("max_over_mean", "busiest / mean"), ("kernels", "kernels"), ("us", "moefuse µs"),
    ("other_us", "other kernels µs"),
    ("mem_floor_us", "weight-read floor µs"), ("x_floor", "× floor"),
    ("cublas_us", "cuBLAS dense-equivalent µs"), ("x_cublas", "× cuBLAS"),
    ("sgmm_us", "_scaled_grouped_mm µs"), ("x_sgmm", "× _scaled_grouped_mm"),
    ("grouped_us", "torch grouped, same routing µs"), ("x_grouped", "× torch grouped"),
]
TITLE = "prefill: DeepSeek-V3 routed experts + dispatch + combine (E=256, H=7168, I=2048, top-8, CUDA-graph replay)"


def cublas_dense_equivalent(M: int, E: int, H: int, I: int, K: int, device: torch.device) -> float | None:
    """``torch.bmm`` (cuBLAS) doing the same bytes and flops as dense batched GEMMs: t = M·K/E tokens per expert,
    [E, t, H] x [E, H, 2I] then [E, t, I] x [E, I, H] (SwiGLU outside the timing), µs."""
    t = M * K // E
    a = torch.randn(E, t, H, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(E, H, 2 * I, device=device, dtype=torch.bfloat16)
    h = torch.randn(E, t, I, device=device, dtype=torch.bfloat16)
    w2 = torch.randn(E, I, H, device=device, dtype=torch.bfloat16)
    up, out = torch.empty(E, t, 2 * I, device=device, dtype=torch.bfloat16), torch.empty_like(a)
    return timing.time_or_none([lambda: (torch.bmm(a, w1, out=up), torch.bmm(h, w2, out=out))])


def scaled_grouped_mm_equivalent(M: int, E: int, H: int, I: int, K: int, device: torch.device) -> float | None:
    """``torch._scaled_grouped_mm`` doing the fp8 experts' multiplications (``scaled_grouped_mm_calls``), µs; None
    where this torch or GPU lacks it."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return None
    both = scaled_grouped_mm_calls(M, E, H, I, K, device)
    return timing.time_or_none([both])


def scaled_grouped_mm_calls(M: int, E: int, H: int, I: int, K: int, device: torch.device
                            ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """``torch._scaled_grouped_mm`` GEMM1 then GEMM2 on E groups of t = M·K/E rows (``grouped_calls``)."""
    t = M * K // E
    e4m3 = torch.float8_e4m3fn
    w1 = torch.randn(E, 2 * I, H, device=device).to(e4m3)
    w2 = torch.randn(E, H, I, device=device).to(e4m3)
    return grouped_calls(torch.full((E,), t, device=device), w1, w2)


def grouped_calls(counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  rows_in: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """torch's grouped GEMMs, GEMM1 then GEMM2, on ``counts[e]`` rows of expert e in expert order: [rows, H] x
    [E, H, 2I] then [rows, I] x [E, I, H], the weights stored [E, N, K] as checkpoints have them and read transposed.
    bf16 or fp16 weights: ``torch._grouped_mm``; e4m3: ``torch._scaled_grouped_mm`` with fp32 scales per row and
    per weight column (ones). Out in bf16; no SwiGLU between the two. ``rows_in``: the two GEMMs' activations
    ([rows, H] and [rows, I] in the weights' dtype; random where None). The closure returns both products."""
    E, I2, H = gate_up.shape
    device, rows = gate_up.device, int(counts.sum())
    offs = torch.cumsum(counts.to(device=device, dtype=torch.int32), 0, dtype=torch.int32)
    a, h = rows_in or (torch.randn(rows, H, device=device).to(gate_up.dtype),
                       torch.randn(rows, I2 // 2, device=device).to(gate_up.dtype))
    w1, w2 = gate_up.transpose(1, 2), down.transpose(1, 2)
    if gate_up.dtype != torch.float8_e4m3fn:
        def both() -> tuple[torch.Tensor, torch.Tensor]:
            return (torch._grouped_mm(a, w1, offs=offs, out_dtype=torch.bfloat16),
                    torch._grouped_mm(h, w2, offs=offs, out_dtype=torch.bfloat16))
        return both
    ones = [torch.ones(n, device=device) for n in (rows, E * I2, rows, E * H)]

    def both_fp8() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch._scaled_grouped_mm(a, w1, ones[0], ones[1].view(E, I2), offs=offs, out_dtype=torch.bfloat16),
                torch._scaled_grouped_mm(h, w2, ones[2], ones[3].view(E, H), offs=offs, out_dtype=torch.bfloat16))

    return both_fp8


def run(ceilings: timing.Ceilings, quick: bool = False) -> list[dict[str, Any]]:
    """Prefill against the dense equivalents and on skewed routing: ``routed experts + dispatch`` at DENSE_TOKENS
    (uniform routing) beside cuBLAS (bf16) and ``torch._scaled_grouped_mm`` (fp8), and at SKEW_TOKENS for each
    routing of SKEW_GAINS; each also on the other kernel family (``kernels``)."""
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    cfg = preset("deepseek-v3")
    E, H, I, K = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    w1, w2 = _weights(E, H, I, device, gen)
    q1, q2 = BlockFP8.quantize(w1), BlockFP8.quantize(w2)
    formats: dict[str, tuple[Any, Any, int]] = {"": (w1, w2, 2), " fp8": (q1, q2, 1)}
    stored = {"": (w1, w2), " fp8": (q1.values, q2.values)}  # what torch's grouped GEMMs read
    rows: list[dict[str, Any]] = []
    for M in (SKEW_TOKENS if quick else sorted(set(DENSE_TOKENS) | set(SKEW_TOKENS))):
        x = torch.randn(M, H, device=device, generator=gen).bfloat16()
        dense = {"": cublas_dense_equivalent(M, E, H, I, K, device) if M in DENSE_TOKENS else None,
                 " fp8": scaled_grouped_mm_equivalent(M, E, H, I, K, device) if M in DENSE_TOKENS else None}
        for routing, gain in SKEW_GAINS.items() if M in SKEW_TOKENS else [("uniform", 0.0)]:
            weights, ids = _routing(M, E, K, device, gen, gain)
            touched, skew = load_stats(ids, E)
            counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
            for name, (gate_up, down, width) in formats.items():
                block_m = plan_block_m(M, gate_up, K, torch.bfloat16)

                def whole(block_m: int = block_m, gate_up: Any = gate_up, down: Any = down) -> None:
                    plan = moe_dispatch(ids, E, block_m)
                    y = moe_experts(x, gate_up, down, plan)
                    moe_finalize_fuse_shared(y, plan.expanded_to_permuted, weights, None, K)

                us = timing.time_or_none([whole])
                persistent = name == " fp8" and block_m == PERSISTENT_BLOCK_M
                with _runtime.defaults(persistent="none" if persistent else "all"):
                    other_block_m = plan_block_m(M, gate_up, K, torch.bfloat16) if persistent else PERSISTENT_BLOCK_M
                    other_us = timing.time_or_none([lambda: whole(other_block_m)])
                mem_floor = touched * 3 * H * I * width / (ceilings.read_tbps * 1e12) * 1e6
                peer = dense[name] if routing == "uniform" else None
                ratio = us / peer if us and peer else None
                grouped = timing.time_or_none([grouped_calls(counts, *stored[name])])
                rows.append({
                    "stage": f"prefill{name}, {routing} routing", "M": M, "experts_touched": touched,
                    "block_m": block_m, "max_over_mean": skew, "kernels": "persistent" if persistent else "tl",
                    "us": us, "other_us": other_us, "mem_floor_us": mem_floor,
                    "x_floor": us / mem_floor if us else None,
                    **({"cublas_us": peer, "x_cublas": ratio} if name == "" else {"sgmm_us": peer, "x_sgmm": ratio}),
                    "grouped_us": grouped, "x_grouped": us / grouped if us and grouped else None,
                })
    del w1, w2, q1, q2, formats, stored
    torch.cuda.empty_cache()
    return rows
