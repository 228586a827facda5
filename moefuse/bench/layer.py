"""The whole MoE layer on the GPU: router, dispatch, experts, shared expert on a side stream, fused finalize.

For each model and token count: device time under CUDA-graph replay with deferred finalize (the default) and
without it; at decode sizes also with the shared expert forced onto the side stream and forced into a slot of the
grouped GEMMs (the default takes the tile table's choice, ``shared_slot_max_tokens``); the memory floor of
every weight the batch touches (touched routed experts, shared expert, router) at the measured read bandwidth,
the compute floor at the measured bf16 GEMM rate, and transformers' own block as measured on this GPU
(``anchors_h200.json``; DeepSeek-V3 only).

``python -m moefuse.bench.layer`` runs it standalone.
"""

from __future__ import annotations

from typing import Any

import torch

from moefuse._runtime import defaults
from moefuse.bench import report, timing
from moefuse.config import preset
from moefuse.layer import MoELayer
from moefuse.reference import moe_layer_torch
from moefuse.testing import rel_error

MODELS = ("deepseek-v3", "kimi-k2", "deepseek-v4-flash")
TOKENS = (1, 16, 128, 1024, 4096)
SLOT_TOKENS = 16  # decode sizes at which both ways of running the shared expert are timed
COLUMNS = [
    ("model", "model"), ("M", "M"), ("experts", "experts touched"), ("us", "deferred µs"),
    ("side_us", "shared on side stream µs"), ("slot_us", "shared as slot µs"),
    ("plain_us", "no deferral µs"), ("deferral_gain", "deferral saves µs"), ("mem_floor_us", "memory floor µs"),
    ("x_mem_floor", "× mem floor"), ("compute_floor_us", "compute floor µs"),
    ("hf_grouped_mm_us", "transformers grouped_mm µs"), ("x_hf", "speedup vs transformers"),
]
TITLE = "MoE layer end to end (bf16, CUDA-graph replay)"


def _deferral(enabled: bool):
    return defaults(deferred_finalize=enabled)


def _floors(layer: MoELayer, x: torch.Tensor, ceilings: timing.Ceilings) -> dict[str, float]:
    c = layer.config
    _, ids = layer.gate(x)
    touched = int(torch.unique(ids[(ids >= 0) & (ids < c.num_experts)]).numel())
    elem = layer.experts.gate_up_proj.element_size()
    expert_bytes = 3 * c.hidden_size * c.intermediate_size * elem
    shared_bytes = 3 * c.hidden_size * c.shared_intermediate_size * elem
    router_bytes = c.num_experts * c.hidden_size * 4
    act_bytes = 2 * x.numel() * x.element_size()
    weight_bytes = touched * expert_bytes + shared_bytes + router_bytes + act_bytes
    flops = 2 * x.shape[0] * (c.top_k * 3 * c.hidden_size * c.intermediate_size
                              + 3 * c.hidden_size * c.shared_intermediate_size + c.num_experts * c.hidden_size)
    return {
        "experts": touched,
        "mem_floor_us": ceilings.empty_us + weight_bytes / (ceilings.read_tbps * 1e12) * 1e6,
        "compute_floor_us": flops / (ceilings.gemm_tflops * 1e12) * 1e6,
    }


def _hf_anchor(model: str, tokens: int) -> float | None:
    if model != "deepseek-v3":
        return None
    for row in report.anchors(torch.cuda.get_device_name())["transformers_deepseek_v3_block"]["rows"]:
        if row["M"] == tokens and isinstance(row["grouped_mm"], (int, float)):
            return float(row["grouped_mm"])
    return None


def _build(model: str, seed: int = 0) -> MoELayer:
    return MoELayer(preset(model), dtype=torch.bfloat16, device="cuda").init_random_(seed)


def check(device: torch.device | str = "cuda") -> list[dict]:
    """Full-size layers in bf16 against the float64 reference on the same weights, eager and graph-replayed."""
    rows = []
    for model in MODELS:
        layer = _build(model)
        for tokens in (1, 33, 512):
            x = torch.randn(tokens, layer.config.hidden_size, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                ref = moe_layer_torch(layer, x, route_dtype=torch.float32)
                out = layer(x)
                with _deferral(False):
                    plain = layer(x)
                graph = torch.cuda.CUDAGraph()
                static_out = layer(x)  # warm-up outside capture
                with torch.cuda.graph(graph):
                    static_out = layer(x)
                graph.replay()
                torch.cuda.synchronize()
            rows.append({
                "model": model, "M": tokens, "err": rel_error(out, ref), "err_plain": rel_error(plain, ref),
                "graph_equal": bool(torch.equal(static_out, out)), "ok": rel_error(out, ref) <= 1e-2,
            })
        del layer
        torch.cuda.empty_cache()
    return rows


CHECK_COLUMNS = [("model", "model"), ("M", "M"), ("err", "rel err deferred"), ("err_plain", "rel err plain"),
                 ("graph_equal", "graph replay == eager"), ("ok", "≤ 1e-2")]


def run(ceilings: timing.Ceilings, quick: bool = False, models: tuple[str, ...] = MODELS) -> list[dict]:
    rows = []
    for model in models:
        layer = _build(model)
        for tokens in (TOKENS[:3] if quick else TOKENS):
            x = torch.randn(tokens, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                row: dict[str, Any] = {"model": model, "M": tokens, **_floors(layer, x, ceilings)}
                with _deferral(True):
                    row["us"] = timing.graph_time_us([lambda: layer(x)], replays=20)
                with _deferral(False):
                    row["plain_us"] = timing.graph_time_us([lambda: layer(x)], replays=20)
                if tokens <= SLOT_TOKENS and layer.shared_slot_weights() is not None:
                    for key, limit in (("side_us", 0), ("slot_us", tokens)):
                        layer.shared_slot_max_tokens = limit
                        row[key] = timing.graph_time_us([lambda: layer(x)], replays=20)
                    layer.shared_slot_max_tokens = None  # back to the table's choice
            row["deferral_gain"] = row["plain_us"] - row["us"]
            row["x_mem_floor"] = row["us"] / row["mem_floor_us"]
            row["hf_grouped_mm_us"] = _hf_anchor(model, tokens)
            row["x_hf"] = row["hf_grouped_mm_us"] / row["us"] if row["hf_grouped_mm_us"] else None
            rows.append(row)
        del layer
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    print(report.format_table(check(), CHECK_COLUMNS, "MoE layer: bf16 vs float64 reference"))
    print(report.format_table(run(timing.measure_ceilings()), COLUMNS, TITLE))


if __name__ == "__main__":
    main()
