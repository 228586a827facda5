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
