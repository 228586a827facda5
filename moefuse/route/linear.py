"""Triton router linear: fp32 logits ``x @ weight^T`` read straight from 16-bit ``x``.

At decode the router linear is on the critical path before routing can start, and through cuBLAS it costs two
launches (the ``x.float()`` copy, then an fp32 GEMV that is not bandwidth-efficient at M = 1). This kernel reads
``x`` (bf16, fp16 or fp32) and ``weight`` (any of those, fp32 in the checkpoints) and multiplies in fp32 in
registers: one launch, and no upcast copy of a 16-bit router weight either.

Contract of ``_router_logits_kernel``: ``x`` [M, H] with M <= ``MAX_TOKENS``, ``weight`` [E, H], ``out`` fp32
[M, E], any strides. One program per expert: it holds all M rows, walks H in ``BLOCK_K`` chunks with
elementwise fp32 FMAs into a [BLOCK_M, BLOCK_K] accumulator, and reduces it once at the end. Products and sums
are fp32 (IEEE), as in ``F.linear(x.float(), weight.float())``; only the order of the sum differs.

Prefill batches (``MMA_MIN_TOKENS`` rows or more, bf16 ``x``, fp32 ``weight``): ``_router_logits_mma_kernel``
runs on the tensor cores instead of cuBLAS's fp32 (SIMT) GEMM on an upcast copy of ``x``. The weight is split
exactly into three bf16 parts (``bf16_split``: hi + mid + lo == weight), so every product ``x_k * part_k`` is exact
in fp32. cuBLAS's bf16 GEMMs on the same split are off by up to 8.6e-7 of ``sum |x_k w_k|`` from 1,024 tokens,
against 1e-7 for the fp32 GEMM (H200, 2026-12-02; the tensor cores' fp32 accumulation is not IEEE addition), so
here the MMAs sum only ``BLOCK_K`` columns' products at a time, and each block's sum is added to the fp32
accumulator by an FMA: 4-5e-8.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _runtime

MAX_TOKENS = 16  # the decode kernel's batches; larger ones go to cuBLAS's fp32 GEMM, which has the tiles for them,
MMA_MIN_TOKENS = 768  # or from here on to the tensor-core kernel (bf16 x, fp32 weight), whose time hardly grows
# below 1,024 tokens (a program's K loop is serial: 38 µs for H = 4,096, 67 for 7,168) while cuBLAS's does: from 768
# it is faster for every preset, from 384-640 for all but GLM-4.5-Air (H100, 2026-12-06, research/router_switch)
_ELEMS = 8192  # accumulator elements per program: 32 fp32 registers per thread at NUM_WARPS warps
NUM_WARPS = 8


# Integers that vary with the token count are not specialised: no new variant per batch size (moefuse.warmup).
@triton.jit(do_not_specialize=["M"])
def _router_logits_kernel(
    x_ptr, w_ptr, out_ptr, M, H,
    stride_xm, stride_xk, stride_we, stride_wk, stride_om, stride_oe,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCKS: tl.constexpr = False,
):
    e = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    if ROW_BLOCKS:  # the batch-invariant launch: program (e, b) takes rows b·BLOCK_M.. of any M
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
        out_ptrs = out_ptr + rows.to(tl.int64) * stride_om + e * stride_oe
    else:  # decode: every row in one program
        rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
        out_ptrs = out_ptr + rows * stride_om + e * stride_oe
    row_ok = rows < M
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + ks * stride_wk  # [BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = ks < H - k0
        w = tl.load(w_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += x * w[None, :]
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    tl.store(out_ptrs, tl.sum(acc, axis=1), mask=row_ok)


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``x @ weight^T`` (fp32) into ``out`` [M, E]; 0 < M <= MAX_TOKENS, E and H > 0 (the caller validates
    and gives empty shapes to the reference)."""
    M, H = x.shape
    E = weight.shape[0]
    block_m, block_k = block_shape(M, H)
    _router_logits_kernel[(E,)](
        x, weight, out, M, H, *x.stride(), *weight.stride(), *out.stride(),
        BLOCK_M=block_m, BLOCK_K=block_k, num_warps=NUM_WARPS,
    )


