"""The router linear (``router_logits``): the Triton decode kernel and the tensor-core prefill kernel (interpreter
on CPU) against float64 on fresh random inputs of every float dtype and odd strides, NaN rows, empty shapes, the
cuBLAS path between them, the custom op, and every error path."""

from __future__ import annotations

import pytest
import torch
from tolerances import ROUTER_TOL, router_error

from moefuse.route import linear, router_logits, router_logits_torch


def _judge(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == (x.shape[0], w.shape[0])
    err = router_error(out, x, w)
    assert err <= ROUTER_TOL, err


@pytest.mark.parametrize("M, E, H", [(1, 37, 1000), (5, 64, 333), (16, 9, 2048), (3, 384, 96), (2, 5, 17)])
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                              (torch.float32, torch.float32)])
def test_kernel_matches_float64(M, E, H, x_dtype, w_dtype, gen, device):
    x = torch.randn(M, H, generator=gen).to(x_dtype).to(device)
    w = (torch.randn(E, H, generator=gen) * 0.02).to(w_dtype).to(device)
    _judge(router_logits(x, w, backend="triton"), x, w)


def test_strided_inputs_and_preallocated_out(gen, device):
    """Views with row and column strides are read as they are; ``out`` is written and returned."""
    x = torch.randn(6, 2 * 300, generator=gen).bfloat16().to(device)[:, ::2]
    w = torch.randn(300, 40, generator=gen).to(device).t()  # [40, 300], column-major
    out = torch.full((6, 40), float("nan"), device=device)
    assert router_logits(x, w, out=out, backend="triton") is out
    _judge(out, x, w)


def test_past_the_decode_kernel_the_cublas_path(gen, device):
    """More than MAX_TOKENS rows take cuBLAS's fp32 GEMM on the triton backend: the same function."""
    M = linear.MAX_TOKENS + 1
    x = torch.randn(M, 128, generator=gen).bfloat16().to(device)
    w = torch.randn(24, 128, generator=gen).to(device)
    _judge(router_logits(x, w, backend="triton"), x, w)
    torch.testing.assert_close(router_logits(x, w, backend="reference"), router_logits_torch(x, w), rtol=0, atol=0)


