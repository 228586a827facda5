"""One fp8 block-scale SwiGLU MLP over every token, on cuBLAS's block-scaled GEMMs: the shared expert at prefill.

A layer's fp8 shared expert is a dense MLP (every token through one expert). As a one-expert plan of the grouped
GEMMs it runs at 640-665 TFLOP/s at 4,096 tokens, DeepSeek-V3 and V4 widths; cuBLAS's GEMMs with DeepSeek's block
scaling (``torch._scaled_mm`` with 1 x 128 activation and 128 x 128 weight scales: sm_90, CUDA 12.9 or later) run
the same MLP at 820-860, and 8,192 tokens at 870-910 (H200, 2026-12-02). The numerics are SPEC §5's: each
128-deep block's product is scaled and added in fp32, the intermediate is quantized from fp32. From
:data:`MIN_TOKENS` tokens, where cuBLAS is faster at both DeepSeek widths, the shared expert runs as:

1. its tokens quantized per 128 columns (``quantize.quantize_rows_into`` without a plan);
2. GEMM1 into fp32 ``[M, 2I]``;
3. SwiGLU (and DeepSeek-V4's clamp) in fp32, quantized per 128 columns (:func:`_swiglu_quantize_kernel`);
4. GEMM2 into hidden's dtype.

cuBLAS reads activation scales column-major, wants the rows in multiples of 4 (the rows past M are zeros, their
outputs dropped) and each weight's K / 128 a multiple of 4 (H and I multiples of 512; other widths keep the
grouped GEMMs: :func:`takes`).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ... import _runtime
from ...formats import BLOCK, BlockFP8
from ..common import _swiglu
from .quantize import _quantize, quantize_rows_into

# cuBLAS against the grouped GEMMs (H200, 2026-12-02): at 4,096 tokens 252 against 321 µs (V4 widths), 421 against
# 546 (V3); at 511 tokens 79 against 76 (V4).
MIN_TOKENS = 1024
WIDTH_MULTIPLE = 4 * BLOCK  # cuBLAS's block-scaled GEMMs take K / 128 in multiples of 4


@triton.jit(do_not_specialize=["num_rows", "stride_sg"])  # stride_sg: the rows (column-major scales)
def _swiglu_quantize_kernel(gate_up_ptr, q_ptr, s_ptr, num_rows, I, limit, stride_gm, stride_qm, stride_sm, stride_sg,
                            HAS_LIMIT: tl.constexpr, EMULATE_RTNE: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows of ``gate_up`` [num_rows, 2I] (fp32, gate columns then up): ``SiLU(gate) * up`` after the clamp, in
    fp32, quantized per 128 columns (SPEC §5) into ``q`` [num_rows, I] (e4m3) and ``s`` [num_rows, I / 128]."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    ks = tl.arange(0, 128)  # a scale group (a jit function sees no plain globals)
    for k0 in range(0, I, 128):
        gate_ptrs = gate_up_ptr + rows.to(tl.int64)[:, None] * stride_gm + (k0 + ks)[None, :]
        gate = tl.load(gate_ptrs, mask=row_ok[:, None], other=0.0)
        up = tl.load(gate_ptrs + I, mask=row_ok[:, None], other=0.0)
        q, scale = _quantize(_swiglu(gate, up, limit, HAS_LIMIT), EMULATE_RTNE)
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + (k0 + ks)[None, :], q, mask=row_ok[:, None])
        tl.store(s_ptr + rows.to(tl.int64) * stride_sm + k0 // 128 * stride_sg, scale, mask=row_ok)


def _cublas_block_scaling() -> bool:
    """Whether this torch's ``_scaled_mm`` has cuBLAS's DeepSeek block scaling (torch 2.9 on CUDA 12.9 or later)."""
    cuda = torch.version.cuda
    return (cuda is not None and torch.__version__ >= "2.9"
            and tuple(int(part) for part in cuda.split(".")[:2]) >= (12, 9))


CUBLAS_BLOCK_SCALING = _cublas_block_scaling()  # a constant: torch.compile traces ``takes`` without a cached call


def takes(num_tokens: int, hidden_size: int, width: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a shared expert of ``width`` runs here rather than as a one-expert grouped GEMM: on an sm_90 GPU
    (torch supports the block scaling there only), from ``MIN_TOKENS`` tokens, H and I multiples of 512, bf16 or
    fp16 activations. A host decision on shapes alone (no sync)."""
    return (device.type == "cuda" and not _runtime.interpreting() and num_tokens >= MIN_TOKENS
            and hidden_size % WIDTH_MULTIPLE == 0 and width % WIDTH_MULTIPLE == 0
            and dtype in (torch.bfloat16, torch.float16) and _runtime.capability(device) == (9, 0)
            and CUBLAS_BLOCK_SCALING)


