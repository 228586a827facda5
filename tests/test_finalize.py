"""Finalize stage (SPEC §2): the Triton kernel and the public op against the float64 reference.

Two bars, both on fresh random inputs:

- Against the float32 reference in the output dtype: bit-for-bit under the interpreter (the same fp32
  multiplies and adds in the same order, each rounded the same way, so there is nothing to differ). On a GPU
  the compiler contracts ``acc + w * x`` into one FMA (one rounding where the reference has two); where terms
  cancel to almost 0 that moves the result by many (tiny) ulps, so there the float64 bar alone judges.
- Against float64: within one output ulp of the largest value, plus the fp32 accumulation bound (which only
  matters for fp32 outputs).

Inputs are built so that reading anything the contract says to skip shows up as NaN: padding rows, padding
columns beyond H, and the weights of absent (-1) slots are NaN.
"""

from __future__ import annotations

import pytest
import torch

from moefuse import _runtime
from moefuse.finalize import kernel as finalize_kernel
from moefuse.finalize import moe_finalize_fuse_shared, moe_finalize_fuse_shared_torch
from moefuse.testing import assert_rel_close, max_ulp_distance

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
TOP_KS = (1, 2, 6, 8, 16)


def make_inputs(
    gen: torch.Generator,
    device: torch.device,
    *,
    num_tokens: int = 4,
    top_k: int = 8,
    hidden: int = 300,
    pad_cols: int = 20,
    pad_rows: int = 5,
    dtype: torch.dtype = torch.bfloat16,
    weight_dtype: torch.dtype = torch.float32,
    shared: bool = True,
    absent: float = 0.25,
) -> dict:
    """Arguments of the op: rows of gemm2_out in random order, a fraction ``absent`` of slots -1, token 0 (when
    there are two or more tokens) with every slot -1; NaN in padding rows, padding columns and absent weights."""
    num_rows = num_tokens * top_k + pad_rows
    padded_h = hidden + pad_cols
    gemm2_out = torch.full((num_rows, padded_h), float("nan"), dtype=dtype)
    rows = torch.randperm(num_rows, generator=gen)[: num_tokens * top_k].int()
    gemm2_out[rows.long(), :hidden] = torch.randn(rows.numel(), hidden, generator=gen).to(dtype)
    missing = torch.rand(num_tokens, top_k, generator=gen) < absent
    if num_tokens >= 2:
        missing[0] = True
    rows = torch.where(missing.flatten(), torch.tensor(-1, dtype=torch.int32), rows)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(weight_dtype)
    weights[missing] = float("nan")
    shared_output = torch.randn(num_tokens, hidden, generator=gen).to(dtype) if shared else None
    if not shared:
        gemm2_out = gemm2_out[:, :hidden].contiguous()  # without a shared output H = Hp: no padding columns
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return {
        "gemm2_out": to(gemm2_out),
        "expanded_idx_to_permuted_idx": to(rows),
        "expert_weights": to(weights),
        "shared_output": to(shared_output),
        "top_k": top_k,
    }


def oracle(inputs: dict) -> torch.Tensor:
    """The float64 reference, unrounded (a float64 ``out``)."""
    weights = inputs["expert_weights"]
    hidden = inputs["shared_output"].shape[1] if inputs["shared_output"] is not None else inputs["gemm2_out"].shape[1]
    exact = torch.empty(weights.shape[0], hidden, dtype=torch.float64, device=weights.device)
    return moe_finalize_fuse_shared_torch(**inputs, out=exact, dtype=torch.float64)


def abs_sum(inputs: dict) -> torch.Tensor:
    """``sum_k |w x| + |shared|`` per element, in float64: the scale of fp32 accumulation error."""
    absolute = dict(inputs)
    absolute["gemm2_out"] = inputs["gemm2_out"].abs()
    absolute["expert_weights"] = inputs["expert_weights"].abs()
    if inputs["shared_output"] is not None:
        absolute["shared_output"] = inputs["shared_output"].abs()
    return oracle(absolute)


