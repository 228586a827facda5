"""``moefuse bench sweep``: the whole layer on a dense grid of token counts, to find cliffs.

``moefuse bench`` samples a few token counts; serving traffic lands everywhere in between, and a tile table that
switches tile shapes at the wrong size makes a layer slower on more tokens than on fewer. This sweep times the
layer at every :data:`GRID` token count (every 32 up to 1,024, every 256 up to 8,192, and two decode sizes) for
each preset and weight format, beside its floor (the larger of the touched weights at the measured read bandwidth
and the arithmetic at the measured bf16 GEMM rate) and, for bf16 on the models transformers has, transformers' own
MoE block on the same weights with ``experts_implementation="grouped_mm"`` (the moefuse side of that comparison is
``moefuse.from_hf`` of the same block).

:func:`cliffs` lists where the time falls by more than :data:`TOLERANCE` as tokens grow (the running maximum of the
smaller sizes against each size): the property the committed sweeps are checked for, on the CPU, by
``tests/test_sweep.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from statistics import median
from typing import Any, TypeVar

import torch

GRID: tuple[int, ...] = (1, 16, *range(32, 1025, 32), *range(1280, 8193, 256))
T = TypeVar("T")
TOLERANCE = 0.03  # a later size may be this much faster than the slowest earlier one before it counts as a cliff
FORMATS: dict[str, dict[str, Any]] = {  # the layer's arguments per format name
    "bf16": {"quant": None},
    "fp8": {"quant": "fp8"},
    "mxfp4": {"quant": "mxfp4"},
}
MODELS = ("deepseek-v3", "kimi-k2", "deepseek-v4-flash", "glm-4.5-air", "qwen3-30b-a3b")
COLUMNS = [("model", "model"), ("format", "format"), ("M", "M"), ("us", "µs"), ("floor_us", "floor µs"),
           ("x_floor", "× floor"), ("hf_us", "transformers µs"), ("from_hf_us", "from_hf µs")]
SUMMARY_COLUMNS = [("model", "model"), ("format", "format"), ("sizes", "sizes"), ("us_1", "µs at 1"),
                   ("us_max", "µs at the largest"), ("x_floor_max", "worst × floor"), ("cliffs", "cliffs"),
                   ("worst_drop", "worst drop"), ("x_hf_min", "least speedup vs transformers")]
CLIFF_COLUMNS = [("model", "model"), ("format", "format"), ("slower_M", "smaller M"), ("slower_us", "its µs"),
                 ("M", "M"), ("us", "µs"), ("drop", "drop")]
TITLE = "MoE layer over a dense token grid (CUDA-graph replay)"
# transformers' block class and config for the presets it has, full size (DeepSeek-V4's blocks are hash-routed in
# its first layers and need token ids: not swept against transformers).
HF_BLOCKS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "deepseek-v3": ("DeepseekV3Config", "deepseek_v3", "DeepseekV3MoE", dict(
        hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
        topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "kimi-k2": ("DeepseekV3Config", "deepseek_v3", "DeepseekV3MoE", dict(
        hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=384, num_experts_per_tok=8, n_group=1,
        topk_group=1, n_shared_experts=1, routed_scaling_factor=2.827, norm_topk_prob=True)),
    "glm-4.5-air": ("Glm4MoeConfig", "glm4_moe", "Glm4MoeMoE", dict(
        hidden_size=4096, moe_intermediate_size=1408, n_routed_experts=128, num_experts_per_tok=8,
        n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeSparseMoeBlock", dict(
        hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)),
}


def cliffs(rows: Iterable[dict[str, Any]], key: str = "us", tolerance: float = TOLERANCE) -> list[dict[str, Any]]:
    """Every size whose time is more than ``tolerance`` below the slowest smaller size of the same model and format:
    ``{"model", "format", "M", "us", "slower_M", "slower_us", "drop"}`` (``drop``: the slower size's time over this
    one's, minus 1). Rows without a time are skipped."""
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in rows:
        if isinstance(row.get(key), (int, float)):
            series.setdefault((row["model"], row["format"]), []).append((int(row["M"]), float(row[key])))
    found = []
    for (model, fmt), points in series.items():
        worst_m, worst = 0, -1.0
        for m, us in sorted(points):
            if worst > us * (1 + tolerance):
                found.append({"model": model, "format": fmt, "M": m, "us": us, "slower_M": worst_m,
                              "slower_us": worst, "drop": worst / us - 1})
            if us > worst:
                worst_m, worst = m, us
    return found


def slower_than_transformers(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows where moefuse on a transformers block's weights (``from_hf_us``) took longer than the block itself."""
    return [row for row in rows if isinstance(row.get("hf_us"), (int, float))
            and isinstance(row.get("from_hf_us"), (int, float)) and row["from_hf_us"] > row["hf_us"]]


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model and format: sizes swept, the ends, the worst × floor, the cliffs and the least speedup over
    transformers."""
    found = cliffs(rows)
    out = []
    for key in dict.fromkeys((row["model"], row["format"]) for row in rows):
        mine = sorted((row for row in rows if (row["model"], row["format"]) == key), key=lambda row: row["M"])
        drops = [c["drop"] for c in found if (c["model"], c["format"]) == key]
        speedups = [row["hf_us"] / row["from_hf_us"] for row in mine
                    if isinstance(row.get("hf_us"), (int, float)) and isinstance(row.get("from_hf_us"), (int, float))]
        out.append({"model": key[0], "format": key[1], "sizes": len(mine), "us_1": mine[0]["us"],
                    "us_max": mine[-1]["us"], "x_floor_max": max(row["x_floor"] for row in mine),
                    "cliffs": len(drops), "worst_drop": max(drops, default=0.0),
                    "x_hf_min": min(speedups, default=None)})
    return out


def load(path: Path) -> dict[str, Any]:
    """A sweep written by :func:`write`."""
    return json.loads(Path(path).read_text())


def _time_us(fn: Callable[[], object]) -> float:
    """Device time of one call: CUDA-graph replay where the call can be captured, else the median of event-timed
    eager calls (a transformers block that synchronises with the host)."""
    from moefuse.bench import timing

    try:
        return _graph_us(fn)
    except Exception:  # noqa: BLE001 - not capturable: time it eagerly
        torch.cuda.synchronize()
        return timing.event_time_us(fn, reps=10, warmup=0)


def _graph_us(fn: Callable[[], object]) -> float:
    from moefuse.bench import timing

    fn()  # compile and allocate outside the graph; a first eager call also sizes the graph
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    eager_ms = start.elapsed_time(end)
    # Small calls are captured several to a graph (the graph's launch stays out of their time); large ones alone,
    # so a graph of an 8,192-token layer does not hold ten layers' activations.
    calls = 10 if eager_ms < 0.5 else 1
    return timing.graph_time_us([fn], replays=20 if eager_ms < 2 else 8, warmup=1, min_calls=calls)


def read_bytes(layer: Any, x: torch.Tensor) -> tuple[float, float]:
    """The bytes a layer's call on tokens ``x`` must read: its touched routed experts' (values and scales), and the
    whole layer's (those, the shared expert in its format, the router weight, the activations in and out)."""
    c = layer.config
    _, ids = layer.gate(x)
    touched = int(torch.unique(ids[(ids >= 0) & (ids < c.num_experts)]).numel())
    experts = touched * sum(_nbytes(w) for w in layer.experts.weights()) / c.num_experts
    shared = 3 * c.hidden_size * c.shared_intermediate_size * (1 if layer.shared_format.quantized else x.element_size())
    return experts, experts + shared + _nbytes(layer.gate.weight) + 2 * x.numel() * x.element_size()


def floor_us(layer: Any, x: torch.Tensor, ceilings: Any) -> float:
    """The layer's floor on tokens ``x``: the larger of its bytes (:func:`read_bytes`) at the measured read bandwidth
    and its multiply-adds at the measured bf16 GEMM rate, plus a launch."""
    c = layer.config
    flops = 2 * x.shape[0] * (c.top_k * 3 * c.hidden_size * c.intermediate_size
                              + 3 * c.hidden_size * c.shared_intermediate_size + c.num_experts * c.hidden_size)
    seconds = max(read_bytes(layer, x)[1] / (ceilings.read_tbps * 1e12), flops / (ceilings.gemm_tflops * 1e12))
    return ceilings.empty_us + seconds * 1e6


def _nbytes(weight: Any) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return sum(t.numel() * t.element_size() for t in (weight.values, weight.scales))


def hf_block(model: str, device: str = "cuda") -> torch.nn.Module | None:
    """transformers' full-size MoE block of ``model`` in bf16 with random weights, on ``grouped_mm``; None where
    transformers lacks the model or the block cannot be built."""
    if model not in HF_BLOCKS:
        return None
    import importlib

    import transformers

    from moefuse.layer import init_random_

    config_name, module, block_name, kwargs = HF_BLOCKS[model]
    try:
        config = getattr(transformers, config_name)(**kwargs)
        block_cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), block_name)
        config._experts_implementation = "grouped_mm"
        with torch.device(device):
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                block = block_cls(config).eval()
            finally:
                torch.set_default_dtype(default)
    except Exception as exc:  # noqa: BLE001 - a transformers version without the model: no column, not a failure
        print(f"  transformers {model}: {type(exc).__name__}: {exc}".splitlines()[0])
        return None
    init_random_(block, seed=0)
    return block