def _column_major(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """fp32 [rows, cols] with rows adjacent, as cuBLAS reads 1 x 128 scales."""
    return torch.empty(cols, rows, dtype=torch.float32, device=device).t()


def _padded_rows(num_tokens: int) -> int:
    """cuBLAS's row count for ``num_tokens``: the next multiple of 4."""
    return -(-num_tokens // 4) * 4


def _fp8_mlp_impl(x: torch.Tensor, gate_up_values: torch.Tensor, gate_up_scales: torch.Tensor,
                  down_values: torch.Tensor, down_scales: torch.Tensor, swiglu_limit: Optional[float],
                  out: torch.Tensor) -> None:
    M, H = x.shape
    I = down_values.shape[1]
    rows = out.shape[0]
    xq = torch.empty(rows, H, dtype=torch.float8_e4m3fn, device=x.device)
    xs = _column_major(rows, H // BLOCK, x.device)
    quantize_rows_into(x, xq[:M], xs[:M], None, gather=False)
    if rows > M:  # zeros: finite rows that are dropped
        xq[M:].view(torch.uint8).zero_()
        xs[M:].zero_()
    gate_up = torch._scaled_mm(xq, gate_up_values.t(), scale_a=xs, scale_b=gate_up_scales.contiguous().t(),
                               out_dtype=torch.float32)
    aq = torch.empty(rows, I, dtype=torch.float8_e4m3fn, device=x.device)
    as_ = _column_major(rows, I // BLOCK, x.device)
    block_r = 16
    _swiglu_quantize_kernel[(triton.cdiv(rows, block_r),)](
        gate_up, aq, as_, rows, I, 0.0 if swiglu_limit is None else float(swiglu_limit), gate_up.stride(0),
        aq.stride(0), *as_.stride(), HAS_LIMIT=swiglu_limit is not None, EMULATE_RTNE=_runtime.interpreting(),
        BLOCK_R=block_r, num_warps=4)
    torch._scaled_mm(aq, down_values.t(), scale_a=as_, scale_b=down_scales.contiguous().t(), out_dtype=x.dtype,
                     out=out)


_fp8_mlp_op = torch.library.custom_op("moefuse::fp8_mlp", _fp8_mlp_impl, mutates_args=("out",))


@_fp8_mlp_op.register_fake
def _(x, gate_up_values, gate_up_scales, down_values, down_scales, swiglu_limit, out) -> None:
    return None


def fp8_mlp(x: torch.Tensor, gate_up: BlockFP8, down: BlockFP8, swiglu_limit: Optional[float] = None
            ) -> torch.Tensor:
    """``down(SiLU(gate(x)) * up(x))`` for ``x`` [M, H] (bf16 or fp16) and one expert's ``gate_up`` [1, 2I, H] and
    ``down`` [1, H, I] (SPEC §5's numerics), through cuBLAS; call only where :func:`takes` holds (the layer's shared
    expert checks it). Returns [M, H] in x's dtype."""
    out = x.new_empty(_padded_rows(x.shape[0]), down.values.shape[1])  # rows past M: cuBLAS's padding, dropped
    op = _fp8_mlp_impl if _runtime.direct_call() else torch.ops.moefuse.fp8_mlp
    op(x, gate_up.values[0], gate_up.scales[0], down.values[0], down.scales[0], swiglu_limit, out)
    return out[:x.shape[0]]
