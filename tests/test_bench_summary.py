"""The summary figure of ``moefuse bench`` (``results/summary.png``), from the committed GPU results (no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moefuse.bench import run

RESULTS = Path(__file__).resolve().parent.parent / "results"


def _records() -> dict:
    return {s: json.loads((RESULTS / f"{s}.json").read_text()) for s in run.STAGES if (RESULTS / f"{s}.json").exists()}


def test_summary_series_from_committed_results():
    """Every line of SUMMARY finds its rows, the ratios are the ones the tables print, and a change of MMA precision
    along a line (MXFP4's W4A8 point in the committed quant run) is noted."""
    records = _records()
    series = {(s["panel"], s["label"]): s for s in run.summary_series(records)}
    # every line whose stage has a committed results file finds its rows (a stage never run yet has no file)
    assert {s["spec"]["label"] for s in series.values()} == {spec["label"] for spec in run.SUMMARY
                                                             if spec["stage"] in records}
    layer = dict(series[("floor", "layer, bf16")]["points"])
    row = next(r for r in records["layer"]["rows"] if r["model"] == "deepseek-v3" and r["M"] == 4096)
    floor = max(row["mem_floor_us"], row["compute_floor_us"])  # the line's floor: the larger, measured in that run
    assert layer[4096] == pytest.approx(row["us"] / floor, rel=1e-9)
    router = dict(series[("peer", "router (gate) vs best public Triton router")]["points"])
    assert all(v < 1 for v in router.values())  # faster than the best public router everywhere
    stage = "dispatch + experts + finalize, bf16 vs "
    cublas = dict(series[("peer", stage + "cuBLAS dense equivalent, same run")]["points"])
    grouped = dict(series[("peer", stage + "torch._grouped_mm on the same routing, same run")]["points"])
    table = next(r for r in records["prefill"]["rows"] if r["stage"] == "prefill, uniform routing" and r["M"] == 4096)
    assert cublas[4096] == pytest.approx(table["x_cublas"], rel=1e-9)  # as results/prefill.json prints it
    assert grouped[4096] == pytest.approx(table["x_grouped"], rel=1e-9)
    assert [n[2] for n in series[("floor", "routed experts, MXFP4 (V4-Flash)")]["notes"]] in ([], ["W4A8"])
    for s in series.values():
        assert [x for x, _ in s["points"]] == sorted(x for x, _ in s["points"])


def test_summary_plot_writes_png(tmp_path):
    assert run.summary_plot({}, tmp_path / "none.png") is False and not (tmp_path / "none.png").exists()
    pytest.importorskip("matplotlib")
    assert run.summary_plot(_records(), tmp_path / "summary.png")
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fp8_peer_is_the_anchors_better_config():
    """``bench.quant.peer_from_anchor``: the anchor's better vLLM config at that token count, unscaled, with the
    anchor's date; nothing where the anchor has no row, nor on a GPU model other than the anchors' (an H100's
    times beside the H200's would read as a loss no kernel made)."""
    from moefuse.bench import quant, report

    rows = report.anchors("NVIDIA H200")["fp8_block_scale_experts_vllm_triton"]["rows"]
    assert rows
    for row in rows:
        us, measured = quant.peer_from_anchor(row["tokens"], "NVIDIA H200")
        assert us == min(row["default_config_us"], row["tuned_config_us"]) and measured == "2026-12-03"
        assert quant.peer_from_anchor(row["tokens"], "NVIDIA H100 80GB HBM3") is None
    assert quant.peer_from_anchor(3, "NVIDIA H200") is None
    other = report.anchors("NVIDIA H100 80GB HBM3")
    assert all(not table["rows"] for name, table in other.items()
               if isinstance(table, dict) and "rows" in table and name != "mxfp4_experts_triton_kernels")
    assert other["mxfp4_experts_triton_kernels"]["rows"]
    assert not report.anchors("NVIDIA H100 PCIe")["mxfp4_experts_triton_kernels"]["rows"]  # another H100 model


def test_mxfp4_peer_is_triton_kernels_scaled_by_read_rate():
    """``bench.quant.mxfp4_peer_from_anchor``: triton_kernels' best time from the H100 anchor, scaled by the anchor
    run's read rate over this run's (a machine reading 10% faster expects the peer 10% faster), named with the
    scale; nothing on the H200 (no triton_kernels anchor there) or at a token count the anchor lacks."""
    from moefuse.bench import quant, report

    gpu = "NVIDIA H100 80GB HBM3"
    anchor = report.anchors(gpu)["mxfp4_experts_triton_kernels"]
    for row in anchor["rows"]:
        us, name = quant.mxfp4_peer_from_anchor(row["tokens"], gpu, anchor["read_TBps"] * 1.1)
        assert us == pytest.approx(row["best_us"] / 1.1) and row["best_us"] <= min(row["nw4_us"], row["nw8_us"])
        assert name.startswith("triton_kernels 2026-12-05") and "x0.909" in name
    assert [r["tokens"] for r in anchor["rows"]] == [1, 16, 128, 1024, 4096]
    assert quant.mxfp4_peer_from_anchor(3, gpu, 3.0) is None
    assert quant.mxfp4_peer_from_anchor(1, "NVIDIA H200", 4.5) is None


def test_peer_ratio_takes_our_time_on_the_peers_scope():
    """A line whose peer measured a wider scope (the fp8 peer: dispatch and combine too) compares ``ours_vs_peer``,
    and draws no peer point where that time is missing (results from before it was measured)."""
    spec = next(s for s in run.SUMMARY if s.get("ours_vs_peer"))
    row = {spec["us"]: 100.0, spec["ours_vs_peer"]: 110.0, spec["peer"]: 105.0}
    assert run._peer_ratio(spec, row) == pytest.approx(110.0 / 105.0)
    assert run._peer_ratio(spec, {spec["us"]: 100.0, spec["peer"]: 105.0}) is None