def check_result(out: torch.Tensor, inputs: dict) -> None:
    """Both bars of the module docstring."""
    gemm2_out = inputs["gemm2_out"]
    assert out.dtype == gemm2_out.dtype and out.device == gemm2_out.device
    if _runtime.interpreting():
        ref32 = moe_finalize_fuse_shared_torch(**inputs)
        assert max_ulp_distance(out, ref32) == 0, "kernel differs from the float32 reference"
    exact = oracle(inputs)
    finite_max = lambda t: t[t.isfinite()].abs().max().item() if bool(t.isfinite().any()) else 0.0  # noqa: E731
    accumulation = (inputs["top_k"] + 1) * 2.0**-24 * finite_max(abs_sum(inputs)) / max(finite_max(exact), 1e-30)
    assert_rel_close(out, exact, torch.finfo(out.dtype).eps + accumulation, "vs float64")


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no-shared"])
@pytest.mark.parametrize("top_k", TOP_KS)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES, ids=lambda d: f"w-{str(d)[6:]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_kernel_matches_reference(gen, device, dtype, weight_dtype, top_k, shared):
    inputs = make_inputs(gen, device, dtype=dtype, weight_dtype=weight_dtype, top_k=top_k, shared=shared)
    check_result(moe_finalize_fuse_shared(**inputs, backend="triton"), inputs)


def test_random_shapes(gen, device):
    # Shapes drawn fresh each run (M = 0 included), so odd widths and token counts get exercised over time.
    for _ in range(8):
        draw = lambda n: int(torch.randint(n, (1,), generator=gen))  # noqa: E731
        inputs = make_inputs(
            gen,
            device,
            num_tokens=draw(7),
            top_k=1 + draw(10),
            hidden=1 + draw(400),
            pad_cols=draw(3) * 8,
            pad_rows=draw(4),
            dtype=DTYPES[draw(3)],
            weight_dtype=WEIGHT_DTYPES[draw(2)],
            shared=bool(draw(2)),
            absent=0.4 * draw(2),
        )
        check_result(moe_finalize_fuse_shared(**inputs, backend="triton"), inputs)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_reference_backend_is_the_reference(gen, device, dtype):
    # The op's reference path is the float32 reference itself, bit for bit.
    inputs = make_inputs(gen, device, dtype=dtype, num_tokens=16)
    out = moe_finalize_fuse_shared(**inputs, backend="reference")
    assert torch.equal(out.isnan(), torch.zeros_like(out, dtype=torch.bool))
    assert torch.equal(out, moe_finalize_fuse_shared_torch(**inputs))


EDGE_CASES = {
    # A decode step of one token: the smallest grid.
    "one-token": dict(num_tokens=1),
    # Every slot of every token absent (all experts on other ranks): the output is the shared output.
    "all-absent": dict(absent=1.1),
    # No slot absent and no padding: the common dense case.
    "none-absent": dict(absent=0.0, pad_rows=0),
    # Exactly one warp of columns: the tile boundary itself.
    "tile-boundary": dict(hidden=256, pad_cols=0),
    # H smaller than one vector of columns, and H not a multiple of anything.
    "tiny-hidden": dict(hidden=3, pad_cols=1),
    # Columns spanning several one-warp tiles with a ragged last one.
    "ragged-columns": dict(num_tokens=3, hidden=700, top_k=2),
}


@pytest.mark.parametrize("case", EDGE_CASES.values(), ids=EDGE_CASES.keys())
def test_edge_cases(gen, device, case):
    inputs = make_inputs(gen, device, **case)
    out = moe_finalize_fuse_shared(**inputs, backend="triton")
    check_result(out, inputs)
    if case.get("absent", 0) > 1:
        assert torch.equal(out, inputs["shared_output"])


