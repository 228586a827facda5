"""What each GPU generation runs: the Hopper-only paths refuse or fall back elsewhere, decided from the device's facts.

The choices read a :class:`moefuse._runtime.GPU` (name, compute capability, SM count, shared memory), so they are
tested here on the CPU with other GPUs' properties: an A100 (sm_80), an L40S (sm_89), an H100 PCIe (sm_90 with 114
SMs: no tuned table), a B200 (sm_100). The README's support matrix states the same.
"""

from __future__ import annotations

import pytest
import torch

from moefuse import _runtime
from moefuse.experts import persistent, plan_block_m
from moefuse.experts.fp8 import mlp as fp8_mlp
from moefuse.experts.op import check_gpu
from moefuse.formats import MXFP4, BlockFP8

H100 = _runtime.GPU("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448)
H100_PCIE = _runtime.GPU("NVIDIA H100 PCIe", (9, 0), 114, 232448)
A100 = _runtime.GPU("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912)
L40S = _runtime.GPU("NVIDIA L40S", (8, 9), 142, 101376)
B200 = _runtime.GPU("NVIDIA B200", (10, 0), 148, 232448)
CUDA = torch.device("cuda", 0)  # never touched: the facts come from the patched _runtime.gpu


@pytest.fixture
def on_gpu(monkeypatch):
    """Make ``_runtime.gpu`` answer with the given GPU, as a device of that kind would, without a GPU here."""
    def use(gpu: _runtime.GPU) -> None:
        monkeypatch.setattr(_runtime, "gpu", lambda device: gpu)
        monkeypatch.setattr(_runtime, "interpreting", lambda: False)
    return use


def _fp8(E=4, N=256, K=256) -> BlockFP8:
    return BlockFP8.quantize(torch.randn(E, N, K))


@pytest.mark.parametrize("gpu, fp8_ok", [(H100, True), (H100_PCIE, True), (L40S, True), (B200, True), (A100, False)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_fp8_activations_need_fp8_tensor_cores(gpu, fp8_ok):
    """fp8 block-scale experts (W8A8) and MXFP4 W4A8 are refused, naming the argument, below sm_89; MXFP4 W4A16 and
    16-bit experts run everywhere."""
    mxfp4 = MXFP4.quantize(torch.randn(4, 256, 256))
    for weight, quant in ((_fp8(), "fp8"), (mxfp4, "fp8")):
        if fp8_ok:
            check_gpu(weight, quant, gpu)
        else:
            with pytest.raises(ValueError, match="gate_up_proj.*fp8 tensor cores"):
                check_gpu(weight, quant, gpu)
    check_gpu(mxfp4, None, gpu)
    check_gpu(torch.randn(4, 256, 256), None, gpu)


@pytest.mark.parametrize("gpu", [A100, L40S, B200], ids=lambda g: g.name)
def test_hopper_kernels_fall_back_elsewhere(gpu, on_gpu):
    """The persistent Gluon GEMMs (fp8 prefill plans of 128 rows) and cuBLAS's block-scaled fp8 shared expert are
    sm_90 only: elsewhere the plans stay the tl kernels' and the shared expert the grouped GEMMs'."""
    weight = _fp8(8, 2 * 256, 512)
    for tokens in (1, 2048, 8192):
        assert plan_block_m(tokens, weight, 2, torch.bfloat16, arch=gpu) != persistent.BLOCK_M
        assert not persistent.runs_fp8(512, 256, gpu)
    on_gpu(gpu)
    assert not fp8_mlp.takes(8192, 7168, 2048, torch.bfloat16, CUDA)


def test_hopper_takes_them(on_gpu):
    """The same on an H100 (no table for this shape: the heuristic's 2,048-token rule), so the test above can fail."""
    weight = _fp8(8, 2 * 256, 512)
    assert plan_block_m(8192, weight, 2, torch.bfloat16, arch=H100) == persistent.BLOCK_M
    assert plan_block_m(8192, weight, 2, torch.bfloat16, arch=H100, persistent="none") != persistent.BLOCK_M
    on_gpu(H100)
    assert fp8_mlp.takes(8192, 7168, 2048, torch.bfloat16, CUDA) == fp8_mlp.CUBLAS_BLOCK_SCALING


def test_the_gpu_facts_are_read_from_the_device(monkeypatch):
    """``_runtime.gpu`` builds its facts from ``torch.cuda.get_device_properties`` (read once per device)."""
    class Props:
        name, major, minor, multi_processor_count, shared_memory_per_block_optin = "NVIDIA L40S", 8, 9, 142, 101376

    _runtime._gpu.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    try:
        assert _runtime.gpu(CUDA) == L40S
        assert _runtime.sm_count(CUDA) == 142 and _runtime.capability(CUDA) == (8, 9)
    finally:
        _runtime._gpu.cache_clear()


def test_the_h100_table_moves_fp8_to_the_persistent_kernels_where_it_measured_them_faster():
    """DeepSeek-V3's fp8 experts on an H100 SXM follow its table (16-row tiles to 384 tokens, 64 at 416, the persistent
    kernels' 128-row plans from 512), which ``persistent="none"`` overrides; an H200 (no fp8 entries) keeps the
    heuristic's rule (64-row plans, 128 from 2,048 tokens)."""
    E, H, I, K = 256, 7168, 2048, 8
    values = torch.empty(1, 1, 1, dtype=torch.float8_e4m3fn).expand(E, 2 * I, H)  # only the shape is read
    weight = BlockFP8.unchecked(values, torch.empty(1, 1, 1).expand(E, 2 * I // 128, H // 128))
    h200 = _runtime.GPU("NVIDIA H200", (9, 0), 132, 232448)
    assert [plan_block_m(M, weight, K, torch.bfloat16, arch=H100) for M in (1, 384, 416, 512, 4096)] == [
        16, 16, 64, 128, 128]
    assert plan_block_m(1024, weight, K, torch.bfloat16, arch=H100, persistent="none") == 64
    assert [plan_block_m(M, weight, K, torch.bfloat16, arch=h200) for M in (448, 1024, 2048)] == [16, 64, 128]
