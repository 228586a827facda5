"""Quantized expert weights on the GPU: fp8 block-scale (SPEC §5) and MXFP4 (SPEC §6) beside bf16.

For each model and token count (softmax top-k of random N(0, 1) logits, as the anchors were measured):

- the routed experts (``moe_experts`` on one dispatch plan) in the format and in bf16 on the same weights
  (the bf16 weights are the format's dequantized values), device time under CUDA-graph replay;
- the format's weight-read floor: the touched experts' stored bytes (values and scales) at the read bandwidth
  measured in the same run, plus the empty-kernel time; for fp8 also the tensor-core floor at the fp8 GEMM rate
  measured in the same run (``torch._scaled_mm``, 8192³);
- the peer, on DeepSeek-V3: vLLM's Triton fused_moe W8A8 block-scale path, the better of its default and its
  shipped H200 tuned config, as measured on this GPU model in its own run (``anchors_h200.json``: side by side with
  moefuse, dispatch + experts + the weighted combine over top-k). vLLM does not run here, so this run times
  moefuse on that scope (``routed_us``: ``moe_dispatch``, ``moe_experts``, ``moe_finalize_fuse_shared``) and
  compares it with vLLM's time as the anchor measured it (``peer_us``; ``x_peer`` = peer_us / routed_us;
  ``peer_anchor`` names the measurement). Not scaled by the two runs' read rates: the anchor's (3.73 TB/s)
  understates its machine (its own moefuse row at 16 tokens ran in 0.92x the floor it implies), and moefuse's
  128-token time on this scope (where GEMM1 takes no split) was within 0.5% of the anchor run's on 2026-12-05;
- the peer of the MXFP4 rows (W4A16 and W4A8), on DeepSeek-V4-Flash: OpenAI's triton_kernels (tag v3.6.0, its
  Hopper scale layout, the better of 4 and 8 warps) on the same scope, as measured on an H100 SXM
  (``anchors_h100.json``), scaled by this run's read rate over the anchor run's (``peer_anchor`` says by how much);
  nothing on other GPU models;
- the whole layer (``MoELayer(quant=...)``: router, dispatch, experts, fp8 shared expert, finalize) and the bf16
  layer, with the layer's read floor (touched experts, shared expert, router weight);
- the MMA precision the call ran: fp8's W8A8; MXFP4's W4A16 (the default) and, as its own rows ("w4a8"), W4A8
  (``activation_quant="fp8"``: ``experts/mxfp4/w4a8.py``);
- errors at M <= 128 and wherever W4A8 ran, max-normalised: against the float64 reference of the numerics the
  call ran, and (fp8, W4A8) against the unquantized weights (MXFP4: its unpacked ones) with unquantized
  activations.

``python -m moefuse.bench.quant`` runs it standalone; ``moefuse bench quant`` through the CLI.
"""

from __future__ import annotations

import math
from functools import partial
from typing import cast

import torch

from moefuse.bench import report, timing
from moefuse.config import preset
from moefuse.dispatch import moe_dispatch
from moefuse.experts import configs, experts_workspace, moe_experts, moe_experts_torch, plan_block_m
from moefuse.experts.reference import moe_experts_fp8_torch, moe_experts_w4a8_torch
from moefuse.finalize import moe_finalize_fuse_shared
from moefuse.formats import BLOCK, MX_GROUP, MXFP4, BlockFP8
from moefuse.layer import MoELayer, Quant
from moefuse.testing import rel_error

# fp8 at DeepSeek-V4-Flash shapes too: MXFP4 is compared with it there.
MODELS = {"fp8": ("deepseek-v3", "kimi-k2", "glm-4.5-air", "deepseek-v4-flash", "qwen3-30b-a3b"),
          "mxfp4": ("deepseek-v4-flash",),
          "w4a8": ("deepseek-v4-flash",)}
