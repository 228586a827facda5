"""The fp8 activation quantization of SPEC §5: rows to e4m3 per 128 columns, one fp32 scale per row and group.

``_quantize`` quantizes a tile's rows in registers: the fp8 GEMMs' epilogue (``kernels.py``) and the fp8 shared
expert's SwiGLU kernel (``mlp.py``) call it, and the Gluon kernels (``mxfp4/w4a8.py``, ``persistent.py``) do the
same steps with ``gluon_common``'s helpers. :func:`quantize_rows_into` launches a kernel of its own over stored rows
(the *quantization pass*), into room from :func:`quantized_rows`: a plan's rows gathered from the tokens (the fp8
GEMM1's activations, W4A8's GEMM1), or rows as they are (the shared expert's tokens before cuBLAS). Both give the
bits of the reference, ``experts.reference.quantize_rows``.

Under Triton's interpreter the fp32 -> e4m3 cast does not round to nearest even for about 2% of values, so there
the rounding is done on the bits first and the cast is then exact (``EMULATE_RTNE``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ... import _runtime
from ...dispatch import DispatchPlan
from ...formats import BLOCK


@triton.jit
def _to_e4m3(y, EMULATE_RTNE: tl.constexpr):
    """fp32 ``y`` (within [-448, 448] or NaN) -> float8e4nv, rounded to nearest even."""
    if EMULATE_RTNE:
        bits = y.to(tl.uint32, bitcast=True)
        normal = (bits & 0x7FFFFFFF) >= 0x3C800000  # |y| >= 2^-6: keep 3 of the 23 mantissa bits
        kept = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        sub = ((y * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # subnormals: multiples of 2^-9
        sub = tl.where(sub == 0.0, y * 0.0, sub)  # an underflow keeps y's sign (-0.0), as the cast does
        y = tl.where(y != y, y, tl.where(normal, kept, sub))
    return y.to(tl.float8e4nv)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize(x, EMULATE_RTNE: tl.constexpr):
    """Rows of fp32 ``x`` [BLOCK_M, 128] -> (e4m3 values, fp32 scale per row), SPEC §5 (all-zero row: scale 0).
    A NaN makes its row's amax, and so its scale, NaN (``tl.max`` would skip it), as in the reference: the row's
    products are then NaN whatever the e4m3 cast makes of the NaN itself (Triton's interpreter makes it finite)."""
    amax = tl.reduce(tl.abs(x), 1, _max_keeping_nan)  # [BLOCK_M]
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax), 0.0)
    y = x * inv[:, None]
    # A NaN input stays NaN (the hardware's min/max would drop it).
    y = tl.maximum(y, -448.0, propagate_nan=tl.PropagateNan.ALL)
    y = tl.minimum(y, 448.0, propagate_nan=tl.PropagateNan.ALL)
    return _to_e4m3(y, EMULATE_RTNE), tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))


