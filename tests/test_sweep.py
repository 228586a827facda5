"""The dense sweep (``moefuse bench sweep``): its cliff finder, and the committed GPU sweeps checked for cliffs.

A cliff is a token count whose layer time is more than 3% below the slowest smaller count of the same model and
format: a tile choice that made more tokens faster than fewer. Every committed sweep (``results/sweep_<gpu>.json``,
written by ``moefuse bench sweep`` on a GPU) must have no cliff but those ``KNOWN_CLIFFS`` lists with what was
measured about them, and the layer must be no slower than transformers' own block on the same weights at any size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moefuse.bench import sweep

RESULTS = Path(__file__).resolve().parent.parent / "results"
SWEEPS = sorted(RESULTS.glob("sweep_*.json"))
# The cliffs a committed sweep still has, each with what was measured about it (docs/PERF-NOTES.md, tile tables).
# The check is exact, so a sweep that adds a cliff fails and one that loses a cliff must say so here.
KNOWN_CLIFFS: dict[str, set[tuple[str, str, int]]] = {
    # None left (docs/PERF-NOTES.md, tile tables): the last ones went with the fp8 shared expert off short-tile slots,
    # DeepSeek-V3 MXFP4 retuned under the layer's routing, GLM-4.5-Air bf16's 5,632 bucket ungrouped and the router
    # linear on the tensor cores from 768 tokens.
    "sweep_h100": set(),
}


def _rows(times: dict[int, float], model: str = "m", fmt: str = "bf16") -> list[dict]:
    return [{"model": model, "format": fmt, "M": m, "us": us} for m, us in times.items()]


def test_cliffs_are_drops_below_the_slowest_smaller_size():
    rows = _rows({32: 100.0, 64: 110.0, 96: 104.0, 128: 112.0, 160: 106.0})
    found = sweep.cliffs(rows)
    # 96 is 5.8% under 64's 110; 160 is 5.7% under 128's 112; 128 itself is the new slowest, not a cliff
    assert [(c["M"], c["slower_M"]) for c in found] == [(96, 64), (160, 128)]
    assert found[0]["drop"] == pytest.approx(110 / 104 - 1)


def test_small_dips_and_other_series_do_not_count():
    rows = _rows({32: 100.0, 64: 102.9, 96: 100.0}) + _rows({32: 50.0, 64: 10.0}, fmt="fp8")
    found = sweep.cliffs(rows)
    assert [(c["format"], c["M"]) for c in found] == [("fp8", 64)]  # 2.9% is within the tolerance
    assert sweep.cliffs(_rows({1: 5.0, 2: 4.0}), tolerance=0.5) == []


def test_the_grid_is_dense():
    assert {32 * i for i in range(1, 33)} <= set(sweep.GRID)
    assert {1024 + 256 * i for i in range(1, 29)} <= set(sweep.GRID)
    assert sorted(sweep.GRID) == list(sweep.GRID) and max(sweep.GRID) == 8192


def test_summary_and_transformers_losses():
    rows = _rows({32: 100.0, 64: 90.0})
    for row, hf in zip(rows, (150.0, 80.0)):
        row.update(x_floor=1.5, hf_us=hf, from_hf_us=row["us"])
    (line,) = sweep.summary(rows)
    assert line["cliffs"] == 1 and line["worst_drop"] == pytest.approx(100 / 90 - 1)
    assert line["x_hf_min"] == pytest.approx(80 / 90)
    assert [row["M"] for row in sweep.slower_than_transformers(rows)] == [64]


def test_passes_alternate_direction_and_keep_every_time():
    calls: list[int] = []

    def time_at(m: int) -> float:
        calls.append(m)
        return float(m + len(calls))

    times = sweep.over_passes(time_at, [1, 2, 3], 3)
    assert calls == [1, 2, 3, 3, 2, 1, 1, 2, 3]  # a clock drift over a pass does not line up with the sizes
    assert times == {1: [2.0, 7.0, 8.0], 2: [4.0, 7.0, 10.0], 3: [6.0, 7.0, 12.0]}
    assert sweep.median([3.0, 1.0, 2.0]) == 2.0 and sweep.median([1.0, 4.0]) == 2.5  # what a size's row keeps
    with pytest.raises(ValueError, match="passes"):
        sweep.run(None, passes=0)


def test_a_partial_sweep_replaces_its_series_and_keeps_the_rest():
    """A sweep of some models and formats merges into the GPU's committed one: the series it measured are replaced,
    the others kept with the run that measured them (a base without a series record: its own tags), rows in grid
    order; a base of another GPU or of the invariant layer is never mixed in."""
    old = {"date": "d0", "gpu": "G", "torch": "t0", "batch_invariant": False, "passes": 1,
           "rows": _rows({32: 1.0, 64: 2.0}, "qwen3-30b-a3b", "fp8") + _rows({32: 3.0, 64: 4.0}, "kimi-k2", "bf16")}
    tags = {"date": "d1", "gpu": "G", "torch": "t1", "batch_invariant": False, "passes": 3, "python": "3"}
    new = _rows({64: 5.0, 32: 6.0}, "qwen3-30b-a3b", "fp8")
    rows, series = sweep.merge(old, new, tags)
    assert [(r["model"], r["M"], r["us"]) for r in rows] == [
        ("kimi-k2", 32, 3.0), ("kimi-k2", 64, 4.0), ("qwen3-30b-a3b", 32, 6.0), ("qwen3-30b-a3b", 64, 5.0)]
    assert series == {"kimi-k2 bf16": {"date": "d0", "torch": "t0", "passes": 1},
                      "qwen3-30b-a3b fp8": {"date": "d1", "torch": "t1", "passes": 3}}
    again, series = sweep.merge({**old, "rows": rows, "series": series}, _rows({32: 7.0}, "kimi-k2", "bf16"), tags)
    assert [r["us"] for r in again] == [7.0, 6.0, 5.0] and series["qwen3-30b-a3b fp8"]["passes"] == 3
    for other in ({**tags, "gpu": "H"}, {**tags, "batch_invariant": True}):
        assert sweep.merge(old, new, other)[0] == sorted(new, key=lambda r: r["M"])
    assert sweep.merge(None, new, tags)[1] == {"qwen3-30b-a3b fp8": {"date": "d1", "torch": "t1", "passes": 3}}


@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_committed_sweeps_have_no_cliffs(path):
    data = sweep.load(path)
    assert {"gpu", "date", "torch", "triton", "rows"} <= set(data)
    rows = data["rows"]
    assert set(data.get("series", {})) in ({f"{r['model']} {r['format']}" for r in rows}, set())
    models = {row["model"] for row in rows}
    if data.get("batch_invariant"):  # the invariant layer is swept on the presets of its cost table
        assert models and models <= set(sweep.MODELS), f"{path.name} sweeps {sorted(models)}"
    else:
        assert models == set(sweep.MODELS), f"{path.name} sweeps {sorted(models)}"
    assert {row["M"] for row in rows} == set(sweep.GRID)
    found = sweep.cliffs(rows)
    new = [c for c in found if (c["model"], c["format"], c["M"]) not in KNOWN_CLIFFS.get(path.stem, set())]
    assert not new, "cliffs: " + "; ".join(
        f"{c['model']} {c['format']} {c['slower_M']} -> {c['M']} tokens: {c['slower_us']:.0f} -> {c['us']:.0f} µs"
        for c in new)
    gone = KNOWN_CLIFFS.get(path.stem, set()) - {(c["model"], c["format"], c["M"]) for c in found}
    assert not gone, f"no longer cliffs in {path.name} (take them out of KNOWN_CLIFFS): {sorted(gone)}"
    losses = sweep.slower_than_transformers(rows)
    assert not losses, "slower than transformers at " + ", ".join(f"{r['model']} {r['M']}" for r in losses)

