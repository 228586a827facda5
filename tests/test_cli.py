"""The command line: the README's main job on a small batch, every preset, and the GPU-only bench refusing a CPU."""

import pytest
import torch

from moefuse.cli import main
from moefuse.config import PRESETS


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_run_checks_the_layer(preset, capsys, full_size_gpu):
    assert main(["--preset", preset, "--tokens", "5", "--no-timing"]) == 0
    out = capsys.readouterr().out
    assert "layer vs float64 reference" in out and "NO" not in out


def test_run_times_every_stage(capsys):
    assert main(["run", "--tokens", "3", "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    for stage in ("router", "dispatch", "experts", "finalize + shared add", "shared expert"):
        assert stage in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_needs_a_gpu(capsys):
    assert main(["bench", "router"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_warmup_needs_a_gpu(capsys):
    assert main(["warmup", "--preset", "deepseek-v4-flash", "--quant", "mxfp4", "--max-tokens", "64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["warmup", "--quant", "int4"])


def test_run_fp8_layer(capsys, full_size_gpu):
    assert main(["--quant", "fp8", "--tokens", "4", "--no-timing"]) == 0
    out = capsys.readouterr().out
    assert "fp8 experts" in out and "NO" not in out


def test_bad_tokens_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--tokens", "-3"])
    assert exit_info.value.code == 2 and "--tokens" in capsys.readouterr().err


def test_run_w4a8_layer(capsys, monkeypatch):
    """``--activation-quant fp8`` with MXFP4 experts: W4A8 (the reference backend on the CPU), timed stage by stage
    and checked against its float64 reference. 8 experts and one token: the reference runs each stage 7 times."""
    from moefuse import cli

    monkeypatch.setattr(cli, "preset", lambda name: PRESETS[name].scaled(num_experts=8))
    args = ["--preset", "deepseek-v4-flash", "--quant", "mxfp4", "--activation-quant", "fp8", "--tokens", "1"]
    assert main([*args, "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "mxfp4 experts, fp8 activations" in out and "experts (GEMM1" in out and "NO" not in out


def test_activation_quant_without_kernels_is_refused(capsys):
    assert main(["--quant", "fp8", "--activation-quant", "none", "--tokens", "2", "--no-timing"]) == 2
    assert "activation_quant=None" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--activation-quant", "int8"])


def test_bench_sweep_of_some_series_keeps_the_others(tmp_path, monkeypatch, capsys):
    """``moefuse bench sweep --models ... --formats ...`` rewrites only those series of the GPU's sweep file (the GPU
    part stubbed: the timing, the ceilings, the plot), and the file says which run measured each series."""
    from moefuse.bench import sweep, timing

    env = {"date": "d", "gpu": "NVIDIA H100 80GB HBM3", "torch": "t", "triton": "tr", "python": "p"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "measure_ceilings", lambda: None)
    monkeypatch.setattr(timing, "environment", lambda: dict(env))
    monkeypatch.setattr(sweep, "plot", lambda data, path: None)

    def fake_run(ceilings, models, formats, passes, checkpoint, **kwargs):
        rows = [{"model": m, "format": f, "M": M, "us": float(M + passes), "floor_us": 1.0, "x_floor": 1.0}
                for m in models for f in formats for M in (32, 64)]
        checkpoint(rows[:2])
        return rows

    monkeypatch.setattr(sweep, "run", fake_run)
    args = ["bench", "sweep", "--results-dir", str(tmp_path), "--formats", "fp8"]
    assert main([*args, "--models", "kimi-k2", "qwen3-30b-a3b"]) == 0
    env["date"] = "e"
    assert main([*args, "--models", "qwen3-30b-a3b", "--passes", "3"]) == 0
    data = sweep.load(tmp_path / "sweep_h100.json")
    assert [(r["model"], r["us"]) for r in data["rows"]] == [
        ("kimi-k2", 33.0), ("kimi-k2", 65.0), ("qwen3-30b-a3b", 35.0), ("qwen3-30b-a3b", 67.0)]
    assert {name: (s["date"], s["passes"]) for name, s in data["series"].items()} == {
        "kimi-k2 fp8": ("d", 1), "qwen3-30b-a3b fp8": ("e", 3)}
    assert "other series kept from" in capsys.readouterr().err
    assert main([*args, "--models", "kimi-k2", "--quick"]) == 0  # apart from the dense sweep
    assert sweep.load(tmp_path / "sweep_h100.json") == data
    assert [r["model"] for r in sweep.load(tmp_path / "sweep_h100_quick.json")["rows"]] == ["kimi-k2"] * 2