def over_passes(time_at: Callable[[int], T], grid: Sequence[int], passes: int) -> dict[int, list[T]]:
    """``time_at(m)`` for every size of ``grid``, ``passes`` times: odd passes walk the grid backwards, so a drift
    of the GPU's clock over a pass (its power cap engages as a sweep heats it) does not follow the size order.
    Returns each size's results in pass order."""
    times: dict[int, list[T]] = {m: [] for m in grid}
    for p in range(passes):
        for m in (grid if p % 2 == 0 else list(reversed(grid))):
            times[m].append(time_at(m))
    return times


def run(ceilings: Any, quick: bool = False, models: Sequence[str] = MODELS, formats: Sequence[str] = tuple(FORMATS),
        grid: Sequence[int] = GRID, progress: Callable[[str], None] = print, compare_hf: bool = True,
        batch_invariant: bool = False, checkpoint: Callable[[list[dict[str, Any]]], None] | None = None,
        passes: int = 1) -> list[dict[str, Any]]:
    """Time each model and format over ``grid`` (``quick``: every fourth size); returns one row per size, its time
    the median of ``passes`` passes (:func:`over_passes`; the row keeps them all as ``us_passes``). Each size's
    tokens are seeded by the size, so every pass sees the same input. With ``batch_invariant`` the layers are built
    with ``batch_invariant=True``. ``checkpoint`` gets the rows so far after each model and format (a long sweep cut
    short keeps what it measured)."""
    if not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes must be a positive int, got {passes!r}")
    layer_kwargs: dict[str, Any] = {"batch_invariant": True} if batch_invariant else {}
    import moefuse
    from moefuse.config import preset
    from moefuse.layer import MoELayer

    grid = list(grid)[::4] if quick else list(grid)
    rows: list[dict[str, Any]] = []

    def tokens(m: int, width: int) -> torch.Tensor:
        gen = torch.Generator("cuda").manual_seed(m)
        return torch.randn(m, width, generator=gen, device="cuda", dtype=torch.bfloat16)

    def timed(call: Callable[[torch.Tensor], object], width: int) -> Callable[[int], float]:
        def time_at(m: int) -> float:
            x = tokens(m, width)
            with torch.no_grad():
                return _time_us(lambda: call(x))
        return time_at

    for model in models:
        for fmt in formats:
            progress(f"sweep {model} {fmt}: {len(grid)} sizes" + (f", {passes} passes" if passes > 1 else ""))
            layer = MoELayer(preset(model), device="cuda", **FORMATS[fmt], **layer_kwargs).init_random_(0)
            width = layer.config.hidden_size
            times = over_passes(timed(layer, width), grid, passes)
            for m in grid:
                us = median(times[m])
                with torch.no_grad():
                    floor = floor_us(layer, tokens(m, width), ceilings)
                rows.append({"model": model, "format": fmt, "M": m, "us": us, "floor_us": floor,
                             "x_floor": us / floor, **({"us_passes": times[m]} if passes > 1 else {})})
            del layer
            torch.cuda.empty_cache()
            if checkpoint is not None:
                checkpoint(rows)
        if not compare_hf or "bf16" not in formats:
            continue
        block = hf_block(model)
        if block is None:
            continue
        progress(f"sweep {model}: transformers grouped_mm and moefuse.from_hf on its weights")
        ours = moefuse.from_hf(block, **layer_kwargs)
        by_m = {row["M"]: row for row in rows if row["model"] == model and row["format"] == "bf16"}
        width = ours.config.hidden_size
        theirs, mine = timed(lambda x: block(x[None]), width), timed(ours, width)
        pairs = over_passes(lambda m: (theirs(m), mine(m)), grid, passes)  # side by side at each size
        for m in grid:
            by_m[m]["hf_us"] = median([pair[0] for pair in pairs[m]])
            by_m[m]["from_hf_us"] = median([pair[1] for pair in pairs[m]])
        del block, ours
        torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(rows)
    return rows


