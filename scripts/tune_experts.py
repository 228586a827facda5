"""Tune the experts' 16-bit tile table on a GPU and write ``moefuse/configs/experts_<gpu>.json``.

Usage:

    python scripts/tune_experts.py                                  # SPEC models, default token buckets
    python scripts/tune_experts.py --models deepseek-v3 --tokens 1 16 128 1024 4096 --quick
    python scripts/tune_experts.py --seed --gpu h200                # no GPU: write the untuned heuristic seed
    python scripts/tune_experts.py --dense --passes 3 --timings results/tune_h100.json   # every format, dense grid

The table written is the one of this GPU's model (``configs.TABLES``, ``--gpu``); a table serves only the GPU model
its ``"gpu"`` header names (``configs.table_for``), so tuning on another model is refused. Entries of other formats
(``"format"``) in the table are kept as they are.

For each model shape and token count M (routing: random distinct top-K per token, bf16 weights ~ N(0, 0.02^2)):

1. Candidate tile heights: powers of two from 16 up to 4x the average rows per touched expert (at most 128).
2. For each height, one dispatch plan; GEMM1 (+ SwiGLU) and GEMM2 are timed separately under CUDA-graph
   replay (``timing.graph_time_us``) over every candidate launch shape that may fit shared memory and registers;
   candidates that fail to compile or launch are skipped.
3. The height with the smallest sum of the two best times wins; its config and times go into bucket M.

The table is rewritten after every (model, M), merged with the entries already there, so an interrupted run
keeps what it measured. Entries a run did not touch keep their status ("untuned seed" or an earlier tuning).

``--dense`` tunes the plan's tile height (and, for 16-bit experts, the whole config) over :data:`DENSE_GRID` (every
32 tokens up to 1,024, every 512 up to 8,192) for every format (``--formats``): at each M, the experts op (GEMM1 +
GEMM2, as a layer runs them) on each candidate (``dense_candidates``: the heuristic's config for each tile height
near the rows per expert, the table's current config, 128-row tiles grouped by 4, the persistent kernels) under
CUDA-graph replay, the tokens routed by the layer's own gate on random weights (``--routing layer``, as the sweep
runs the layer: some experts draw more rows than others) or uniformly (``--routing uniform``, how the committed H100
times were measured). Each bucket takes the tallest tile whose median over it and its two neighbours (so one noisy
time does not flip a choice) is within ``TALLER_WITHIN`` (2%) of the lowest: under skewed routing a short tile runs
twice for the experts past its height where a taller one runs once (on an H100, uniformly tuned, this rule removed
the layer sweep's bf16 cliffs of 3-6% at 384-992 tokens).
``--passes N`` times each candidate N times, in passes alternately forwards and backwards over the grid, and keeps
the median: one timing of a compute-bound launch moves with the clock under the power cap (launches that differ only
in grouping measured up to 15% apart on an H100). The candidates at one M run the same tokens and routing.
``--jobs N`` compiles every candidate first in N processes (on small copies of
the weights: the kernels depend on the shapes' widths, not on E), so the timing run loads them from Triton's cache.
``--timings`` keeps the raw times (a JSON list) and ``--from-timings`` rebuilds the entries from such a file.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from moefuse import _runtime
from moefuse.config import preset
from moefuse.experts import configs
from moefuse.experts.configs import GemmTiles, TileConfig

MODELS = ("deepseek-v3", "kimi-k2", "deepseek-v4-flash", "qwen3-30b-a3b", "glm-4.5-air")
TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SEED_STATUS = "untuned seed: configs.heuristic() for Hopper, written by scripts/tune_experts.py --seed"
MAX_ACC_REGS = 128  # fp32 accumulator registers per thread beyond which the compiler spills
DENSE_GRID = (1, 4, 16, *range(32, 1025, 32), *range(1536, 8193, 512))
TALLER_WITHIN = 0.02  # --dense: a taller tile wins when its time is within this share of the fastest (_dense_choice)
DENSE_FORMATS = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "mxfp4": torch.uint8}


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
    """The table's 16-bit entry of these shapes (entries without a ``"format"``), added if missing."""
    for entry in table["entries"]:
        if entry.get("format", "bf16") == "bf16" and (entry["E"], entry["H"], entry["I"], entry["K"]) == (E, H, I, K):
            return entry
    entry = {"model": name, "E": E, "H": H, "I": I, "K": K, "status": SEED_STATUS, "buckets": {}}
    table["entries"].append(entry)
    return entry