def test_bf16_split_is_exact(gen, device):
    """The prefill kernel's three bf16 parts of an fp32 weight add up to it exactly, from 2^-100 to 2^100 (a weight
    under about 2^-110 would leave a subnormal part), signed zeros; inf stays inf and NaN stays NaN."""
    w = torch.randn(37, 300, generator=gen) * torch.exp2(torch.randint(-40, 40, (37, 300), generator=gen).float())
    w[0, :4] = torch.tensor([2.0**-100 * 1.2345, -(2.0**100) * 1.7, -0.0, 0.0])
    w[1, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    parts = linear.bf16_split(w.to(device)).double().cpu()
    total = parts[0] + parts[1] + parts[2]
    finite = w.isfinite()
    assert torch.equal(total[finite], w.double()[finite])
    assert total[1, 0] == float("inf") and total[1, 1] == float("-inf") and total[1, 2].isnan()
    assert (parts[2] != 0).float().mean() > 0.9, "the lo part must carry the last bits"


@pytest.mark.parametrize("M, E, H", [(70, 37, 333), (64, 130, 128), (1, 9, 17)])
def test_tensor_core_kernel_matches_float64(M, E, H, gen, device):
    """The prefill kernel (called directly at any M; ``router_logits`` takes it from MMA_MIN_TOKENS rows): ragged
    rows, experts and H against its tiles, a strided x, a NaN row. Its error bound is the fp32 path's."""
    x = torch.randn(M, 2 * H, generator=gen).bfloat16().to(device)[:, ::2]
    x[M // 2, 3] = float("nan")
    w = (torch.randn(E, H, generator=gen) * 0.02).to(device)
    out = torch.full((M, E), 7.0, device=device)
    linear.router_logits_mma(x, w, out)
    rows = torch.arange(M, device=device) != M // 2
    _judge(out[rows], x[rows], w)
    assert out[M // 2].isnan().all()


def test_prefill_batches_take_the_tensor_core_kernel(gen, device, monkeypatch):
    """From MMA_MIN_TOKENS rows of bf16 x and an fp32 weight (the checkpoints' router), the triton backend runs the
    tensor-core kernel; fp16 x or a bf16 weight keep cuBLAS's fp32 GEMM (the split needs bf16 x and an fp32
    weight); the reference never does."""
    M = linear.MMA_MIN_TOKENS
    calls = []
    mma = linear.router_logits_mma
    monkeypatch.setattr(linear, "router_logits_mma", lambda *args: calls.append(1) or mma(*args))
    x = torch.randn(M, 40, generator=gen).bfloat16().to(device)
    w = (torch.randn(24, 40, generator=gen) * 0.02).to(device)
    _judge(router_logits(x, w, backend="triton"), x, w)
    assert calls == [1]
    _judge(router_logits(x, w.bfloat16(), backend="triton"), x, w.bfloat16())
    _judge(router_logits(x.half(), w, backend="triton"), x.half(), w)
    _judge(router_logits(x[:-1], w, backend="triton"), x[:-1], w)
    router_logits(x, w, backend="reference")
    assert calls == [1]


def test_tensor_core_launch_follows_the_measured_costs():
    """The largest tile unless it takes more waves (H200 timings, docs/PERF-NOTES.md): 64 x 64 at 1,024 tokens,
    64 x 128 at 4,096 tokens of 256 experts (128 programs, one wave), 128 x 128 for 384 experts and at 8,192."""
    def tile(M, E):
        return linear.mma_launch(M, E, 132)[:2]
    assert tile(1024, 256) == (64, 64) and tile(1024, 384) == (64, 64)
    assert tile(4096, 256) == (64, 128)
    assert tile(4096, 384) == (128, 128) and tile(8192, 256) == (128, 128)


def test_nan_row_stays_in_its_row(gen, device):
    x = torch.randn(3, 64, generator=gen).to(device)
    x[1, 7] = float("nan")
    out = router_logits(x, torch.randn(8, 64, generator=gen).to(device), backend="triton")
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


@pytest.mark.parametrize("M, E, H", [(0, 8, 16), (4, 0, 16), (4, 8, 0)])
def test_empty_shapes(M, E, H, device):
    out = router_logits(torch.randn(M, H, device=device), torch.randn(E, H, device=device), backend="triton")
    assert out.shape == (M, E) and (out == 0).all()


def test_custom_op_opcheck(gen, device):
    x = torch.randn(3, 48, generator=gen).bfloat16().to(device)
    w = torch.randn(10, 48, generator=gen).to(device)
    for invariant in (False, True):
        torch.library.opcheck(torch.ops.moefuse.router_logits.default,
                              (x, w, "triton", invariant, None, torch.empty(3, 10, device=device)),
                              test_utils=("test_schema", "test_faketensor"))


ERRORS = {
    "x-not-tensor": (dict(x=[[1.0]]), TypeError, "x must be"),
    "x-int": (dict(x=torch.ones(2, 8, dtype=torch.int32)), TypeError, "x must"),
    "x-1d": (dict(x=torch.ones(8)), ValueError, "x must be 2-D"),
    "weight-int": (dict(weight=torch.ones(4, 8, dtype=torch.int64)), TypeError, "weight"),
    "weight-wrong-H": (dict(weight=torch.ones(4, 9)), ValueError, "weight must be [E, 8]"),
    "out-dtype": (dict(out=torch.empty(2, 4, dtype=torch.bfloat16)), TypeError, "out"),
    "out-shape": (dict(out=torch.empty(2, 5)), ValueError, "out"),
    "backend": (dict(backend="cuda"), ValueError, "backend"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_name_the_argument(name, device):
    changes, exc, text = ERRORS[name]
    call = {"x": torch.ones(2, 8), "weight": torch.ones(4, 8), "backend": "triton", **changes}
    call = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    with pytest.raises(exc) as info:
        router_logits(call.pop("x"), call.pop("weight"), **call)
    assert text in str(info.value), str(info.value)