# Each row format as (weight format, activation_quant): "w4a8" is MXFP4 with fp8 activations.
ROW_FORMATS = {"fp8": ("fp8", "fp8"), "mxfp4": ("mxfp4", None), "w4a8": ("mxfp4", "fp8")}
TOKENS = (1, 16, 128, 1024, 4096)
CHECK_TOKENS = 128  # the float64 oracle runs expert by expert: up to here
COLUMNS = [
    ("format", "format"), ("model", "model"), ("M", "M"), ("mma", "MMA"), ("experts", "experts touched"),
    ("err_spec", "err vs f64 spec"), ("err_unquantized", "err vs unquantized"),
    ("us", "experts µs"), ("read_floor_us", "read floor µs"), ("x_floor", "× floor"),
    ("mma_floor_us", "fp8 MMA floor µs"), ("routed_us", "dispatch+experts+combine µs"),
    ("peer_us", "peer µs (anchor)"), ("x_peer", "speedup vs peer"),
    ("bf16_us", "bf16 experts µs"), ("x_bf16", "speedup vs bf16"),
    ("layer_us", "layer µs"), ("layer_floor_us", "layer floor µs"), ("x_layer_floor", "layer × floor"),
    ("bf16_layer_us", "bf16 layer µs"),
]
TITLE = "Quantized experts: fp8 block-scale (W8A8) and MXFP4 (W4A16; W4A8 opted in) beside bf16 (CUDA-graph replay)"


def _stored_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes one expert's [n, k] weight occupies in ``fmt`` (values and scales)."""
    if fmt == "fp8":
        return n * k + 4 * math.ceil(n / BLOCK) * math.ceil(k / BLOCK)
    return n * k // 2 + n * k // MX_GROUP


def _expert_bytes(fmt: str, H: int, I: int) -> int:
    """Bytes one expert's gate_up [2I, H] and down [H, I] occupy in ``fmt``."""
    return _stored_bytes(fmt, 2 * I, H) + _stored_bytes(fmt, H, I)


