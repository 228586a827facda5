"""Public finalize op ``moe_finalize_fuse_shared`` (SPEC §2): validation, backend choice, the torch custom op."""

from typing import Optional

import torch

from .. import _checks, _runtime
from .kernel import finalize_triton
from .reference import moe_finalize_fuse_shared_torch

_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def moe_finalize_fuse_shared(
    gemm2_out: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    expert_weights: torch.Tensor,
    shared_output: Optional[torch.Tensor],
    top_k: int,
    enable_pdl: Optional[bool] = None,
    *,
    out: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Weighted sum of each token's expert rows plus the shared-expert output, in one pass.

    ``out[t] = round(sum_{k: row(t,k) != -1} w[t,k] * gemm2_out[row(t,k), :H] + shared_output[t])`` with fp32
    accumulation in slot order k = 0..top_k-1 (slot k: the token's k-th routed choice) and one rounding to
    gemm2_out's dtype.

    Args:
        gemm2_out: [R, Hp] bf16, fp16 or fp32: one row per (token, slot) pair in expert order; padding rows
            and the padding columns beyond H are ignored. R may be 0 (then every slot must be -1).
        expanded_idx_to_permuted_idx: int32 [M * top_k]; entry ``t * top_k + k`` is the gemm2_out row of slot
            k of token t, or -1 when the slot has no row (expert on another rank, padded token).
        expert_weights: [M, top_k] fp32 or bf16, routing scaling factor already applied.
        shared_output: [M, H] of gemm2_out's dtype with H <= Hp, or None (then H = Hp). May be the same
            tensor as ``out`` (in-place add into the shared output): each element is read before it is written.
        top_k: slots per token, >= 1.
        enable_pdl: programmatic dependent launch; None = on where the GPU supports it (compute capability
            >= 9). Ignored by the reference backend and on CPU.
        out: optional [M, H] of gemm2_out's dtype to write into; it must not overlap gemm2_out and no two of
            its elements may share memory.
        backend: "auto" (Triton on CUDA, reference elsewhere), "triton" (CPU needs TRITON_INTERPRET=1) or
            "reference".

    Returns:
        ``out`` (allocated when not given), [M, H], gemm2_out's dtype and device. M = 0 launches nothing.

    Raises:
        TypeError: an argument of the wrong type or dtype. ValueError: wrong rank, shape or device, or an
        index outside [-1, R). The index-range check needs a host sync, so it runs only where checking is on
        (CPU tensors, backend="reference", or ``MOEFUSE_CHECK=1``) and never during CUDA-graph capture or
        under ``torch.compile``. Where it does not run, an out-of-range entry is treated like -1 (the slot is
        absent): no backend ever reads outside gemm2_out.

    Strides: any strides are accepted for every tensor (the kernel takes them all; unit last-dim strides get
    16-byte vector loads). CUDA graphs: capturable (no host sync, no allocation besides ``out`` when not given);
    the launch configuration depends only on shapes and dtype.
    """
    num_tokens, hidden, use_pdl, resolved = _validate(
        gemm2_out, expanded_idx_to_permuted_idx, expert_weights, shared_output, top_k, enable_pdl, out, backend
    )
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=gemm2_out.dtype, device=gemm2_out.device)
    op = _finalize_impl if _runtime.direct_call() else torch.ops.moefuse.finalize_fuse_shared
    op(
        gemm2_out, expanded_idx_to_permuted_idx, expert_weights, shared_output, top_k, use_pdl, resolved, out
    )
    return out


def _validate(
    gemm2_out: object,
    idx: object,
    weights: object,
    shared_output: object,
    top_k: object,
    enable_pdl: object,
    out: object,
    backend: str,
) -> tuple[int, int, bool, str]:
    """All checks of ``moe_finalize_fuse_shared``, before any allocation or launch; returns (M, H, pdl, backend)."""
    gemm2_out = _checks.check_tensor("gemm2_out", gemm2_out, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    device = gemm2_out.device
    num_rows, padded_h = gemm2_out.shape
    top_k = _checks.check_int("top_k", top_k, low=1)
    weights = _checks.check_tensor("expert_weights", weights, dtypes=_WEIGHT_DTYPES, ndim=2, device=device)
    num_tokens = weights.shape[0]
    _checks.check_tensor("expert_weights", weights, shape=(num_tokens, top_k))
    idx = _checks.check_tensor(
        "expanded_idx_to_permuted_idx", idx, dtypes=(torch.int32,), shape=(num_tokens * top_k,), device=device
    )
    hidden = padded_h
    if shared_output is not None:
        shared_output = _checks.check_tensor(
            "shared_output", shared_output, dtypes=(gemm2_out.dtype,), ndim=2, device=device
        )
        hidden = shared_output.shape[1]
        if hidden > padded_h:
            raise ValueError(
                f"shared_output has H = {hidden} columns but gemm2_out only Hp = {padded_h} (need H <= Hp)"
            )
        _checks.check_tensor("shared_output", shared_output, shape=(num_tokens, hidden))
    if out is not None:
        out = _checks.check_tensor(
            "out", out, dtypes=(gemm2_out.dtype,), shape=(num_tokens, hidden), device=device
        )
        if any(size > 1 and stride == 0 for size, stride in zip(out.shape, out.stride())):
            raise ValueError(f"out must not have overlapping elements, got strides {out.stride()} (an expanded view?)")
    if enable_pdl is not None and not isinstance(enable_pdl, bool):
        raise TypeError(f"enable_pdl must be None or a bool, got {type(enable_pdl).__name__}")
    resolved = _runtime.resolve_backend(backend, device)

    # is_compiling() first: under torch.compile the whole condition folds away without tracing the rest.
    if (
        not torch.compiler.is_compiling()
        and (_runtime.checks_enabled(device) or resolved == "reference")
        and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        and idx.numel() > 0
    ):
        bad = (idx < -1) | (idx >= num_rows)
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"expanded_idx_to_permuted_idx[{first}] = {int(idx[first])} is outside [-1, {num_rows}): "
                f"gemm2_out has {num_rows} rows and -1 marks an absent slot"
            )
    return num_tokens, hidden, _runtime.pdl_enabled(enable_pdl, device), resolved


def _finalize_impl(
    gemm2_out: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    expert_weights: torch.Tensor,
    shared_output: Optional[torch.Tensor],
    top_k: int,
    use_pdl: bool,
    backend: str,
    out: torch.Tensor,
) -> None:
    """Compute into ``out``; arguments were validated and ``backend`` resolved by the public wrapper."""
    if backend == "triton":
        finalize_triton(gemm2_out, expanded_idx_to_permuted_idx, expert_weights, shared_output, top_k, out, use_pdl)
    else:
        moe_finalize_fuse_shared_torch(
            gemm2_out, expanded_idx_to_permuted_idx, expert_weights, shared_output, top_k, out=out
        )


_finalize_fuse_shared_op = torch.library.custom_op(
    "moefuse::finalize_fuse_shared", _finalize_impl, mutates_args=("out",)
)


@_finalize_fuse_shared_op.register_fake
def _(gemm2_out, expanded_idx_to_permuted_idx, expert_weights, shared_output, top_k, use_pdl, backend, out) -> None:
    return None