def block_shape(M: int, H: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K): all M rows in one program, and H in as few chunks as the accumulator allows
    (one chunk at M = 1 for H <= 8192, so every load of a program is in flight at once)."""
    block_m = triton.next_power_of_2(M)
    return block_m, max(16, min(triton.next_power_of_2(H), _ELEMS // block_m))


@triton.jit
def _bf16_split_kernel(w_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``out[0..2, i]`` (bf16): hi, mid and lo with hi + mid + lo == w[i] exactly. Each part rounds what the
    previous ones left, and that remainder is exact whatever the rounding (the difference of two floats within a
    factor of two); 24 significant bits fit in three parts of 8. A non-finite weight leaves no remainder (inf
    stays inf, NaN stays NaN)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    hi = w.to(tl.bfloat16)
    rest = tl.where(w == hi.to(tl.float32), 0.0, w - hi.to(tl.float32))
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    tl.store(out_ptr + offs, hi, mask=ok)
    tl.store(out_ptr + n + offs, mid, mask=ok)
    tl.store(out_ptr + 2 * n + offs, lo, mask=ok)


def bf16_split(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 ``weight`` [E, H] as three bf16 parts [3, E, H] whose sum is exactly ``weight``."""
    w = weight.contiguous()
    parts = torch.empty(3, *w.shape, dtype=torch.bfloat16, device=w.device)
    if w.numel():
        _bf16_split_kernel[(triton.cdiv(w.numel(), 1024),)](w, parts, w.numel(), BLOCK=1024)
    return parts


@triton.jit
def _operand(ptrs, mask, UPCAST: tl.constexpr):
    """A bf16 tile; fp32 under the interpreter, whose 16-bit ``tl.dot`` is wrong (the products stay exact)."""
    tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile.to(tl.float32) if UPCAST else tile