# What a series of rows (one model and format) records of the run that measured it
SERIES_KEYS = ("date", "torch", "triton", "moefuse", "passes")


def merge(base: dict[str, Any] | None, rows: list[dict[str, Any]], tags: dict[str, Any]
          ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The rows of a sweep that measured some models and formats, merged into ``base`` (a sweep :func:`load` read,
    or None): ``base``'s other series are kept, those measured again replaced. Returns the rows in grid order and the
    ``series`` record, each series' run (:data:`SERIES_KEYS` of its ``tags``). A base of another GPU (its ``gpu``)
    or of the other layer kind (``batch_invariant``) is not merged: its rows never mix with these."""
    def key(row: dict[str, Any]) -> str:
        return f"{row['model']} {row['format']}"

    run = {k: tags[k] for k in SERIES_KEYS if k in tags}
    measured = {key(row) for row in rows}
    series = {name: run for name in sorted(measured)}
    kept: list[dict[str, Any]] = []
    if base is not None and all(base.get(k) == tags.get(k) for k in ("gpu", "batch_invariant")):
        kept = [row for row in base["rows"] if key(row) not in measured]
        before = base.get("series") or {}
        for row in kept:  # a base written before series were recorded: its whole run
            series.setdefault(key(row), before.get(key(row)) or {k: base[k] for k in SERIES_KEYS if k in base})
    models = {m: i for i, m in enumerate(MODELS)}
    formats = {f: i for i, f in enumerate(FORMATS)}
    merged = sorted(kept + rows, key=lambda r: (models.get(r["model"], len(models)), r["model"],
                                                formats.get(r["format"], len(formats)), r["M"]))
    return merged, dict(sorted(series.items()))


def write(rows: list[dict[str, Any]], path: Path, environment: dict[str, Any]) -> None:
    """The sweep as JSON: the run's environment, the grid's rows, and the cliffs and transformers losses found."""
    data = {**environment, "tolerance": TOLERANCE, "rows": rows, "cliffs": cliffs(rows),
            "slower_than_transformers": slower_than_transformers(rows)}
    path.write_text(json.dumps(data, indent=1) + "\n")


def plot(data: dict[str, Any], path: Path) -> None:
    """Time and × floor against tokens, one column of panels per model, a line per format (and transformers')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    models = list(dict.fromkeys(row["model"] for row in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        ours = [row for row in rows if row["model"] == model]
        for fmt in dict.fromkeys(row["format"] for row in ours):
            points = sorted((row["M"], row["us"], row["x_floor"]) for row in ours if row["format"] == fmt)
            axes[0][col].plot([p[0] for p in points], [p[1] / 1e3 for p in points], label=fmt, marker=".")
            axes[1][col].plot([p[0] for p in points], [p[2] for p in points], label=fmt, marker=".")
        hf = sorted((row["M"], row["hf_us"]) for row in ours if isinstance(row.get("hf_us"), (int, float)))
        if hf:
            axes[0][col].plot([p[0] for p in hf], [p[1] / 1e3 for p in hf], label="transformers bf16", ls="--")
        for cliff in data.get("cliffs", []):
            if cliff["model"] == model:
                axes[0][col].axvline(cliff["M"], color="red", alpha=0.3)
        axes[0][col].set_title(model)
        axes[0][col].set_ylabel("ms")
        axes[1][col].set_ylabel("× floor")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens")
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=7)
    fig.suptitle(f"{TITLE}; {data.get('gpu', '')}, {data.get('date', '')}; red: cliffs (> {TOLERANCE:.0%})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
