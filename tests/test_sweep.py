"""The dense sweep (``moefuse bench sweep``): its cliff finder, and the committed GPU sweeps checked for cliffs.

A cliff is a token count whose layer time is more than 3% below the slowest smaller count of the same model and
format: a tile choice that made more tokens faster than fewer. Every committed sweep (``results/sweep_<gpu>.json``,
written by ``moefuse bench sweep`` on a GPU) must have none, and the layer must be no slower than transformers' own
block on the same weights at any swept size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moefuse.bench import sweep

RESULTS = Path(__file__).resolve().parent.parent / "results"
SWEEPS = sorted(RESULTS.glob("sweep_*.json"))


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


@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_committed_sweeps_have_no_cliffs(path):
    data = sweep.load(path)
    assert {"gpu", "date", "torch", "triton", "rows"} <= set(data)
    rows = data["rows"]
    models = {row["model"] for row in rows}
    assert models == set(sweep.MODELS), f"{path.name} sweeps {sorted(models)}"
    assert {row["M"] for row in rows} == set(sweep.GRID)
    found = sweep.cliffs(rows)
    assert not found, "cliffs: " + "; ".join(
        f"{c['model']} {c['format']} {c['slower_M']} -> {c['M']} tokens: {c['slower_us']:.0f} -> {c['us']:.0f} µs"
        for c in found)
    losses = sweep.slower_than_transformers(rows)
    assert not losses, "slower than transformers at " + ", ".join(f"{r['model']} {r['M']}" for r in losses)