def seed_table(models: list[str], tokens: list[int], gpu: str) -> dict[str, Any]:
    """The untuned first-principles table of GPU model ``gpu`` (a key of ``configs.TABLES``; an sm_90 part of 132
    SMs, as the H100 SXM and the H200 are): :func:`configs.heuristic` for each model and bucket."""
    table: dict[str, Any] = {
        "what": f"tile configs of moefuse's experts GEMMs, bf16/fp16, for the {gpu.upper()}; "
                "buckets are token counts M, the nearest on a log scale is used",
        "gpu": {"name": gpu.upper(), "sms": _runtime.HOPPER.sms, "capability": list(_runtime.HOPPER.capability)},
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


def dense_candidates(M: int, name: str, fmt: str, table: dict[str, Any] | None = None) -> dict[str, Any]:
    """The launches ``--dense`` times at M tokens: name -> (tile height, config, persistent kernels)."""
    cfg = preset(name)
    E, H, I, K = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    per_expert = configs._next_pow2(-(-max(M * K, 1) // min(E, max(M * K, 1))))
    low, high = min(64, max(16, per_expert // 2)), min(128, max(16, 4 * per_expert))
    dtype = DENSE_FORMATS[fmt]
    found: dict[str, Any] = {}
    for block_m in (16, 32, 64, 128):
        # fp8: 32-row tiles run mma.sync (slower than 64-row wgmma), 128-row tl tiles spill (the persistent ones run)
        if low <= block_m <= high and not (fmt == "fp8" and block_m in (32, 128)):
            found[f"h{block_m}"] = (block_m, configs.heuristic(M, E, H, I, K, dtype, block_m=block_m), False)
    if fmt == "bf16":
        entry = next((e for e in (table or {}).get("entries", []) if e.get("format", "bf16") == "bf16"
                      and (e["E"], e["H"], e["I"], e["K"]) == (E, H, I, K)), None)
        if entry is not None:
            bucket = entry["buckets"][str(configs.nearest_bucket([int(m) for m in entry["buckets"]], M))]
            current = TileConfig.from_dict(bucket)
            found["table"] = (current.block_m, current, False)
        if "h128" in found:
            tall = found["h128"][1]
            grouped = replace(tall, gemm1=replace(tall.gemm1, group_m=4), gemm2=replace(tall.gemm2, group_m=4))
            found["h128g4"] = (128, grouped, False)
    if fmt == "fp8" and M >= 512:
        found["persistent"] = (128, configs.heuristic(M, E, H, I, K, dtype, block_m=128), True)
    return found


def time_passes(calls: list[Callable[[], Any]], passes: int, timer: Callable[[Callable[[], Any]], float],
                describe: Callable[[int], str]) -> list[list[float]]:
    """Each call timed ``passes`` times (``timer``), in passes that walk the list alternately forwards and
    backwards (``sweep.over_passes``: a drift of the clock under the power cap does not follow the list's order);
    each call's times in pass order, or [] for one that raised (logged once, with ``describe(i)``, and not timed
    again)."""
    from moefuse.bench.sweep import over_passes

    failed: set[int] = set()

    def time_at(i: int) -> float | None:
        if i in failed:
            return None
        try:
            return timer(calls[i])
        except Exception as error:  # noqa: BLE001 - a launch the GPU refuses is skipped
            failed.add(i)
            _log(f"{describe(i)}: {type(error).__name__}: {str(error)[:120]}")
            return None

    times = over_passes(time_at, list(range(len(calls))), passes)
    return [[] if i in failed else [t for t in times[i] if t is not None] for i in range(len(calls))]


def time_dense(models: list[str], formats: list[str], grid: list[int], table: dict[str, Any] | None,
               compile_only: tuple[int, int] | None = None,
               checkpoint: Callable[[list[dict[str, Any]]], None] | None = None,
               routing: str = "layer", passes: int = 1) -> list[dict[str, Any]]:
    """Time (or, with ``compile_only`` = (k, n), compile the k-th of n shares of) every dense candidate.
    ``checkpoint`` gets the times so far after each model and format (a run cut short keeps what it measured).
    ``routing``: "layer" routes each M's tokens through the layer's own gate (random weights, as ``moefuse bench
    sweep`` runs it: some experts draw more rows than others), "uniform" draws K distinct experts a token.
    ``passes``: each candidate's time the median of that many (:func:`time_passes`), kept as ``us_passes``. The
    candidates at one M run the same tokens and routing."""
    from statistics import median

    from moefuse import _runtime as runtime
    from moefuse.bench.sweep import _time_us
    from moefuse.dispatch import moe_dispatch
    from moefuse.experts import moe_experts
    from moefuse.layer import MoELayer

    rows: list[dict[str, Any]] = []
    job = 0
    compiled: set[tuple] = set()  # a compile share launches each distinct kernel set once
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in models:
        cfg = preset(name)
        small = replace(cfg, num_experts=2 * cfg.top_k, num_expert_group=1, topk_group=1)
        for fmt in formats:
            todo = []
            for M in grid:
                for cand, (block_m, tiles, persistent) in dense_candidates(M, name, fmt, table).items():
                    if compile_only is not None:
                        split = configs.fp8_split_k(M * cfg.top_k, cfg.intermediate_size, sms) if fmt == "fp8" else 0
                        kernels = (fmt, block_m, tiles, persistent, split, M == 1)
                        if kernels in compiled:
                            continue
                        compiled.add(kernels)
                        job += 1
                        if job % compile_only[1] != compile_only[0]:
                            continue
                    todo.append((M, cand, block_m, tiles, persistent))
            if not todo:
                continue
            layer_cfg = small if compile_only is not None else cfg
            layer = MoELayer(layer_cfg, device="cuda", quant=None if fmt == "bf16" else fmt).init_random_(0)
            w1, w2 = layer.experts.weights()
            E = layer_cfg.num_experts
            gen = torch.Generator("cuda").manual_seed(1)
            jobs: list[tuple[int, str, int, TileConfig, bool, Callable[[], Any]]] = []
            tokens: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # M -> its tokens and routing, every candidate's
            for M, cand, block_m, tiles, persistent in todo:
                if M not in tokens:
                    x = torch.randn(M, cfg.hidden_size, generator=gen, device="cuda", dtype=torch.bfloat16)
                    if routing == "layer" and compile_only is None:
                        with torch.no_grad():
                            tokens[M] = x, layer.gate(x)[1]
                    else:  # a compile share's small layer routes over other experts: its plans need only the shapes
                        scores = torch.rand(M, E, generator=gen, device="cuda")
                        tokens[M] = x, scores.topk(cfg.top_k, dim=1).indices.int()
                x, ids = tokens[M]
                plan = moe_dispatch(ids, E, block_m)

                def call(tiles: TileConfig = tiles, plan: Any = plan, x: torch.Tensor = x,
                         persistent: bool = persistent) -> torch.Tensor:
                    with configs.override(tiles), runtime.defaults():
                        return moe_experts(x, w1, w2, plan, swiglu_limit=cfg.swiglu_limit,
                                           persistent="all" if persistent else "none")
                jobs.append((M, cand, block_m, tiles, persistent, call))
            calls = [entry[-1] for entry in jobs]
            if compile_only is not None:  # compile: one launch each (a refused one is skipped)
                time_passes(calls, 1, lambda call: (call(), torch.cuda.synchronize(), 0.0)[-1],
                            lambda i: f"{name} {fmt} M={jobs[i][0]} {jobs[i][1]}")
            else:
                times = time_passes(calls, passes, _time_us, lambda i: f"{name} {fmt} M={jobs[i][0]} {jobs[i][1]}")
                for (M, cand, block_m, tiles, persistent, _), us in zip(jobs, times):
                    if us:
                        rows.append({"model": name, "format": fmt, "M": M, "cand": cand, "block_m": block_m,
                                     "config": tiles.to_dict(), "persist": persistent, "us": median(us),
                                     "routing": routing, **({"us_passes": us} if passes > 1 else {})})
            _log(f"{'compiled' if compile_only else 'timed'} {name} {fmt}")
            del layer, w1, w2, jobs, calls, tokens  # the closures hold the weights: the next format's are as large
            torch.cuda.empty_cache()
            if checkpoint is not None and compile_only is None:
                checkpoint(rows)
    return rows


def dense_entries(rows: list[dict[str, Any]], gpu_name: str, date: str) -> list[dict[str, Any]]:
    """Table entries from dense timings: each bucket the tallest candidate within ``TALLER_WITHIN`` of the lowest
    median over it and its two neighbouring token counts (its own time where a neighbour lacks it); 16-bit buckets
    hold the config, the others the tile height. 16-bit's persistent kernels are not a table choice (opt-in)."""
    return _dense_choice(rows, gpu_name, date)[0]


def dense_choice_times(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The time of the candidate each bucket chose, one row per model, format and M (``model``, ``format``, ``M``,
    ``us``): the experts' curve the table gives, which ``moefuse.bench.sweep.cliffs`` checks."""
    return _dense_choice(rows, "", "")[1]


def _dense_choice(rows: list[dict[str, Any]], gpu_name: str, date: str) -> tuple[list[dict[str, Any]], list[dict]]:
    import statistics

    times: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    chosen: dict[tuple[str, str, int, str], dict[str, Any]] = {}
    routings: dict[tuple[str, str], str] = {}
    for row in rows:
        times.setdefault((row["model"], row["format"]), {}).setdefault(row["M"], {})[row["cand"]] = row["us"]
        chosen[(row["model"], row["format"], row["M"], row["cand"])] = row
        # times written before routing was recorded were all uniform
        routings[(row["model"], row["format"])] = {"layer": "the layer's own", "uniform": "uniform random"}[
            row.get("routing", "uniform")]
    entries, curve = [], []
    for (name, fmt), by_m in times.items():
        cfg = preset(name)
        sizes = sorted(by_m)
        buckets = {}
        for i, M in enumerate(sizes):
            near = [sizes[j] for j in (i - 1, i, i + 1) if 0 <= j < len(sizes)]
            score = {cand: statistics.median([by_m[n][cand] for n in near])
                     if all(cand in by_m[n] for n in near) else us
                     for cand, us in by_m[M].items() if not (fmt == "bf16" and chosen[(name, fmt, M, cand)]["persist"])}
            # the tallest tile within TALLER_WITHIN of the fastest: a router that loads some experts more than the
            # tuning did runs a short tile twice for them
            near_best = [c for c in score if score[c] <= min(score.values()) * (1 + TALLER_WITHIN)]
            tallest = max(chosen[(name, fmt, M, c)]["block_m"] for c in near_best)
            best = chosen[(name, fmt, M, min((c for c in near_best if chosen[(name, fmt, M, c)]["block_m"] == tallest),
                                             key=lambda cand: score[cand]))]
            buckets[str(M)] = best["config"] if fmt == "bf16" else {"block_m": best["block_m"]}
            curve.append({"model": name, "format": fmt, "M": M, "us": best["us"]})
        entries.append({"model": name, "format": fmt, "E": cfg.num_experts, "H": cfg.hidden_size,
                        "I": cfg.intermediate_size, "K": cfg.top_k,
                        "status": f"tuned on {gpu_name}, {date}: scripts/tune_experts.py --dense (routed experts, "
                                  f"GEMM1 + GEMM2 under CUDA-graph replay, {routings[(name, fmt)]} routing; each "
                                  f"bucket the tallest tile within {TALLER_WITHIN:.0%} of the lowest median over it "
                                  "and its two neighbours)",
                        "buckets": buckets})
    return entries, curve


def merge_entries(table: dict[str, Any], entries: list[dict[str, Any]]) -> None:
    """Put ``entries`` into the table: an entry of the same format and shapes is replaced over the token range the
    new one measured (its first to its last bucket), and keeps its buckets outside it, with their status after the
    new one's; a 16-bit entry keeps its ``shared_slot_max_tokens``. Entries of other shapes are added."""
    def key(e: dict[str, Any]) -> tuple:
        return (e.get("format", "bf16"), e["E"], e["H"], e["I"], e["K"])

    old = {key(e): e for e in table["entries"]}
    for entry in entries:
        previous = old.get(key(entry))
        if previous is not None:
            if "shared_slot_max_tokens" in previous:
                entry["shared_slot_max_tokens"] = previous["shared_slot_max_tokens"]
            measured = [int(m) for m in entry["buckets"]]
            kept = {m: c for m, c in previous["buckets"].items() if not min(measured) <= int(m) <= max(measured)}
            if kept:
                entry["status"] += (f"; buckets outside {min(measured)}-{max(measured)} tokens: "
                                    f"{previous['status']}")
                entry["buckets"] = dict(sorted({**kept, **entry["buckets"]}.items(), key=lambda mc: int(mc[0])))
        old[key(entry)] = entry
    table["entries"] = list(old.values())


def run_dense(args: argparse.Namespace, table: dict[str, Any], out: Path) -> int:
    """``--dense``: compile (in ``--jobs`` processes), time, and write the entries (and ``--timings``)."""
    import subprocess

    if args.from_timings:
        rows = json.loads(Path(args.from_timings).read_text())
    else:
        grid = list(args.tokens) if args.tokens != list(TOKENS) else list(DENSE_GRID)
        if args.jobs > 1:
            _log(f"compiling every candidate in {args.jobs} processes")
            common = [sys.executable, __file__, "--dense", "--compile-share", "", "--models", *args.models,
                      "--formats", *args.formats, "--tokens", *map(str, grid), "--out", str(out)]
            procs = [subprocess.Popen([*common[:4], f"{k}/{args.jobs}", *common[5:]]) for k in range(args.jobs)]
            if any(proc.wait() for proc in procs):
                _log("a compile process failed; its candidates compile while timed")
        rows = time_dense(args.models, args.formats, grid, table,
                          checkpoint=lambda done: _write_dense(args, table, out, done), routing=args.routing,
                          passes=args.passes)
    _write_dense(args, table, out, rows)
    _log(f"wrote {out}")
    from moefuse.bench.sweep import cliffs

    for cliff in cliffs(dense_choice_times(rows)):
        _log(f"the table's choice is {cliff['drop']:.1%} faster at {cliff['M']} tokens than at {cliff['slower_M']}: "
             f"{cliff['model']} {cliff['format']}")
    return 0


def _write_dense(args: argparse.Namespace, table: dict[str, Any], out: Path, rows: list[dict[str, Any]]) -> None:
    """The table with the entries of ``rows`` merged in (a copy of ``table``: entries measured later replace these),
    and the raw times where ``--timings`` asks."""
    if args.timings and not args.from_timings:
        Path(args.timings).write_text(json.dumps(rows) + "\n")
    here = torch.cuda.get_device_name() if torch.cuda.is_available() else f"an {table['gpu']['name']}"
    merged = json.loads(json.dumps(table))
    merge_entries(merged, dense_entries(rows, here, args.measured_on or datetime.date.today().isoformat()))
    _write(merged, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--quick", action="store_true", help="a smaller candidate space (minutes, not hours)")
    parser.add_argument("--seed", action="store_true", help="write the untuned heuristic table (no GPU needed)")
    parser.add_argument("--gpu", choices=sorted(configs.TABLES),
                        help="the GPU model whose table to write (default: this GPU's; h200 without a GPU)")
    parser.add_argument("--out", type=Path, help="where to write it (default: the model's configs.TABLES path)")
    parser.add_argument("--dense", action="store_true",
                        help="tune tile heights of every format over a dense token grid (module docstring)")
    parser.add_argument("--formats", nargs="+", default=list(DENSE_FORMATS), choices=list(DENSE_FORMATS),
                        help="--dense: the formats")
    parser.add_argument("--jobs", type=int, default=8, help="--dense: processes that compile the candidates first")
    parser.add_argument("--timings", help="--dense: write the raw times to this JSON file")
    parser.add_argument("--from-timings", help="--dense: build the entries from this file of raw times (no GPU)")
    parser.add_argument("--routing", choices=("layer", "uniform"), default="layer",
                        help="--dense: tokens routed by the layer's own gate (as the sweep runs it) or uniformly")
    parser.add_argument("--passes", type=int, default=1,
                        help="--dense: each candidate timed this many times, in passes alternately forwards and "
                             "backwards over the grid; the median kept (the power cap moves the clock)")
    parser.add_argument("--measured-on", help="--from-timings: the date the times were measured (the entries' status)")
    parser.add_argument("--compile-share", help=argparse.SUPPRESS)  # k/n: a compile process of --jobs
    args = parser.parse_args(argv)
    here = _runtime.gpu(torch.device("cuda")) if torch.cuda.is_available() else None
    gpu = args.gpu or next((name for name in sorted(configs.TABLES) if here and name.upper() in here.name), "h200")
    out = args.out or configs.TABLES[gpu]
    if args.compile_share:
        k, n = (int(v) for v in args.compile_share.split("/"))
        current = configs.load_table(out) if out.exists() else None
        time_dense(args.models, args.formats, list(args.tokens), current, compile_only=(k, n))
        return 0
    if args.seed:
        _write(seed_table(args.models, args.tokens, gpu), out)
        _log(f"wrote the untuned seed to {out}")
        return 0
    if args.dense and args.from_timings:
        table = json.loads(json.dumps(configs.load_table(out)))
        return run_dense(args, table, out)
    if here is None:
        _log("tuning needs a CUDA GPU (use --seed to write the heuristic table)")
        return 2
    table = configs.load_table(out) if out.exists() else seed_table([], [], gpu)
    head = table["gpu"]
    if not (head["name"] in here.name and head["sms"] == here.sms and tuple(head["capability"]) == here.capability):
        _log(f"this is a {here.name} ({here.sms} SMs), but {out} serves {head}: tuning it here would be wrong")
        return 2
    table = json.loads(json.dumps(table))  # a private copy: load_table's result is cached and shared
    if args.dense:
        return run_dense(args, table, out)
    for name in args.models:
        _log(f"tuning {name} at M = {args.tokens}")
        tune_model(name, args.tokens, args.quick, table, out)
    _log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
