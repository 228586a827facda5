"""What does batch invariance cost a one-token layer, stage by stage? (GPU.)

For DeepSeek-V3 bf16 and fp8 and DeepSeek-V4-Flash MXFP4 at 1 and 16 tokens, default against ``batch_invariant``:
the router linear, the gate (linear + fused gate), the shared expert alone, the layer; the routed experts alone
(top-k experts) against the routed experts with the shared expert as one more slot (the grid the invariant layer
runs: for fp8 GEMM1, 128-column blocks of 9 experts where the routed ones make 8); and the invariant router linear
with K cut into other run counts and on other tiles (the bits change with the count and the tile, never with M); and
for fp8 the invariant routed experts with the shared slot at one token on GEMM1 launches of 2-4 stages and 4 or 8
warps, in gate and up halves (of 128 or 64 columns) or not, and on steps of two boxes (bits unchanged: a stage
count, a warp count, the halves or a step's boxes order no sum; with 2 stages two of the 144 programs can share an
SM, where 4 stages run 132 and then 12).
Prints one JSON object a line.

    python -m research.invariant_one_token [--tokens 1 16]

``--ncu default|invariant``: instead, each case's layer (no decode graphs) at one token called twice, then once
inside an NVTX range "meas" with that mode, for Nsight Compute (``ncu --nvtx --nvtx-include "meas/"``; one mode a
process, so that its kernels are its own; ``scripts/ncu_table.py`` reads the export).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial

import torch

from moefuse.bench import timing
from moefuse.config import preset
from moefuse.experts import configs
from moefuse.experts.fp8 import kernels as fp8_kernels
from moefuse.layer import MoELayer, routed_experts
from moefuse.route import linear

CASES = (("deepseek-v3", None), ("deepseek-v3", "fp8"), ("deepseek-v4-flash", "mxfp4"))
RUNS = ((16, 256), (28, 256), (32, 128), (56, 128))  # (INVARIANT_MAX_RUNS, INVARIANT_RUN_COLUMNS)
# Tiles of the invariant router launch (bits change with the tile's columns and K block, never with M); 16 runs
ROUTER_TILES = (linear.MmaLaunch(64, 64, 64, 4, 4, 1.0), linear.MmaLaunch(64, 32, 64, 4, 4, 1.0),
                linear.MmaLaunch(64, 32, 64, 4, 3, 1.0), linear.MmaLaunch(64, 32, 64, 4, 2, 1.0),
                linear.MmaLaunch(64, 64, 64, 4, 2, 1.0))


def _us(call) -> float:  # noqa: ANN001 - a capturable closure
    return round(timing.graph_time_us([call], replays=30), 1)


def stages(layer: MoELayer, M: int, gen: torch.Generator) -> dict:
    """Default and invariant times of the layer's stages at M tokens."""
    c = layer.config
    x = torch.randn(M, c.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    gate_up, down = layer.experts.weights()
    slot = layer.shared_slot_weights()
    row: dict = {"M": M}
    with torch.no_grad():
        for invariant in (False, True):
            key = "inv" if invariant else "default"
            layer.batch_invariant = invariant
            row[f"router_{key}"] = _us(partial(layer.gate.logits, x))
            row[f"gate_{key}"] = _us(partial(layer.gate, x))
            if layer.shared_experts is not None:
                row[f"shared_{key}"] = _us(partial(layer.shared_experts, x))
            weights, ids = layer.gate(x)
            row[f"routed_{key}"] = _us(partial(routed_experts, x, gate_up, down, weights, ids,
                                               swiglu_limit=c.swiglu_limit, activation_quant=layer.activation_quant,
                                               batch_invariant=invariant))
            if slot is not None:
                weights, ids = layer.gate(x, num_fused_shared_experts=1)
                row[f"routed_with_slot_{key}"] = _us(partial(
                    routed_experts, x, *slot, weights, ids, swiglu_limit=c.swiglu_limit,
                    activation_quant=layer.activation_quant, batch_invariant=invariant))
            row[f"layer_{key}"] = _us(partial(layer, x))
            row[f"slot_{key}"] = layer.uses_shared_slot(M, x.device)
        layer.batch_invariant = None
    return row


def slot_token(layer: MoELayer, gen: torch.Generator) -> tuple[torch.Tensor, Callable[[], object]]:
    """A random token routed by the batch-invariant gate with the shared slot, and a call of the invariant routed
    experts with the slot on it (under whatever :func:`configs.override` is active when it runs)."""
    c = layer.config
    x = torch.randn(1, c.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    slot = layer.shared_slot_weights()
    layer.batch_invariant = True
    with torch.no_grad():
        weights, ids = layer.gate(x, num_fused_shared_experts=1)
    layer.batch_invariant = None
    return ids, partial(routed_experts, x, *slot, weights, ids, swiglu_limit=c.swiglu_limit,
                        activation_quant=layer.activation_quant, batch_invariant=True)


def slot_launches(layer: MoELayer, gen: torch.Generator) -> dict:
    """The invariant fp8 routed experts with the shared slot at one token, GEMM1 on each stage and warp count, on
    steps of two boxes (256 deep; the same bits: each box is promoted on its own), which cuts its stages to 2, and
    in gate and up halves (``experts_fp8``'s ``halves``: twice the programs, the same bits) or not."""
    c = layer.config
    ids, call = slot_token(layer, gen)
    base = configs.pick(1, c.num_experts + 1, c.hidden_size, c.intermediate_size, c.top_k + 1,
                        torch.float8_e4m3fn, block_m=64)
    row: dict = {"slot_launches": "fp8", "gemm1": asdict(base.gemm1)}
    launches = [(128, stages, warps, halves, 128) for halves in (False, True) for stages in (2, 3, 4)
                for warps in (4, 8)]
    launches += [(128, stages, 4, True, 64) for stages in (3, 4)]  # halves of 64 columns: four programs a tile
    launches += [(256, 2, warps, False, 128) for warps in (4, 8)]
    rule, columns_rule = fp8_kernels.default_halves, fp8_kernels.default_half_columns
    halves_launch = fp8_kernels.FP8_HALVES_WARPS, fp8_kernels.FP8_HALVES_STAGES
    try:
        for depth, stages, warps, halves, columns in launches:
            fp8_kernels.default_halves = lambda *args, on=halves: on  # type: ignore[misc]
            fp8_kernels.default_half_columns = lambda *args, n=columns: n  # type: ignore[misc]
            # halves run their own launch (configs.FP8_HALVES_STAGES): set it to this one
            fp8_kernels.FP8_HALVES_WARPS, fp8_kernels.FP8_HALVES_STAGES = warps, stages
            tiles = replace(base, gemm1=replace(base.gemm1, block_k=depth, num_stages=stages, num_warps=warps))
            with configs.override(tiles), torch.no_grad():
                row[f"stages{stages}_warps{warps}" + ("_two_boxes" if depth == 256 else "")
                    + (f"_halves{'' if columns == 128 else columns}" if halves else "")] = _us(call)
    finally:
        fp8_kernels.default_halves, fp8_kernels.default_half_columns = rule, columns_rule
        fp8_kernels.FP8_HALVES_WARPS, fp8_kernels.FP8_HALVES_STAGES = halves_launch
    row["halves_by_rule"] = rule(int(ids.numel()), c.intermediate_size, 1, ids.device)
    row["half_columns_by_rule"] = columns_rule(int(ids.numel()), c.intermediate_size, ids.device)
    return row


def bf16_slot_launches(layer: MoELayer, gen: torch.Generator) -> dict:
    """The invariant bf16 routed experts with the shared slot at one token, GEMM1 on 128- and 64-column tiles of
    2-4 stages (swapped wgmma tiles: a column's sum does not depend on the tile's width, so the bits stay), the
    table's GEMM2. With the slot DeepSeek-V3's 128-column GEMM1 is 144 programs that fit one an SM, a second wave
    of 12 on 132 SMs; 64 columns make 288 that may fit two."""
    c = layer.config
    ids, call = slot_token(layer, gen)
    base = configs.pick(1, c.num_experts + 1, c.hidden_size, c.intermediate_size, c.top_k + 1, torch.bfloat16)
    row: dict = {"slot_launches": "bf16", "base": base.to_dict()}
    for columns in (128, 64):
        for stages in (2, 3, 4):
            tiles = replace(base, gemm1=replace(base.gemm1, block_n=columns, num_stages=stages))
            with configs.override(tiles), torch.no_grad():
                row[f"n{columns}_s{stages}"] = _us(call)
    return row


def router_runs(H: int, E: int, M: int) -> dict:
    """The invariant router linear (bf16 x, fp32 weight) with K cut into each of ``RUNS``, and on each of
    ``ROUTER_TILES`` at the committed run count."""
    weight = torch.randn(E, H, device="cuda")
    parts = linear.bf16_split(weight)
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(M, E, device="cuda")
    saved = linear.INVARIANT_MAX_RUNS, linear.INVARIANT_RUN_COLUMNS
    row: dict = {"H": H, "E": E, "M": M}
    try:
        for most, columns in RUNS:
            linear.INVARIANT_MAX_RUNS, linear.INVARIANT_RUN_COLUMNS = most, columns
            row[f"runs_{linear.invariant_runs(H)}"] = _us(partial(linear.router_logits_invariant, x, weight, out,
                                                                  parts))
    finally:
        linear.INVARIANT_MAX_RUNS, linear.INVARIANT_RUN_COLUMNS = saved
    committed = linear.INVARIANT_MMA
    try:
        for tile in ROUTER_TILES:
            linear.INVARIANT_MMA = tile
            row[f"tile_{tile.block_n}x{tile.block_k}_s{tile.stages}"] = _us(partial(
                linear.router_logits_invariant, x, weight, out, parts))
    finally:
        linear.INVARIANT_MMA = committed
    return row


def _case(case: str) -> tuple[str, str | None]:
    """A ``--cases`` entry "model:format" as (preset name, the layer's ``quant``)."""
    model, fmt = case.split(":")
    return model, None if fmt == "bf16" else fmt


def ncu_calls(layer: MoELayer, invariant: bool, gen: torch.Generator) -> None:
    """The layer at one token in one mode: twice to compile, then once inside the NVTX range "meas"."""
    x = torch.randn(1, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    layer.batch_invariant = invariant
    with torch.no_grad():
        for _ in range(2):
            layer(x)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("meas")
        layer(x)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    layer.batch_invariant = None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--cases", nargs="+", default=[f"{m}:{q or 'bf16'}" for m, q in CASES],
                        help="model:format pairs (format bf16, fp8 or mxfp4)")
    parser.add_argument("--ncu", choices=("default", "invariant"), help="one mode's one-token layers for ncu")
    args = parser.parse_args(argv)
    gen = torch.Generator("cuda").manual_seed(0)
    if args.ncu:
        for case in args.cases:
            model, quant = _case(case)
            layer = MoELayer(preset(model), device="cuda", quant=quant, graph_max_tokens=0).init_random_(0)
            ncu_calls(layer, args.ncu == "invariant", gen)
            del layer
            torch.cuda.empty_cache()
        return
    for case in args.cases:
        model, quant = _case(case)
        layer = MoELayer(preset(model), device="cuda", quant=quant).init_random_(0)
        for M in args.tokens:
            print(json.dumps({"model": model, "quant": quant, **stages(layer, M, gen)}), flush=True)
        if quant == "fp8":
            print(json.dumps(slot_launches(layer, gen)), flush=True)
        if quant is None and layer.shared_slot_weights() is not None:
            print(json.dumps(bf16_slot_launches(layer, gen)), flush=True)
        c = layer.config
        del layer
        torch.cuda.empty_cache()
        if quant is None:
            for M in (1, 4096):
                print(json.dumps({"router": model, **router_runs(c.hidden_size, c.num_experts, M)}), flush=True)


if __name__ == "__main__":
    main()