def test_no_rows_at_all(device):
    # gemm2_out with zero rows (no token routed to a local expert): every slot must be -1; out = shared.
    shared_output = torch.randn(3, 8, device=device).bfloat16()
    out = moe_finalize_fuse_shared(
        torch.empty(0, 8, dtype=torch.bfloat16, device=device),
        torch.full((6,), -1, dtype=torch.int32, device=device),
        torch.rand(3, 2, device=device),
        shared_output,
        2,
        backend="triton",
    )
    assert torch.equal(out, shared_output)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_zero_tokens_launches_nothing(device, backend, monkeypatch):
    # M = 0 (an empty batch) returns an empty [0, H] tensor without touching the kernel.
    monkeypatch.setattr(finalize_kernel, "_finalize_kernel", None)  # any launch would raise TypeError
    out = moe_finalize_fuse_shared(
        torch.randn(4, 16, device=device),
        torch.empty(0, dtype=torch.int32, device=device),
        torch.empty(0, 8, device=device),
        torch.empty(0, 12, device=device),
        8,
        backend=backend,
    )
    assert out.shape == (0, 12) and out.dtype == torch.float32


def test_nan_and_inf_in_present_rows_propagate(gen, device):
    # A NaN or inf in a row that is used must reach the output, exactly where the reference puts it.
    inputs = make_inputs(gen, device, num_tokens=2, top_k=2, absent=0.0, pad_rows=0, hidden=8, pad_cols=0)
    row = int(inputs["expanded_idx_to_permuted_idx"][2])
    inputs["gemm2_out"][row, 1] = float("nan")
    inputs["gemm2_out"][row, 2] = float("inf")
    out = moe_finalize_fuse_shared(**inputs, backend="triton")
    assert out[1, 1].isnan() and out[1, 2].isinf()
    check_result(out, inputs)


def test_preallocated_out_and_in_place_into_shared(gen, device):
    inputs = make_inputs(gen, device, num_tokens=3, top_k=6)
    expected = moe_finalize_fuse_shared(**inputs, backend="triton")
    out = torch.empty_like(expected)
    assert moe_finalize_fuse_shared(**inputs, out=out, backend="triton") is out
    assert torch.equal(out, expected)
    # out may be the shared output itself: each element is read before the same program overwrites it.
    shared_output = inputs["shared_output"]
    assert moe_finalize_fuse_shared(**inputs, out=shared_output, backend="triton") is shared_output
    assert torch.equal(shared_output, expected)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_strided_views_need_no_copy(gen, device, backend):
    # Every tensor is a view with unusual strides: the kernel takes all strides, results are bit-identical.
    inputs = make_inputs(gen, device, num_tokens=3, top_k=6)
    expected = moe_finalize_fuse_shared(**inputs, backend=backend)
    gemm2_out, idx, weights, shared_output = (
        inputs[k] for k in ("gemm2_out", "expanded_idx_to_permuted_idx", "expert_weights", "shared_output")
    )
    wide = torch.zeros(gemm2_out.shape[0], gemm2_out.shape[1] + 7, dtype=gemm2_out.dtype, device=device)
    wide[:, 3 : 3 + gemm2_out.shape[1]] = gemm2_out
    views = {
        "gemm2_out": wide[:, 3 : 3 + gemm2_out.shape[1]],  # row stride larger than the row
        "expanded_idx_to_permuted_idx": torch.stack([idx, -idx]).t().flatten()[::2],  # stride 2
        "expert_weights": weights.t().contiguous().t(),  # column-major
        "shared_output": shared_output.t().contiguous().t(),  # column-major: column stride != 1
    }
    assert not any(v.is_contiguous() for v in views.values())
    out_buffer = torch.empty(shared_output.shape[0], shared_output.shape[1] + 5, dtype=gemm2_out.dtype, device=device)
    out = moe_finalize_fuse_shared(**{**inputs, **views}, out=out_buffer[:, 5:], backend=backend)
    assert torch.equal(out, expected)
    transposed = gemm2_out.t().contiguous().t()  # column-major gemm2_out: column stride != 1
    assert torch.equal(moe_finalize_fuse_shared(**{**inputs, "gemm2_out": transposed}, backend=backend), expected)