def _random_ids(M: int, E: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """Softmax top-k of N(0, 1) logits: K distinct experts per token, uniformly at random."""
    return torch.rand(M, E, device="cuda", generator=gen).argsort(1)[:, :K].int()


def _weights(fmt: str, E: int, H: int, I: int, seed: int) -> tuple:
    """(gate_up, down) in the format, and the same weights dequantized to bf16; drawn and converted one expert at
    a time (a whole Kimi-K2 in fp32 would not fit)."""
    gen = torch.Generator("cuda").manual_seed(seed)
    cls = BlockFP8 if fmt == "fp8" else MXFP4
    formats, dense = [], []
    for n, k in ((2 * I, H), (H, I)):
        first = cls.quantize(torch.randn(1, n, k, device="cuda", generator=gen) / math.sqrt(k))
        values = first.values.new_empty(E, *first.values.shape[1:])
        scales = first.scales.new_empty(E, *first.scales.shape[1:])
        bf16 = torch.empty(E, n, k, device="cuda", dtype=torch.bfloat16)
        for e in range(E):
            q = first if e == 0 else cls.quantize(torch.randn(1, n, k, device="cuda", generator=gen) / math.sqrt(k))
            values[e], scales[e] = q.values[0], q.scales[0]
            bf16[e] = q.dequantize(torch.bfloat16)[0]
        formats.append(cls(values, scales))
        dense.append(bf16)
    return (*formats, *dense)


def _fp8_mma_tflops() -> float:
    """fp8 e4m3 GEMM rate of ``torch._scaled_mm`` on 8192³ (per-tensor scales), in TFLOP/s."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    us = timing.time_or_none([lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)])
    return float("nan") if us is None else 2 * 8192**3 / (us * 1e-6) / 1e12


PEER_MODEL = "deepseek-v3"  # the shapes the fp8 peer was measured on
MXFP4_PEER_MODEL = "deepseek-v4-flash"  # the shapes the MXFP4 peer (triton_kernels) was measured on


def peer_from_anchor(tokens: int, gpu: str) -> tuple[float, str] | None:
    """vLLM's fp8 experts at ``tokens`` tokens (the better of its two configs, dispatch and combine included) as the
    committed anchor measured them, and the anchor's date; None where the anchor has no such row, or was measured
    on another GPU model than ``gpu`` (:func:`report.anchors`)."""
    anchor = report.anchors(gpu)["fp8_block_scale_experts_vllm_triton"]
    for row in anchor["rows"]:
        if row["tokens"] == tokens:
            return min(row["default_config_us"], row["tuned_config_us"]), anchor["measured"].split(",")[0]
    return None


def mxfp4_peer_from_anchor(tokens: int, gpu: str, read_tbps: float) -> tuple[float, str] | None:
    """triton_kernels' MXFP4 experts at ``tokens`` tokens (dispatch, GEMMs and combine; the better of its warp
    counts) as the committed anchor measured them on this GPU model, scaled to this run's machine by the two runs'
    read rates (``read_tbps``, measured here, against the anchor's), and the anchor's name; None where the anchor
    has no such row or another GPU model measured it (:func:`report.anchors`)."""
    anchor = report.anchors(gpu)["mxfp4_experts_triton_kernels"]
    for row in anchor["rows"]:
        if row["tokens"] == tokens:
            scale = anchor["read_TBps"] / read_tbps
            return row["best_us"] * scale, (f"triton_kernels {anchor['measured'].split(',')[0]}, x{scale:.3f} "
                                            f"(read {anchor['read_TBps']:.2f} -> {read_tbps:.2f} TB/s)")
    return None


def _routed_us(x: torch.Tensor, w1: BlockFP8 | MXFP4, w2: BlockFP8 | MXFP4, routings: list[torch.Tensor], block_m: int,
               quant: str | None) -> float:
    """Dispatch, the experts (``activation_quant=quant``, as the row's, with a workspace as a layer keeps) and the
    weighted combine over top-k (no shared expert) per routing: the peer's scope, under CUDA-graph replay."""
    M, K = routings[0].shape
    E = w1.shape[0]
    weights = torch.full((M, K), 1.0 / K, device=x.device)  # the values do not change the time
    workspace = experts_workspace(x.device)

    def call(ids: torch.Tensor) -> torch.Tensor:
        plan = moe_dispatch(ids, E, block_m)
        out = moe_experts(x, w1, w2, plan, activation_quant=quant, workspace=workspace)
        return moe_finalize_fuse_shared(out, plan.expanded_to_permuted, weights, None, K)

    return timing.graph_time_us([partial(call, ids) for ids in routings], replays=20)


def _experts_row(fmt: str, model: str, M: int, weights: tuple, ceilings: timing.Ceilings, fp8_tflops: float,
                 gen: torch.Generator) -> dict:
    c = preset(model)
    E, H, I, K = c.num_experts, c.hidden_size, c.intermediate_size, c.top_k
    w1, w2, d1, d2 = weights
    quant = ROW_FORMATS[fmt][1]
    expert_bytes = _expert_bytes(ROW_FORMATS[fmt][0], H, I)
    x = torch.randn(M, H, device="cuda", generator=gen, dtype=torch.bfloat16)
    ids = _random_ids(M, E, K, gen)
    plan = moe_dispatch(ids, E, plan_block_m(M, w1, K, x.dtype, quant))
    plan_bf16 = moe_dispatch(ids, E, configs.pick_block_m(M, E, H, I, K, torch.bfloat16))
    touched = int(torch.unique(ids).numel())
    w4a8 = fmt == "w4a8"
    row: dict = {"format": fmt, "model": model, "M": M, "experts": touched,
                 "mma": "W8A8" if fmt == "fp8" else "W4A8" if w4a8 else "W4A16"}
    with torch.no_grad():
        if M <= CHECK_TOKENS or w4a8:
            n = int(plan.expert_offsets[-1])
            out = moe_experts(x, w1, w2, plan, activation_quant=quant)
            zeros = lambda: torch.zeros(plan.num_rows, H, dtype=torch.float64, device="cuda")  # noqa: E731
            reference = (moe_experts_fp8_torch if fmt == "fp8" else moe_experts_w4a8_torch if w4a8
                         else moe_experts_torch)
            spec = reference(x, w1, w2, plan, dtype=torch.float64, out=zeros())
            row["err_spec"] = rel_error(out[:n], spec[:n])
            if fmt == "fp8" or w4a8:  # fp8: the bf16 weights stand for the unquantized ones (their error is below)
                dense = moe_experts_torch(x, d1, d2, plan, dtype=torch.float64, out=zeros())
                row["err_unquantized"] = rel_error(out[:n], dense[:n])
        # Routings rotate so that the touched weights overflow the L2 (a narrow model's few experts would fit)
        more = [_random_ids(M, E, K, gen) for _ in range(timing.rotations(touched * expert_bytes) - 1)]
        plans = [plan] + [moe_dispatch(r, E, plan.block_m) for r in more]
        plans_bf16 = [plan_bf16] + [moe_dispatch(r, E, plan_bf16.block_m) for r in more]
        workspace = experts_workspace(x.device)  # as a layer keeps one: no zeroing kernel before a split GEMM1
        row["us"] = timing.graph_time_us([partial(moe_experts, x, w1, w2, p, activation_quant=quant,
                                                  workspace=workspace) for p in plans], replays=20)
        row["bf16_us"] = timing.graph_time_us([partial(moe_experts, x, d1, d2, p) for p in plans_bf16], replays=20)
    stored = touched * expert_bytes
    row["read_floor_us"] = ceilings.empty_us + stored / (ceilings.read_tbps * 1e12) * 1e6
    row["x_floor"] = row["us"] / row["read_floor_us"]
    if fmt == "fp8":
        row["mma_floor_us"] = 2 * M * K * 3 * H * I / (fp8_tflops * 1e12) * 1e6
    gpu = torch.cuda.get_device_name()
    peer = (peer_from_anchor(M, gpu) if fmt == "fp8" and model == PEER_MODEL else
            mxfp4_peer_from_anchor(M, gpu, ceilings.read_tbps) if fmt != "fp8" and model == MXFP4_PEER_MODEL else None)
    if peer is not None:
        row["routed_us"] = _routed_us(x, w1, w2, [ids] + more, plan.block_m, quant)
        row["peer_us"], row["peer_anchor"] = peer
        row["x_peer"] = row["peer_us"] / row["routed_us"]
    row["x_bf16"] = row["bf16_us"] / row["us"]
    return row


def _layer_times(fmt: str, model: str, rows: list[dict], ceilings: timing.Ceilings, gen: torch.Generator) -> None:
    """Add the whole layer's time (format and bf16) and read floor to each row of ``model``."""
    c = preset(model)
    H, I, S = c.hidden_size, c.intermediate_size, c.shared_intermediate_size
    weight_format, activation_quant = ROW_FORMATS[fmt]
    expert_bytes = _expert_bytes(weight_format, H, I)
    for quant in (cast(Quant, weight_format), None):
        layer = MoELayer(c, device="cuda", quant=quant, activation_quant=activation_quant if quant else "default"
                         ).init_random_(seed=1)
        for row in rows:
            # tokens rotate (and with them the touched experts) as the experts' routings do
            xs = [torch.randn(row["M"], c.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
                  for _ in range(timing.rotations(row["experts"] * expert_bytes))]
            x = xs[0]
            with torch.no_grad():
                us = timing.graph_time_us([partial(layer, x) for x in xs], replays=20)
                if quant is None:
                    row["bf16_layer_us"] = us
                    continue
                row["layer_us"] = us
                _, ids = layer.gate(x)
            touched = int(torch.unique(ids[(ids >= 0) & (ids < c.num_experts)]).numel())
            stored = (touched * expert_bytes
                      + (_expert_bytes("fp8", H, S) if S else 0)
                      + 4 * c.num_experts * H)
            row["layer_floor_us"] = ceilings.empty_us + stored / (ceilings.read_tbps * 1e12) * 1e6
            row["x_layer_floor"] = row["layer_us"] / row["layer_floor_us"]
        del layer
        torch.cuda.empty_cache()


def run(ceilings: timing.Ceilings, quick: bool = False, formats: tuple[str, ...] = ("fp8", "mxfp4", "w4a8"),
        tokens: tuple[int, ...] = TOKENS) -> list[dict]:
    rows: list[dict] = []
    fp8_tflops = _fp8_mma_tflops()
    gen = torch.Generator("cuda").manual_seed(0)
    for fmt in formats:
        for model in MODELS[fmt][:1] if quick else MODELS[fmt]:
            c = preset(model)
            weights = _weights(ROW_FORMATS[fmt][0], c.num_experts, c.hidden_size, c.intermediate_size, seed=0)
            model_rows = [_experts_row(fmt, model, M, weights, ceilings, fp8_tflops, gen)
                          for M in (tokens[:3] if quick else tokens)]
            del weights
            torch.cuda.empty_cache()
            _layer_times(fmt, model, model_rows, ceilings, gen)
            rows += model_rows
    return rows


def main() -> None:
    print(report.format_table(run(timing.measure_ceilings(gemm=False)), COLUMNS, TITLE))


if __name__ == "__main__":
    main()
