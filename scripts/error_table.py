"""The routed experts' error against the float64 spec emulation, per format and tile path (GPU).

For every format (plain bf16 / fp16 / fp32 weights; BlockFP8 with bf16 activations, W8A8; MXFP4 with bf16 activations,
W4A16; MXFP4 with ``activation_quant="fp8"``, W4A8), every tile height the plan can take (16, 32, 64, 128 rows; W4A8
runs on 16, 32 and 128), each kernel family a cell can run (``paths``: the ``tl`` kernels; on Hopper also the
persistent ones of 16-bit and fp8 weights on 128 rows, and for MXFP4 the Gluon kernels the op runs there: W4A16's
``ws`` programs, wide and narrow, W4A8's ``decode`` programs on 16 and 32 rows, wide and narrow, and its
``persistent`` ones on 128) and four widths (the tests' narrow ones, a Qwen3-like and DeepSeek-V3's), many seeds of
fresh random inputs (-1 slots, the clamp on every other seed): ``moe_experts`` on the Triton backend against its float64
oracle, max and RMS relative error over the rows the plan computes. ``tests/tolerances.py`` takes its tolerances from
this table (the largest error seen, with headroom).

    python scripts/error_table.py [--seeds 12] [--out results] [--only FORMAT[:SHAPE[:PATH]] ...]

``--only`` measures those cells and keeps the other rows of ``OUT/errors.json`` (a run cut short is completed cell by
cell); the header then names both dates.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from pathlib import Path

import torch

from moefuse import _runtime
from moefuse.bench.timing import environment
from moefuse.dispatch import moe_dispatch
from moefuse.experts import moe_experts
from moefuse.experts.mxfp4 import w4a8, w4a8_decode, ws
from moefuse.experts.reference import moe_experts_fp8_torch, moe_experts_torch, moe_experts_w4a8_torch
from moefuse.formats import MXFP4, BlockFP8
from moefuse.testing import rel_error, rms_rel_error

# (name, activation dtype, activation_quant); the weights' format follows the name
FORMATS = [
    ("bf16", torch.bfloat16, None),
    ("fp16", torch.float16, None),
    ("fp32", torch.float32, None),
    ("fp8", torch.bfloat16, "fp8"),
    ("mxfp4", torch.bfloat16, None),
    ("w4a8", torch.bfloat16, "fp8"),
]
# (label, E, H, I, tokens, top-k): narrow widths not multiples of 128 where the format allows them
SHAPES = [
    ("narrow", 6, 256, 128, 96, 4),
    ("narrow-odd", 5, 200, 136, 96, 3),
    ("qwen3-like", 16, 2048, 768, 128, 8),
    ("deepseek-v3", 8, 7168, 2048, 128, 8),
]
BLOCK_MS = (16, 32, 64, 128)
PERSISTENT = ("bf16", "fp16", "fp8")  # formats the persistent kernels take (128-row tiles, Hopper)
PATHS = ("tl", "persistent", "ws", "ws-narrow", "decode", "decode-narrow")  # every name ``paths`` gives, in table order


def accepts(fmt: str, H: int, I: int, block_m: int) -> bool:
    """Whether the format runs these widths and tile height on the Triton backend here."""
    if fmt == "mxfp4":
        return H % 32 == 0 and I % 32 == 0
    if fmt == "w4a8":
        return H % 128 == 0 and I % 128 == 0 and block_m in (*w4a8_decode.LAUNCH, w4a8.BLOCK_M)
    return True


def weights(fmt: str, E: int, H: int, I: int, dtype: torch.dtype, gen: torch.Generator, device: str):
    w1 = torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, H, I, generator=gen) / math.sqrt(I)
    if fmt == "fp8":
        return BlockFP8.quantize(w1.to(device)), BlockFP8.quantize(w2.to(device))
    if fmt in ("mxfp4", "w4a8"):
        return MXFP4.quantize(w1.to(device)), MXFP4.quantize(w2.to(device))
    return w1.to(device, dtype), w2.to(device, dtype)


def oracle(fmt: str):
    return {"fp8": moe_experts_fp8_torch, "w4a8": moe_experts_w4a8_torch}.get(fmt, moe_experts_torch)


def paths(fmt: str, H: int, I: int, block_m: int, device: str) -> list[str]:
    """The kernel families a cell runs. Off Hopper (and under the interpreter) the ``tl`` kernels. On Hopper also the
    persistent kernels of 16-bit and fp8 weights on 128-row tiles; for MXFP4 with H and I multiples of 128, W4A16's
    ``tl`` kernels (forced: the op runs them only where the Gluon ones do not take the shapes), ``ws`` (wide
    programs) and ``ws-narrow`` on 16 rows; W4A8's ``decode`` and ``decode-narrow`` programs on their heights and
    its ``persistent`` ones on 128 rows (none elsewhere: W4A8 runs on Hopper only). Narrow or wide is forced in each
    (the op picks it by grid size)."""
    if device != "cuda" or _runtime.interpreting() or torch.cuda.get_device_capability() != (9, 0):
        return [] if fmt == "w4a8" else ["tl"]
    if fmt in PERSISTENT and block_m == 128:
        return ["tl", "persistent"]
    narrow = block_m in ws.NARROW_HEIGHTS
    if fmt == "mxfp4" and ws.widths_fit(H, I) and block_m in ws.LAUNCH:
        return ["tl", "ws", "ws-narrow"] if narrow else ["tl", "ws"]
    if fmt == "w4a8" and block_m in w4a8_decode.LAUNCH:
        return ["decode", "decode-narrow"] if narrow else ["decode"]
    if fmt == "w4a8":
        return ["persistent"]
    return ["tl"]


@contextlib.contextmanager
def forced(path: str):
    """Run the op on ``path`` (a name from :func:`paths`): the persistent kernels on or off, the MXFP4 Gluon
    kernels off for ``tl``, their programs narrow or wide (``ws.narrow_grid``, which the op looks up in its module
    at each call)."""
    eligible, narrow_grid = ws.ws_eligible, ws.narrow_grid
    if path == "tl":
        ws.ws_eligible = lambda *args: False
    ws.narrow_grid = lambda programs, block_m, device: path.endswith("-narrow")
    try:
        with _runtime.defaults(persistent="all" if path == "persistent" else "none"):
            yield
    finally:
        ws.ws_eligible, ws.narrow_grid = eligible, narrow_grid


def wanted(only: list[str], fmt: str, shape: str, path: str) -> bool:
    """``--only`` entries are FORMAT, FORMAT:SHAPE or FORMAT:SHAPE:PATH."""
    return not only or any((fmt, shape, path)[: len(o.split(":"))] == tuple(o.split(":")) for o in only)


def measure(fmt: str, dtype: torch.dtype, quant: str | None, shape: tuple, block_m: int, seed: int,
            device: str, path: str) -> tuple[float, float]:
    _, E, H, I, M, K = shape
    gen = torch.Generator().manual_seed(seed)
    w1, w2 = weights(fmt, E, H, I, dtype, gen, device)
    x = torch.randn(M, H, generator=gen).to(device, dtype)
    ids = torch.rand(M, E, generator=gen).argsort(dim=1)[:, :K].int()
    ids = torch.where(torch.rand(M, K, generator=gen) < 0.1, -1, ids).to(device)
    limit = 7.0 if seed % 2 else None
    plan = moe_dispatch(ids, E, block_m)
    with forced(path):
        out = moe_experts(x, w1, w2, plan, swiglu_limit=limit, activation_quant=quant, backend="triton")
    ref = oracle(fmt)(x, w1, w2, plan, swiglu_limit=limit, dtype=torch.float64,
                      out=torch.zeros(plan.num_rows, H, dtype=torch.float64, device=device))
    n = int(plan.expert_offsets[-1])
    return rel_error(out[:n], ref[:n]), rms_rel_error(out[:n], ref[:n])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12, help="seeds per narrow cell (a third of it on wide ones)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--only", nargs="*", default=[], help="FORMAT[:SHAPE[:PATH]] cells; other rows are kept")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kept, dates = [], [time.strftime("%Y-%m-%d")]
    if args.only and (args.out / "errors.json").exists():
        old = json.loads((args.out / "errors.json").read_text())
        kept = [r for r in old["rows"] if not wanted(args.only, r["format"], r["shape"], r.get("path", "tl"))]
        dates = sorted({*old["meta"]["date"].split(" and "), *dates})
    rows, start = [], time.time()
    for fmt, dtype, quant in FORMATS:
        for shape in SHAPES:
            seeds = args.seeds if shape[0].startswith("narrow") else max(args.seeds // 3, 2)
            for block_m in BLOCK_MS:
                if not accepts(fmt, shape[2], shape[3], block_m):
                    continue
                for path in paths(fmt, shape[2], shape[3], block_m, device):
                    if not wanted(args.only, fmt, shape[0], path):
                        continue
                    cell = {"format": fmt, "shape": shape[0], "E_H_I": shape[1:4], "block_m": block_m, "path": path}
                    try:
                        errors = [measure(fmt, dtype, quant, shape, block_m, seed, device, path)
                                  for seed in range(seeds)]
                    except Exception as exc:  # noqa: BLE001 (a valid input that fails is reported, not skipped)
                        print(f"{fmt:6} {shape[0]:12} bm={block_m:3} {path:10}  FAILED: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200]}", flush=True)
                        rows.append({**cell, "failed": f"{type(exc).__name__}"})
                        continue
                    maxes, rmses = [e[0] for e in errors], [e[1] for e in errors]
                    rows.append({**cell, "seeds": seeds, "max": max(maxes), "median_max": statistics.median(maxes),
                                 "rms": max(rmses)})
                    print(f"{fmt:6} {shape[0]:12} bm={block_m:3} {path:10}  max {max(maxes):.2e}  median "
                          f"{statistics.median(maxes):.2e}  rms {max(rmses):.2e}  ({time.time() - start:.0f}s)",
                          flush=True)
                    write(kept, rows, args.out, dates)  # after every cell: a run cut short keeps what it measured


def write(kept: list[dict], rows: list[dict], out: Path, dates: list[str]) -> None:
    """``errors.json`` and ``errors.md`` in ``out``: the kept rows and the measured ones, in the table's order."""
    order = {(f, s[0], p): i for i, (f, s, p) in enumerate(
        (f[0], s, p) for f in FORMATS for s in SHAPES for p in PATHS)}
    rows = sorted(kept + rows, key=lambda r: (order[r["format"], r["shape"], r.get("path", "tl")], r["block_m"]))
    out.mkdir(exist_ok=True)
    meta = {**environment(), "date": " and ".join(dates)}  # environment() has a date of its own
    (out / "errors.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        "# Experts: error against the float64 spec emulation, per format and tile path",
        "",
        f"`scripts/error_table.py`, {meta['date']}, " + ", ".join(f"{k} {v}" for k, v in meta.items() if k != "date")
        + ". Relative to the largest |reference| over the rows a plan computes (max), and RMS; the largest over "
        "the seeds, and the median of the max. `tests/tolerances.py` sets each tolerance from these.",
        "",
        "| format | shape (E, H, I) | rows a tile | kernels | seeds | max | median max | RMS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['format']} | {r['shape']} {tuple(r['E_H_I'])} | {r['block_m']} | {r.get('path', 'tl')} | "
              + (f"{r['seeds']} | {r['max']:.2e} | {r['median_max']:.2e} | {r['rms']:.2e} |" if "max" in r
                 else f"- | failed: {r['failed']} | | |") for r in rows]
    (out / "errors.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