def test_kernel_masks_out_of_range_rows(gen, device):
    # Where checking is off (CUDA without MOEFUSE_CHECK, graph capture, torch.compile) bad rows reach the
    # kernel: it must treat them as absent, never read them. Call the launcher directly to bypass the check.
    inputs = make_inputs(gen, device, num_tokens=4, top_k=2, absent=0.0)
    num_rows = inputs["gemm2_out"].shape[0]
    idx = inputs["expanded_idx_to_permuted_idx"].clone()
    idx[[1, 2, 5]] = torch.tensor([num_rows, -7, 1 << 30], dtype=torch.int32, device=device)
    inputs = {**inputs, "expanded_idx_to_permuted_idx": idx}
    out = torch.empty_like(inputs["shared_output"])
    finalize_kernel.finalize_triton(*inputs.values(), out=out, use_pdl=False)
    absent = idx.clone()
    absent[[1, 2, 5]] = -1
    check_result(out, {**inputs, "expanded_idx_to_permuted_idx": absent})


def test_pdl_request_is_ignored_where_unsupported(gen, device):
    # enable_pdl=True on a CPU tensor (or a GPU without PDL) must not change the result or fail.
    inputs = make_inputs(gen, device, num_tokens=2, top_k=2)
    assert torch.equal(
        moe_finalize_fuse_shared(**inputs, enable_pdl=True, backend="triton"),
        moe_finalize_fuse_shared(**inputs, enable_pdl=False, backend="triton"),
    )


def test_ulp_distance_helper():
    # The helper the bars above rest on: adjacent floats are 1 apart, also across zero and across a binade.
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    after_one = torch.tensor([0x3F81], dtype=torch.int16).view(torch.bfloat16)
    smallest = torch.tensor([1], dtype=torch.int16).view(torch.bfloat16)
    below_two = torch.tensor([0x3FFF], dtype=torch.int16).view(torch.bfloat16)
    assert max_ulp_distance(one, after_one) == 1
    assert max_ulp_distance(smallest, -smallest) == 2
    assert max_ulp_distance(torch.tensor([-0.0]), torch.tensor([0.0])) == 0
    assert max_ulp_distance(below_two, 2 * one) == 1
    assert max_ulp_distance(torch.tensor([float("nan")]), torch.tensor([1.0])) > 1


def test_tile_choice():
    # 1024-column tiles at 16 bytes per thread, at every M (the measured best on an H200; see kernel.py).
    for num_tokens in (1, 16, 128, 1024, 4096, 16384):
        for hidden in (2048, 4096, 7168):
            assert finalize_kernel.finalize_tile(num_tokens, hidden, torch.bfloat16) == (1024, 4)
            assert finalize_kernel.finalize_tile(num_tokens, hidden, torch.float16) == (1024, 4)
            assert finalize_kernel.finalize_tile(num_tokens, hidden, torch.float32) == (1024, 8)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_traces_into_one_graph(gen, device, backend):
    # The public wrapper (validation, allocation, custom op) must trace under torch.compile(fullgraph=True):
    # the index-range check is skipped while compiling instead of breaking the graph.
    inputs = make_inputs(gen, device, num_tokens=2, top_k=2, hidden=16, pad_cols=4)
    call = lambda **kw: moe_finalize_fuse_shared(**kw, backend=backend)  # noqa: E731
    compiled = torch.compile(call, fullgraph=True, backend="eager")
    assert torch.equal(compiled(**inputs), moe_finalize_fuse_shared(**inputs, backend=backend))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_custom_op_registration(gen, device, backend):
    # Schema, fake (meta) implementation and mutation annotation agree: what torch.compile and CUDA graphs rely on.
    inputs = make_inputs(gen, device, num_tokens=2, top_k=2, hidden=16, pad_cols=4)
    out = torch.empty_like(inputs["shared_output"])
    torch.library.opcheck(torch.ops.moefuse.finalize_fuse_shared, (*inputs.values(), False, backend, out))


def _bad(**changes):
    return changes