# stride_sg: the rows, for column-major scales; run_groups follows the row count
@triton.jit(do_not_specialize=["num_rows", "stride_sg", "run_groups"])
def _quantize_rows_kernel(
    source_ptr, q_ptr, s_ptr, p2e_ptr, expert_offsets_ptr, num_experts, num_rows, K, top_k, run_groups,
    stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sg,
    GATHER: tl.constexpr, WORD_ORDER: tl.constexpr, EMULATE_RTNE: tl.constexpr, BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """q[p], s[p] = quant(x) per 128 columns for the plan's valid rows p, x = source[permuted_to_expanded[p] //
    top_k] (``GATHER``) or source[p]; without a plan (``expert_offsets_ptr`` None), for rows p < num_rows; column
    k of q at ``gluon_common.word_position`` (k) with ``WORD_ORDER`` (a permutation within each group of 32, so the
    scales are the same). Program (r, c): rows r·BLOCK_R onwards, the c-th run of ``run_groups`` groups of 128 columns
    (:func:`groups_per_program`)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the plan comes from dispatch
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if expert_offsets_ptr is None:
        row_ok = rows < num_rows
    else:
        row_ok = rows < tl.minimum(tl.load(expert_offsets_ptr + num_experts), num_rows)
    if GATHER:
        sources = (tl.load(p2e_ptr + rows, mask=row_ok, other=0) // top_k).to(tl.int64)
    else:
        sources = rows.to(tl.int64)
    ks = tl.arange(0, 128)
    k_first = tl.program_id(1) * run_groups * 128
    for k0 in range(k_first, tl.minimum(k_first + run_groups * 128, K), 128):
        k_ok = ks < K - k0
        mask = row_ok[:, None] & k_ok[None, :]
        x = tl.load(source_ptr + sources[:, None] * stride_xm + (k0 + ks)[None, :] * stride_xk, mask=mask,
                    other=0.0)
        q, scale = _quantize(x.to(tl.float32), EMULATE_RTNE)
        if WORD_ORDER:
            # Column 32g + 8t + 4h + j to 32g + 16h + 4t + j (``gluon_common.word_position``), moved in registers:
            # stored through permuted addresses, each thread's 16-byte run would go out as 16 single-byte stores
            # (sm_90 SASS), 16 times the store instructions and a sector written per byte.
            q = tl.reshape(tl.permute(tl.reshape(q, (BLOCK_R, 4, 4, 2, 4)), (0, 1, 3, 2, 4)), (BLOCK_R, 128))
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + (k0 + ks)[None, :] * stride_qk, q, mask=mask)
        tl.store(s_ptr + rows.to(tl.int64) * stride_sm + k0 // 128 * stride_sg, scale, mask=row_ok)


# About eight 4-warp programs an SM of an H100 or H200 (132 SMs). A row's groups spread over programs up to this
# count take the pass 2.7 µs at 8 tokens against 24.7 with a whole row a program, 6.1 against 25.5 at 128, level at
# 4,096 (DeepSeek-V3, H100, 2026-12-05).
PASS_PROGRAMS = 1024


def groups_per_program(row_blocks: int, groups: int) -> int:
    """How many of a row block's ``groups`` (of 128 columns) one program of the pass quantizes, one after another:
    all of them where the ``row_blocks`` alone make about :data:`PASS_PROGRAMS` programs, fewer (a power of two)
    below, down to one. With one program a row block, the 56 groups of a DeepSeek-V3 row run one after another
    before GEMM1 can start: 33.5 µs for one token's 8 rows (H200, 2026-12-04)."""
    want = -(-row_blocks * groups // PASS_PROGRAMS)
    return max(1, min(triton.next_power_of_2(want), groups))


def quantized_rows(plan: DispatchPlan, width: int, device: torch.device, step_major: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for the plan's rows of ``width`` columns quantized per 128 (SPEC §5): e4m3 values [num_rows, width] and
    fp32 scales [num_rows, ceil(width / 128)]; ``step_major``: the scales a transposed view (row stride 1), so
    that a kernel reading one group's scales for many rows reads them contiguously."""
    values = torch.empty(plan.num_rows, width, dtype=torch.float8_e4m3fn, device=device)
    groups = triton.cdiv(width, BLOCK)
    if step_major:
        return values, torch.empty(groups, plan.num_rows, dtype=torch.float32, device=device).t()
    return values, torch.empty(plan.num_rows, groups, dtype=torch.float32, device=device)


def quantize_rows_into(source: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, plan: Optional[DispatchPlan], *,
                       gather: bool, use_pdl: bool = False, word_order: bool = False) -> None:
    """Quantize the plan's valid rows (SPEC §5) into ``q`` [num_rows, W] (e4m3) and ``scales`` [num_rows, W/128]
    (fp32, any strides): of ``source``'s token rows (``gather``: row p from token permuted_to_expanded[p] // top_k)
    or its rows as they are (the W4A8 kernels' intermediate). Rows past the valid ones are left unwritten. Without
    a plan (``gather`` off), every row of ``q``. ``word_order``: each group of 32 columns of ``q`` permuted as
    ``gluon_common.word_position`` places them (the W4A8 kernels' K order; W a multiple of 32)."""
    if word_order and q.shape[1] % 32:
        raise ValueError(f"q: word order permutes groups of 32 columns; got {q.shape[1]} columns")
    block_r = 16
    launch = {"launch_pdl": True} if use_pdl else {}
    args: tuple[Optional[torch.Tensor], Optional[torch.Tensor], int, int, int, int]
    if plan is None:
        assert not gather, "a gather needs the plan's row order"
        rows, args = q.shape[0], (None, None, 0, q.shape[0], source.shape[1], 1)
    else:
        rows = plan.num_rows
        args = (plan.permuted_to_expanded, plan.expert_offsets, plan.num_experts, plan.num_rows, source.shape[1],
                plan.top_k)
    row_blocks, groups = triton.cdiv(rows, block_r), triton.cdiv(source.shape[1], BLOCK)
    per_program = groups_per_program(row_blocks, groups)
    _quantize_rows_kernel[(row_blocks, triton.cdiv(groups, per_program))](
        source, q, scales, *args, per_program, source.stride(0), source.stride(1), *q.stride(), *scales.stride(),
        GATHER=gather, WORD_ORDER=word_order, EMULATE_RTNE=_runtime.interpreting(), BLOCK_R=block_r,
        USE_PDL=use_pdl,
        num_warps=4, **launch,
    )
