"""The router linear (``router_logits``): the Triton decode kernel (interpreter on CPU) against float64 on fresh
random inputs of every float dtype and odd strides, NaN rows, empty shapes, the cuBLAS path past 16 tokens,
the custom op, and every error path."""

from __future__ import annotations

import pytest
import torch

from moefuse.route import linear, router_logits, router_logits_torch

TOL = 1e-5  # error of an fp32 dot product, relative to the sum of |x_k w_k| it adds up


def _judge(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    assert out.dtype == torch.float32 and out.shape == ref.shape
    err = ((out.double() - ref).abs() / scale.clamp_min(1e-30)).max().item() if out.numel() else 0.0
    assert err <= TOL, err


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
    torch.library.opcheck(torch.ops.moefuse.router_logits.default, (x, w, "triton", torch.empty(3, 10, device=device)),
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