ERRORS = {
    # Wrong types and dtypes: TypeError naming the argument.
    "gemm2_out-not-tensor": (_bad(gemm2_out=[[1.0]]), TypeError, "gemm2_out"),
    "gemm2_out-int": (_bad(gemm2_out=lambda i: i["gemm2_out"].int()), TypeError, "gemm2_out"),
    "idx-int64": (
        _bad(expanded_idx_to_permuted_idx=lambda i: i["expanded_idx_to_permuted_idx"].long()),
        TypeError,
        "expanded_idx_to_permuted_idx",
    ),
    "weights-fp16": (_bad(expert_weights=lambda i: i["expert_weights"].half()), TypeError, "expert_weights"),
    "shared-dtype": (_bad(shared_output=lambda i: i["shared_output"].float()), TypeError, "shared_output"),
    "out-dtype": (_bad(out=lambda i: torch.empty_like(i["shared_output"], dtype=torch.float32)), TypeError, "out"),
    "top_k-float": (_bad(top_k=2.0), TypeError, "top_k"),
    "top_k-bool": (_bad(top_k=True), TypeError, "top_k"),
    "enable_pdl-str": (_bad(enable_pdl="yes"), TypeError, "enable_pdl"),
    # Wrong ranks, shapes, ranges, devices, options: ValueError naming the argument.
    "gemm2_out-3d": (_bad(gemm2_out=lambda i: i["gemm2_out"][None]), ValueError, "gemm2_out"),
    "idx-2d": (
        _bad(expanded_idx_to_permuted_idx=lambda i: i["expanded_idx_to_permuted_idx"].view(3, 2)),
        ValueError,
        "expanded_idx_to_permuted_idx",
    ),
    "idx-short": (
        _bad(expanded_idx_to_permuted_idx=lambda i: i["expanded_idx_to_permuted_idx"][:-1]),
        ValueError,
        "expanded_idx_to_permuted_idx",
    ),
    "weights-columns": (_bad(expert_weights=lambda i: i["expert_weights"][:, :1]), ValueError, "expert_weights"),
    "top_k-zero": (_bad(top_k=0), ValueError, "top_k"),
    "shared-wider-than-gemm2": (
        _bad(shared_output=lambda i: i["shared_output"].new_zeros(3, i["gemm2_out"].shape[1] + 1)),
        ValueError,
        "shared_output",
    ),
    "shared-tokens": (_bad(shared_output=lambda i: i["shared_output"][:2]), ValueError, "shared_output"),
    "out-shape": (_bad(out=lambda i: torch.empty_like(i["shared_output"])[:, :-1]), ValueError, "out"),
    "out-overlapping": (
        _bad(out=lambda i: i["shared_output"].new_empty(1, i["shared_output"].shape[1]).expand(3, -1)),
        ValueError,
        "out",
    ),
    "weights-device": (_bad(expert_weights=lambda i: i["expert_weights"].to("meta")), ValueError, "expert_weights"),
    "backend": (_bad(backend="cuda"), ValueError, "backend"),
    # Rows outside [-1, R) are caught where checking is on (always on CPU; the test sets MOEFUSE_CHECK=1).
    "row-past-end": (
        _bad(expanded_idx_to_permuted_idx=lambda i: i["expanded_idx_to_permuted_idx"] * 0 + i["gemm2_out"].shape[0]),
        ValueError,
        "expanded_idx_to_permuted_idx",
    ),
    "row-below-minus-one": (
        _bad(expanded_idx_to_permuted_idx=lambda i: torch.full_like(i["expanded_idx_to_permuted_idx"], -2)),
        ValueError,
        "expanded_idx_to_permuted_idx",
    ),
}


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_errors_name_the_argument(gen, device, case, backend, monkeypatch):
    changes, error, name = case
    monkeypatch.setattr(_runtime.DEFAULTS, "check", True)
    inputs = {**make_inputs(gen, device, num_tokens=3, top_k=2, hidden=8, pad_cols=2), "backend": backend}
    for key, change in changes.items():
        inputs[key] = change(inputs) if callable(change) else change
    monkeypatch.setattr(finalize_kernel, "_finalize_kernel", None)  # validation must come before any launch
    with pytest.raises(error, match=name):
        moe_finalize_fuse_shared(**inputs)
