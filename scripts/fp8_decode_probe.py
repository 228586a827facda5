"""Issue 40's probe: fp8 block-scale experts at decode (1 and 16 tokens) with GEMM1 split along K, on one GPU.

    python scripts/fp8_decode_probe.py [--json FILE]

At one token GEMM1 has one program per tile and 128 intermediate columns: 8 · 16 = 128 programs for DeepSeek-V3,
96 for DeepSeek-V4-Flash, 88 for GLM-4.5-Air, 48 for Qwen3-30B-A3B, against 132 SMs. ``experts_fp8(split_k=s)``
runs each program's K in s runs of steps, each its own program. Per preset and token count: the experts as
``moe_experts`` runs them (the op: split where ``configs.fp8_split_k`` says), then ``experts_fp8`` on the same
tiles with split_k 1-4 (split, GEMM1 runs on at most ``FP8_SPLIT_STAGES`` stages, so that two programs share an
SM) and on 2 stages; µs under CUDA-graph replay,
rotating through enough routings that the touched weights overflow the L2. The read floor: the touched experts'
values and scales at the read bandwidth measured in the same run. Then the error of each split against SPEC §5's
float64 emulation, DeepSeek-V3 widths, 16 experts, 1 and 16 tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefuse.bench import timing  # noqa: E402
from moefuse.bench.experts import _routing  # noqa: E402
from moefuse.config import preset  # noqa: E402
from moefuse.dispatch import moe_dispatch  # noqa: E402
from moefuse.experts import configs, moe_experts, plan_block_m  # noqa: E402
from moefuse.experts.fp8.kernels import experts_fp8  # noqa: E402
from moefuse.experts.reference import moe_experts_fp8_torch  # noqa: E402
from moefuse.formats import BlockFP8, tile_dtype  # noqa: E402
from moefuse.testing import rel_error, rms_rel_error  # noqa: E402

PRESETS = ("deepseek-v3", "kimi-k2", "deepseek-v4-flash", "glm-4.5-air", "qwen3-30b-a3b")
# (split_k, GEMM1 pipeline stages or None for the table's, capped when split)
VARIANTS = [(1, None), (2, None), (3, None), (4, None), (2, 2), (3, 2), (4, 2)]


def random_fp8(E: int, N: int, K: int, device: torch.device) -> BlockFP8:
    """Weights for timing: random e4m3 codes (no NaN) and unit-scale blocks; the values do not change the time."""
    values = torch.empty(E, N, K, dtype=torch.uint8, device=device).random_(0, 0x7E).view(torch.float8_e4m3fn)
    scales = torch.full((E, -(-N // 128), -(-K // 128)), 1e-3, device=device)
    return BlockFP8(values, scales)


def time_presets(device: torch.device, read_tbps: float) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator(device).manual_seed(0)
    for name in PRESETS:
        cfg = preset(name)
        E, H, I, K = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
        w1, w2 = random_fp8(E, 2 * I, H, device), random_fp8(E, H, I, device)
        expert_bytes = sum(w.values[0].numel() + w.scales[0].numel() * 4 for w in (w1, w2))
        for M in (1, 16):
            x = torch.randn(M, H, device=device, generator=gen).bfloat16()
            block_m = plan_block_m(M, w1, K, torch.bfloat16)
            sets = timing.rotations(M * K * expert_bytes)
            plans = [moe_dispatch(_routing(M, E, K, device, gen)[1], E, block_m) for _ in range(sets)]
            touched = sum(int(torch.unique(p.tile_expert[p.tile_expert >= 0]).numel()) for p in plans) / sets
            tiles = configs.pick(M, E, H, I, K, tile_dtype(w1, torch.bfloat16), block_m=block_m)
            outs = [torch.empty(p.num_rows, H, dtype=torch.bfloat16, device=device) for p in plans]
            row: dict[str, Any] = {
                "model": name, "M": M, "block_m": block_m, "experts_touched": touched, "tiles": str(tiles),
                "gemm1_programs": int(plans[0].tile_expert.numel()) * -(-I // 128),
                "read_floor_us": touched * expert_bytes / (read_tbps * 1e12) * 1e6,
                "op_us": timing.time_or_none([lambda p=p, o=o: moe_experts(x, w1, w2, p, out=o)
                                              for p, o in zip(plans, outs)])}
            for split, stages in VARIANTS:
                g1 = tiles.gemm1 if stages is None else replace(tiles.gemm1, num_stages=stages)
                row[f"split{split}" + ("" if stages is None else f"_stages{stages}")] = timing.time_or_none(
                    [lambda p=p, o=o, g1=g1, split=split: experts_fp8(x, w1, w2, p, o, g1, tiles.gemm2,
                                                                      split_k=split)
                     for p, o in zip(plans, outs)])
            rows.append(row)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del w1, w2
        torch.cuda.empty_cache()
    return rows


def errors(device: torch.device) -> list[dict[str, Any]]:
    """Each split against the float64 emulation of SPEC §5, DeepSeek-V3 widths on 16 experts."""
    gen = torch.Generator(device).manual_seed(1)
    E, H, I, K = 16, 7168, 2048, 8
    w1 = BlockFP8.quantize(torch.randn(E, 2 * I, H, device=device, generator=gen) / H**0.5)
    w2 = BlockFP8.quantize(torch.randn(E, H, I, device=device, generator=gen) / I**0.5)
    rows = []
    for M in (1, 16):
        x = torch.randn(M, H, device=device, generator=gen).bfloat16()
        plan = moe_dispatch(_routing(M, E, K, device, gen)[1], E, plan_block_m(M, w1, K, torch.bfloat16))
        n = int(plan.expert_offsets[-1])
        ref = moe_experts_fp8_torch(x, w1, w2, plan, dtype=torch.float64)[:n]
        tiles = configs.pick(M, E, H, I, K, tile_dtype(w1, torch.bfloat16), block_m=plan.block_m)
        for split in (1, 2, 3, 4):
            out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=device)
            experts_fp8(x, w1, w2, plan, out, tiles.gemm1, tiles.gemm2, split_k=split)
            rows.append({"M": M, "split_k": split, "err": rel_error(out[:n], ref), "rms": rms_rel_error(out[:n], ref)})
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    ceilings = timing.measure_ceilings(gemm=False)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "read_tbps": ceilings.read_tbps, "errors": errors(device),
                              "time": time_presets(device, ceilings.read_tbps)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
