"""What batch invariance costs: the experts and the whole layer with ``batch_invariant=True`` beside the default.

For DeepSeek-V3 in bf16 and fp8 and DeepSeek-V4-Flash in MXFP4 (W4A16) at 1, 16, 128, 1,024 and 4,096 tokens:
the routed experts (dispatch + GEMMs + combine, as a layer runs them) and the layer, each both ways in the same run
under CUDA-graph replay, the invariant time over the default's, and at one token the read floor (the touched
experts' bytes at the measured read bandwidth; the layer's adds its shared expert and router). ``check`` confirms
the promise on the same layers: a token alone and inside each batch, bitwise. Floors are ``bench.sweep``'s.

``python -m moefuse.bench.invariance`` runs it standalone.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from moefuse.bench import report, sweep, timing
from moefuse.config import preset
from moefuse.formats import Quant
from moefuse.layer import MoELayer, routed_experts

CASES = (("deepseek-v3", "bf16"), ("deepseek-v3", "fp8"), ("deepseek-v4-flash", "mxfp4"))
TOKENS = (1, 16, 128, 1024, 4096)
QUANT: dict[str, Quant] = {"bf16": None, "fp8": "fp8", "mxfp4": "mxfp4"}
COLUMNS = [
    ("model", "model"), ("format", "format"), ("M", "M"),
    ("experts_us", "experts µs"), ("experts_inv_us", "invariant µs"), ("x_experts", "× default"),
    ("layer_us", "layer µs"), ("layer_inv_us", "invariant layer µs"), ("x_layer", "× default"),
    ("floor_us", "experts floor µs"), ("x_floor_inv", "invariant × floor"),
    ("layer_floor_us", "layer floor µs"), ("x_layer_floor_inv", "invariant layer × floor"),
]
TITLE = "Batch invariance: the invariant experts and layer beside the default (CUDA-graph replay)"
CHECK_COLUMNS = [("model", "model"), ("format", "format"), ("M", "M"), ("bitwise", "token alone == in batch")]


def _build(model: str, fmt: str) -> MoELayer:
    return MoELayer(preset(model), device="cuda", quant=QUANT[fmt]).init_random_(0)


def run(ceilings: timing.Ceilings, quick: bool = False) -> list[dict]:
    rows = []
    gen = torch.Generator("cuda").manual_seed(0)
    for model, fmt in CASES[:1] if quick else CASES:
        layer = _build(model, fmt)
        c = layer.config
        gate_up, down = layer.experts.weights()
        for M in TOKENS[:3] if quick else TOKENS:
            x = torch.randn(M, c.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
            row: dict[str, Any] = {"model": model, "format": fmt, "M": M}
            with torch.no_grad():
                weights, ids = layer.gate(x)
                for key, invariant in (("", False), ("_inv", True)):
                    experts = partial(routed_experts, x, gate_up, down, weights, ids, swiglu_limit=c.swiglu_limit,
                                      activation_quant=layer.activation_quant, batch_invariant=invariant)
                    row[f"experts{key}_us"] = timing.graph_time_us([experts], replays=20)
                    layer.batch_invariant = invariant
                    row[f"layer{key}_us"] = timing.graph_time_us([partial(layer, x)], replays=20)
                layer.batch_invariant = None
            row["x_experts"] = row["experts_inv_us"] / row["experts_us"]
            row["x_layer"] = row["layer_inv_us"] / row["layer_us"]
            if M == 1:
                with torch.no_grad():
                    experts_bytes = sweep.read_bytes(layer, x)[0]
                    row["layer_floor_us"] = sweep.floor_us(layer, x, ceilings)
                row["floor_us"] = ceilings.empty_us + experts_bytes / (ceilings.read_tbps * 1e12) * 1e6
                row["x_floor_inv"] = row["experts_inv_us"] / row["floor_us"]
                row["x_layer_floor_inv"] = row["layer_inv_us"] / row["layer_floor_us"]
            rows.append(row)
        del layer
        torch.cuda.empty_cache()
    return rows


def check(device: torch.device | str = "cuda") -> list[dict]:
    """The promise on full-size layers: a token alone, then in the middle of each batch, bitwise."""
    rows = []
    gen = torch.Generator(device).manual_seed(1)
    for model, fmt in CASES:
        layer = _build(model, fmt)
        layer.batch_invariant = True
        H = layer.config.hidden_size
        token = torch.randn(1, H, device=device, generator=gen, dtype=torch.bfloat16)
        with torch.no_grad():
            alone = layer(token)[0]
            for M in TOKENS[1:]:
                batch = torch.randn(M, H, device=device, generator=gen, dtype=torch.bfloat16)
                batch[M // 2] = token[0]
                same = bool(torch.equal(layer(batch)[M // 2], alone))
                rows.append({"model": model, "format": fmt, "M": M, "bitwise": same, "ok": same})
        del layer
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    print(report.format_table(check(), CHECK_COLUMNS, "Batch invariance on full-size layers"))
    print(report.format_table(run(timing.measure_ceilings(gemm=False)), COLUMNS, TITLE))


if __name__ == "__main__":
    main()