# Integers that vary with the token count are not specialised: no new variant per batch size (moefuse.warmup).
@triton.jit(do_not_specialize=["M"])
def _router_logits_mma_kernel(
    x_ptr, parts_ptr, out_ptr, M, E, H, stride_xm, stride_xk, stride_om, stride_oe,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,
):
    """out[m, e] = sum_k x[m, k] * (hi + mid + lo)[e, k] for a [BLOCK_M, BLOCK_N] tile; ``parts_ptr``:
    ``bf16_split``'s [3, E, H], contiguous. With ``SPLIT_K`` > 1, program (i, j, s) sums the s-th of SPLIT_K runs
    of K steps into the s-th [M, E] of ``out`` ([SPLIT_K, M, E] contiguous partial sums: ``_sum_runs_kernel``)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk
    w_ptrs = parts_ptr + cols[:, None] * H + ks[None, :]
    part = E * H  # elements between parts
    precision: tl.constexpr = "ieee" if UPCAST else "tf32"  # 16-bit operands: the option is not used
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = 0
    last = H
    if SPLIT_K > 1:
        per_run = tl.cdiv(tl.cdiv(H, BLOCK_K), SPLIT_K) * BLOCK_K
        first = tl.program_id(2) * per_run
        last = tl.minimum(first + per_run, H)
        x_ptrs += first * stride_xk
        w_ptrs += first
    for k0 in range(first, last, BLOCK_K):
        k_ok = ks[None, :] < H - k0
        x = _operand(x_ptrs, (rows[:, None] < M) & k_ok, UPCAST)
        w_ok = (cols[:, None] < E) & k_ok
        # This block's products, summed by the MMA (lo and mid first, the smallest), then added to acc by an
        # FMA: an add here would be folded into the MMA's accumulator, which is what this avoids.
        block = tl.dot(x, tl.trans(_operand(w_ptrs + 2 * part, w_ok, UPCAST)), input_precision=precision)
        block = tl.dot(x, tl.trans(_operand(w_ptrs + part, w_ok, UPCAST)), block, input_precision=precision)
        block = tl.dot(x, tl.trans(_operand(w_ptrs, w_ok, UPCAST)), block, input_precision=precision)
        acc = tl.fma(block, 1.0, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_oe
    if SPLIT_K > 1:
        out_ptrs += tl.program_id(2).to(tl.int64) * M * stride_om
    tl.store(out_ptrs, acc, mask=(rows[:, None] < M) & (cols[None, :] < E))


@triton.jit(do_not_specialize=["n"])
def _sum_runs_kernel(parts_ptr, out_ptr, n, E, stride_om, stride_oe, RUNS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, e] = ((p[0] + p[1]) + p[2]) + ... over the RUNS partial sums [RUNS, M, E] (contiguous), in run order:
    the same additions for every element whatever M is."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    acc = tl.load(parts_ptr + offs, mask=ok, other=0.0)
    for r in tl.static_range(1, RUNS):
        acc += tl.load(parts_ptr + r * n + offs, mask=ok, other=0.0)
    m, e = offs // E, offs % E
    tl.store(out_ptr + m.to(tl.int64) * stride_om + e * stride_oe, acc, mask=ok)


class MmaLaunch(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    cost: float  # a program's time relative to the first's (one program an SM: each takes most of the shared memory)


# A program's time grows slower than its tile (H200, 2026-12-02), so the largest tile wins unless it leaves the GPU
# in more waves.
MMA_LAUNCHES = (MmaLaunch(64, 64, 64, 4, 4, 1.0), MmaLaunch(64, 128, 64, 4, 3, 1.6),
                MmaLaunch(128, 128, 64, 8, 3, 2.25))


def _sms(device: torch.device) -> int:
    """The SMs the tensor-core kernel's launch is chosen for (under the interpreter any count does)."""
    return _runtime.sm_count(device) if device.type == "cuda" else 1


def mma_launch(M: int, E: int, sms: int) -> MmaLaunch:
    """The launch of fewest waves times a program's cost for [M, E] logits on ``sms`` SMs."""
    return min(MMA_LAUNCHES, key=lambda c: triton.cdiv(triton.cdiv(M, c.block_m) * triton.cdiv(E, c.block_n), sms)
               * c.cost)


