"""Tune the experts' tile table on a GPU and write ``moefuse/configs/experts_<gpu>.json``.

Usage, from the repository root:

    python scripts/tune_experts.py                                  # SPEC models, default token buckets
    python scripts/tune_experts.py --models deepseek-v3 --tokens 1 16 128 1024 4096 --quick
    python scripts/tune_experts.py --seed                           # no GPU: write the untuned heuristic seed

For each model shape and token count M (routing: random distinct top-K per token, bf16 weights ~ N(0, 0.02^2)):

1. Candidate tile heights: powers of two from 16 up to 4x the average rows per touched expert (at most 128).
2. For each height, one dispatch plan; GEMM1 (+ SwiGLU) and GEMM2 are timed separately under CUDA-graph
   replay (``timing.graph_time_us``) over every candidate launch shape that may fit shared memory and registers;
   candidates that fail to compile or launch are skipped.
3. The height with the smallest sum of the two best times wins; its config and times go into bucket M.

The table is rewritten after every (model, M), merged with the entries already there, so an interrupted run
keeps what it measured. Entries a run did not touch keep their status ("untuned seed" or an earlier tuning).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from moefuse.config import preset  # noqa: E402
from moefuse.experts import configs  # noqa: E402
from moefuse.experts.configs import GemmTiles, TileConfig  # noqa: E402

MODELS = ("deepseek-v3", "kimi-k2", "deepseek-v4-flash", "qwen3-30b-a3b", "glm-4.5-air")
TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SEED_STATUS = "untuned seed: configs.heuristic() for Hopper, written by scripts/tune_experts.py --seed"
MAX_ACC_REGS = 128  # fp32 accumulator registers per thread beyond which the compiler spills


def _log(message: str) -> None:
    print(f"[tune {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def block_m_candidates(M: int, E: int, K: int) -> list[int]:
    rows = max(M * K, 1)
    per_expert = -(-rows // min(E, rows))
    cap = min(128, max(16, 4 * configs._next_pow2(per_expert)))
    return [b for b in (16, 32, 64, 128) if b <= cap]


def tile_candidates(block_m: int, n: int, k: int, operands: int, quick: bool) -> list[GemmTiles]:
    """Launch shapes for one GEMM: N x K block sizes, warps, stages and grouping, pruned by resources."""
    # group_m 0: one group per expert (see experts/common.py, _program_tile)
    space = dict(block_n=(32, 64, 128, 256), block_k=(64, 128, 256), num_warps=(4, 8), num_stages=(3, 4, 5),
                 group_m=(0, 1, 4, 8))
    if quick:
        space = dict(block_n=(64, 128), block_k=(64, 128), num_warps=(4, 8), num_stages=(3, 4), group_m=(0, 1, 4))
    found = []
    for bn, bk, warps, stages, group in itertools.product(*space.values()):
        if bn > max(16, configs._next_pow2(n)) or bk > max(16, configs._next_pow2(k)):
            continue
        tiles = GemmTiles(bn, bk, group, warps, stages)
        # Only launches that surely cannot fit are pruned; the rest are compiled and timed, and those the GPU
        # refuses (OutOfResources) are skipped. (Pruning by configs.smem_bytes, an upper model, dropped
        # launches that fit, such as 4-stage 128 x 128 decode tiles: about 200 KB compiled, 272 KB modelled.)
        if configs.weight_buffer_bytes(tiles, operands, 2) > configs.HOPPER_SMEM:
            continue
        if operands * block_m * bn / (32 * warps) > MAX_ACC_REGS:
            continue
        found.append(tiles)
    return found


def _best(calls: dict[GemmTiles, Any]) -> tuple[GemmTiles | None, float]:
    from moefuse.bench import timing

    best, best_us = None, float("inf")
    for tiles, call in calls.items():
        try:
            us = timing.graph_time_us([call], replays=10, warmup=2)
        except Exception as exc:  # out of shared memory / registers on this GPU: not a candidate
            _log(f"  skip {tiles}: {type(exc).__name__}: {str(exc)[:80]}")
            torch.cuda.synchronize()
            continue
        if us < best_us:
            best, best_us = tiles, us
    return best, best_us


def tune_model(name: str, tokens: list[int], quick: bool, table: dict[str, Any], path: Path) -> None:
    from moefuse.dispatch import moe_dispatch
    from moefuse.experts.bf16 import gemm1_swiglu, gemm2

    cfg = preset(name)
    E, H, I, K, limit = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k, cfg.swiglu_limit
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    w1 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen)
    entry = _entry(table, name, E, H, I, K)
    for M in tokens:
        x = torch.randn(M, H, device=device, generator=gen).bfloat16()
        ids = torch.rand(M, E, device=device, generator=gen).argsort(dim=1)[:, :K].int()
        inter = torch.empty(M * K, I, dtype=torch.bfloat16, device=device)
        out = torch.empty(M * K, H, dtype=torch.bfloat16, device=device)
        best: tuple[float, TileConfig, float, float] | None = None
        for block_m in block_m_candidates(M, E, K):
            plan = moe_dispatch(ids, E, block_m)
            g1, us1 = _best({t: (lambda t=t: gemm1_swiglu(x, w1, plan, inter, t, limit))
                             for t in tile_candidates(block_m, I, H, 2, quick)})
            g2, us2 = _best({t: (lambda t=t: gemm2(inter, w2, plan, out, t))
                             for t in tile_candidates(block_m, H, I, 1, quick)})
            if g1 is None or g2 is None:
                continue
            _log(f"{name} M={M} block_m={block_m}: gemm1 {us1:.1f} us {g1}, gemm2 {us2:.1f} us {g2}")
            if best is None or us1 + us2 < best[0]:
                best = (us1 + us2, TileConfig(block_m, g1, g2), us1, us2)
        if best is None:
            _log(f"{name} M={M}: no candidate ran; bucket left as it was")
            continue
        entry["buckets"][str(M)] = best[1].to_dict() | {"us": {"gemm1": round(best[2], 2), "gemm2": round(best[3], 2)}}
        entry["status"] = f"tuned on {torch.cuda.get_device_name()}, {datetime.date.today().isoformat()}"
        _write(table, path)
    del w1, w2
    torch.cuda.empty_cache()


def _entry(table: dict[str, Any], name: str, E: int, H: int, I: int, K: int) -> dict[str, Any]:
    for entry in table["entries"]:
        if (entry["E"], entry["H"], entry["I"], entry["K"]) == (E, H, I, K):
            return entry
    entry = {"model": name, "E": E, "H": H, "I": I, "K": K, "status": SEED_STATUS, "buckets": {}}
    table["entries"].append(entry)
    return entry


def seed_table(models: list[str], tokens: list[int]) -> dict[str, Any]:
    """The untuned first-principles table: :func:`configs.heuristic` for each model and bucket."""
    table: dict[str, Any] = {
        "what": "tile configs of moefuse's experts GEMMs on sm90 (H100/H200), bf16/fp16; "
                "buckets are token counts M, the nearest on a log scale is used",
        "arch": [9, 0],
        "entries": [],
    }
    for name in models:
        cfg = preset(name)
        E, H, I, K = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
        entry = _entry(table, name, E, H, I, K)
        for M in tokens:
            entry["buckets"][str(M)] = configs.heuristic(M, E, H, I, K, torch.bfloat16).to_dict()
    return table


def _write(table: dict[str, Any], path: Path) -> None:
    """JSON with one line per entry header and per bucket, so a diff shows which configs changed."""
    head = {k: v for k, v in table.items() if k != "entries"}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + [' "entries": [']
    for i, entry in enumerate(table["entries"]):
        fields = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in entry.items() if k != "buckets")
        buckets = sorted(entry["buckets"].items(), key=lambda item: int(item[0]))
        lines.append(f"  {{{fields}, \"buckets\": {{")
        lines += [f"   {json.dumps(m)}: {json.dumps(c)}{',' if j < len(buckets) - 1 else ''}"
                  for j, (m, c) in enumerate(buckets)]
        lines.append("  }}" + ("," if i < len(table["entries"]) - 1 else ""))
    lines += [" ]", "}"]
    text = "\n".join(lines) + "\n"
    json.loads(text)  # never write a table that does not parse
    path.write_text(text)
    configs.load_table.cache_clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--quick", action="store_true", help="a smaller candidate space (minutes, not hours)")
    parser.add_argument("--seed", action="store_true", help="write the untuned heuristic table (no GPU needed)")
    parser.add_argument("--out", type=Path, default=configs.TABLES[(9, 0)])
    args = parser.parse_args(argv)
    if args.seed:
        _write(seed_table(args.models, args.tokens), args.out)
        _log(f"wrote the untuned seed to {args.out}")
        return 0
    if not torch.cuda.is_available():
        _log("tuning needs a CUDA GPU (use --seed to write the heuristic table)")
        return 2
    if torch.cuda.get_device_capability() != (9, 0):
        _log(f"warning: tuning on {torch.cuda.get_device_name()}, but the table is read for sm90 only")
    table = configs.load_table(args.out) if args.out.exists() else seed_table([], [])
    table = json.loads(json.dumps(table))  # a private copy: load_table's result is cached and shared
    for name in args.models:
        _log(f"tuning {name} at M = {args.tokens}")
        tune_model(name, args.tokens, args.quick, table, args.out)
    _log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