def router_logits_mma(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``x @ weight^T`` (fp32) into ``out`` [M, E]: bf16 ``x``, fp32 ``weight``, M, E and H > 0 (the caller
    validates and gives empty shapes to the reference), on the tensor cores (module docstring)."""
    M, H = x.shape
    E = weight.shape[0]
    c = mma_launch(M, E, _sms(x.device))
    _router_logits_mma_kernel[(triton.cdiv(M, c.block_m), triton.cdiv(E, c.block_n))](
        x, bf16_split(weight), out, M, E, H, *x.stride(), *out.stride(),
        UPCAST=_runtime.interpreting(), BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        num_warps=c.warps, num_stages=c.stages,
    )


# Batch invariance: one launch at every M, so a row's logits are the same bits in any batch. bf16 activations run
# the tensor-core kernel on the weight's exact split (its products exact, each BLOCK_K of them summed by the MMA,
# then added to the row's sum by an FMA, in K order), with K cut into runs fixed by H alone (``invariant_runs``: at
# decode the programs of one run would not fill the GPU) and the runs' sums added in run order. Other activations
# run the decode kernel over row blocks of INVARIANT_ROWS (its per-row arithmetic is fixed by the block shape).
# 32 columns a program: twice the programs at decode (one token, DeepSeek-V3 widths: 8.1 us against 9.4 on 64
# columns); 3 stages: 168.4 against 191.2 us on 4 at 4,096 tokens, 8.1 either way at one (H100;
# research/invariant_one_token). Stages and warps order no sum: the tile's columns and K block fix the bits.
INVARIANT_MMA = MmaLaunch(64, 32, 64, 4, 3, 1.0)
INVARIANT_RUN_COLUMNS = 256  # the fewest columns of H a run of the invariant launch takes
INVARIANT_MAX_RUNS = 16
INVARIANT_ROWS = 16


def invariant_runs(H: int) -> int:
    """The runs the invariant tensor-core launch cuts K into: a function of H alone (never of M)."""
    return max(1, min(INVARIANT_MAX_RUNS, H // INVARIANT_RUN_COLUMNS))


def invariant_logit_runs(x_dtype: torch.dtype, H: int) -> int:
    """The partial sums :func:`router_logits_invariant` adds: ``invariant_runs(H)`` for bf16 ``x``, else 1."""
    return invariant_runs(H) if x_dtype == torch.bfloat16 else 1


def router_logits_invariant(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                            parts: torch.Tensor | None = None) -> None:
    """Write ``x @ weight^T`` (fp32) into ``out`` [M, E] with the same arithmetic for a row at every M (above); M, E
    and H > 0. ``parts``: ``bf16_split(weight.float())`` where the caller keeps it (a layer, across calls). ``out``
    [R, M, E] (R = :func:`invariant_logit_runs`, contiguous) takes the runs' partial sums, left for the gate to add
    in run order."""
    M, H = x.shape
    E = weight.shape[0]
    if x.dtype != torch.bfloat16:  # the row blocks' tl.sum: its order follows the layout, so one layout of x
        x = _runtime.laid_out_once(x)
        block_m, block_k = block_shape(INVARIANT_ROWS, H)  # the decode kernel's shape for 16 rows, at every M
        _router_logits_kernel[(E, triton.cdiv(M, block_m))](
            x, weight, out, M, H, *x.stride(), *weight.stride(), *out.stride(),
            BLOCK_M=block_m, BLOCK_K=block_k, ROW_BLOCKS=True, num_warps=NUM_WARPS,
        )
        return
    if parts is None:
        parts = bf16_split(weight.float())
    c, runs = INVARIANT_MMA, invariant_runs(H)
    unsummed = out.dim() == 3  # [runs, M, E]: the runs' partial sums are the result
    sums = out if unsummed or runs == 1 else torch.empty(runs, M, E, dtype=torch.float32, device=x.device)
    _router_logits_mma_kernel[(triton.cdiv(M, c.block_m), triton.cdiv(E, c.block_n), runs)](
        x, parts, sums, M, E, H, *x.stride(), *sums.stride()[-2:],
        UPCAST=_runtime.interpreting(), BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=runs,
        num_warps=c.warps, num_stages=c.stages,
    )
    if runs > 1 and not unsummed:
        n = M * E
        _sum_runs_kernel[(triton.cdiv(n, 1024),)](sums, out, n, E, *out.stride(), RUNS=runs, BLOCK=1024,
                                                  num_warps=4)


def takes_mma(num_tokens: int, x_dtype: torch.dtype, w_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`router_logits_mma` computes the logits of ``num_tokens`` rows: ``MMA_MIN_TOKENS`` or more,
    bf16 ``x`` and fp32 ``weight`` (the checkpoints' router), on a GPU or under the interpreter."""
    return (num_tokens >= MMA_MIN_TOKENS and x_dtype == torch.bfloat16 and w_dtype == torch.float32
            and (device.type == "cuda" or _runtime.interpreting()))


def launch_key(num_tokens: int, E: int, H: int, x_dtype: torch.dtype, w_dtype: torch.dtype,
               device: torch.device) -> tuple | None:
    """What decides the router linear's kernel variant at ``num_tokens`` rows (``moefuse.warmup``): the decode
    kernel's block shape, the tensor-core kernel's launch, or None (cuBLAS)."""
    if num_tokens <= MAX_TOKENS:
        return block_shape(num_tokens, H)
    if takes_mma(num_tokens, x_dtype, w_dtype, device):
        return mma_launch(num_tokens, E, _sms(device))
    return None
