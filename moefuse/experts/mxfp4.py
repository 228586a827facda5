"""Triton grouped GEMMs of the routed experts on MXFP4 weights (W4A16, SPEC §6).

Contract (inputs validated by :func:`moefuse.experts.moe_experts`):

- ``hidden`` [M, H] bf16, any strides; ``gate_up`` and ``down``: :class:`moefuse.formats.MXFP4` ([E, 2I, H] and
  [E, H, I] unpacked: e2m1 codes two per byte, one ue8m0 exponent per 32 K values of a row); ``plan`` as for the
  bf16 kernels. GEMM1 writes the intermediate [M·K, I] in bf16, GEMM2 ``out`` [M·K, H] in bf16.

The kernels are the bf16 ones (``kernel.py``: same grid, tile order, gathered activation rows, SwiGLU epilogue)
with one change: each weight tile is read packed (half a byte per weight, plus a byte of scale per 32) and goes
to ``tl.dot_scaled`` (bf16 activations, e2m1 weights with ue8m0 scales). On Hopper, which has no FP4 tensor
cores, Triton unpacks the tile in registers to bf16, ``code value x 2^(e - 127)`` (exact for the exponents the
format allows, 1..252: SPEC §6 says what it gave outside them), and runs bf16 MMAs. No dequantized copy of a weight is
ever written. A first version built each bf16 weight from bits with Triton integer ops: 12 instructions per
weight in the main loop (sm_90 SASS), 4.7x the read floor at 16 and 128 tokens on an H200; Triton's own
conversion works on eight codes per 32-bit register.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _runtime
from ..dispatch import DispatchPlan
from ..formats import MX_GROUP, MXFP4
from .configs import GemmTiles
from .kernel import _program_start, _round, _tile_span, weight_descriptor


@triton.jit
def _dot(a, packed, exponents, acc, INTERPRETED: tl.constexpr):
    """``acc + a @ w``: bf16 ``a`` [BLOCK_M, BLOCK_K], ``w`` from packed codes [BLOCK_K / 2, BLOCK_N] and exponents
    [BLOCK_N, BLOCK_K / 32] (``tl.dot_scaled``). Triton's interpreter runs ``tl.dot_scaled`` on a bf16 operand
    rounded to fp16 (activations past 65504 become inf, below 2^-24 zero), so there the weights are unpacked here,
    exactly, and multiplied in fp32."""
    if INTERPRETED:
        codes = packed.to(tl.int32)
        codes = tl.join(codes & 0xF, codes >> 4).permute(0, 2, 1).reshape(2 * packed.shape[0], packed.shape[1])
        magnitude = codes & 7  # 0, 0.5, 1, 1.5, 2, 3, 4, 6: 2^(c/2 - 1) (1 + (c & 1) / 2) for c >= 2
        value = tl.where(magnitude >= 2, tl.exp2((magnitude >> 1).to(tl.float32) - 1.0) * (1.0 + 0.5 * (magnitude & 1)),
                         0.5 * magnitude)
        value = tl.where((codes & 8) != 0, -value, value)
        scale = tl.exp2(exponents.to(tl.float32) - 127.0).T  # [BLOCK_K / 32, BLOCK_N]
        groups = tl.broadcast_to(scale[:, None, :], (scale.shape[0], 32, scale.shape[1])).reshape(value.shape)
        return tl.dot(a.to(tl.float32), value * groups, acc, input_precision="ieee")
    return tl.dot_scaled(a, None, "bf16", packed, exponents, "e2m1", acc)


@triton.jit
def _weight_tile(w_desc, w_ptrs, s_ptrs, row, k0, K, kp, kg, stride_wk, stride_sk, W_TMA: tl.constexpr):
    """The packed weight tile at K offset ``k0`` as ``tl.dot_scaled`` takes it: codes [BLOCK_K / 2, BLOCK_N] (uint8,
    two per byte along K) and exponents [BLOCK_N, BLOCK_K / 32]. Rows ``row ..`` of the packed [E·N, K/2] view
    through TMA (zeros past K), else through ``w_ptrs`` [BLOCK_N, BLOCK_K / 2] (masked past K)."""
    if W_TMA:
        packed = w_desc.load([row, k0 // 2])
    else:
        packed = tl.load(w_ptrs + (k0 // 2) * stride_wk, mask=(kp < (K - k0) // 2)[None, :], other=0)
    # Groups past K hold code 0, zero whatever their exponent.
    exponents = tl.load(s_ptrs + (k0 // 32) * stride_sk, mask=(kg < (K - k0) // 32)[None, :], other=127)
    return packed.T, exponents


@triton.jit(do_not_specialize=["num_tiles"])
def _gemm1_mxfp4_kernel(
    hidden_ptr, w_ptr, w_desc, ws_ptr, inter_ptr,
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, p2e_ptr,
    num_tiles, N, K, top_k, limit,
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_im, stride_in,
    HAS_LIMIT: tl.constexpr, EMULATE_RTNE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, W_TMA: tl.constexpr, USE_PDL: tl.constexpr,
):
    """intermediate[rows, n] = SwiGLU(x @ W[e, n]^T, x @ W[e, N + n]^T), W unpacked per tile. N = I, K = H."""
    tile, col_block, expert = _program_start(num_tiles, N, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                                             BLOCK_M, BLOCK_N, GROUP_M, USE_PDL)
    if expert < 0:
        return
    _, rows, row_ok, a_rows, cols, col_ok, wrapped = _tile_span(
        tile, col_block, expert, N, tile_row_start_ptr, expert_offsets_ptr, BLOCK_M, BLOCK_N)
    tokens = (tl.load(p2e_ptr + a_rows) // top_k).to(tl.int64)
    wrapped = wrapped.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    kp = tl.arange(0, BLOCK_K // 2)
    kg = tl.arange(0, BLOCK_K // 32)
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + wrapped[:, None] * stride_wn + kp[None, :] * stride_wk
    up_ptrs = gate_ptrs + N * stride_wn
    gate_s_ptrs = ws_ptr + expert.to(tl.int64) * stride_se + wrapped[:, None] * stride_sn + kg[None, :] * stride_sk
    up_s_ptrs = gate_s_ptrs + N * stride_sn
    gate_row = expert * 2 * N + col_block * BLOCK_N  # first weight row of the tile in the [E·2N, K/2] view
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(hidden_ptr + tokens[:, None] * stride_hm + (k0 + ks)[None, :] * stride_hk,
                    mask=(ks < K - k0)[None, :], other=0.0)
        gate_w, gate_e = _weight_tile(w_desc, gate_ptrs, gate_s_ptrs, gate_row, k0, K, kp, kg, stride_wk, stride_sk,
                                      W_TMA)
        up_w, up_e = _weight_tile(w_desc, up_ptrs, up_s_ptrs, gate_row + N, k0, K, kp, kg, stride_wk, stride_sk,
                                  W_TMA)
        acc_gate = _dot(a, gate_w, gate_e, acc_gate, EMULATE_RTNE)
        acc_up = _dot(a, up_w, up_e, acc_up, EMULATE_RTNE)

    if HAS_LIMIT:  # DeepSeek-V4: clamp before the activation and the product
        acc_gate = tl.minimum(acc_gate, limit)
        acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_im + cols[None, :] * stride_in
    tl.store(out_ptrs, _round(act, inter_ptr.dtype.element_ty, EMULATE_RTNE), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_tiles"])
def _gemm2_mxfp4_kernel(
    inter_ptr, w_ptr, w_desc, ws_ptr, out_ptr,
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
    num_tiles, N, K,
    stride_im, stride_ik, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om, stride_on,
    EMULATE_RTNE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, W_TMA: tl.constexpr, USE_PDL: tl.constexpr,
):
    """out[rows, n] = intermediate[rows] @ down[e, n]^T, down unpacked per tile.  N = H, K = I."""
    tile, col_block, expert = _program_start(num_tiles, N, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                                             BLOCK_M, BLOCK_N, GROUP_M, USE_PDL)
    if expert < 0:
        return
    _, rows, row_ok, a_rows, cols, col_ok, wrapped = _tile_span(
        tile, col_block, expert, N, tile_row_start_ptr, expert_offsets_ptr, BLOCK_M, BLOCK_N)
    wrapped = wrapped.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    kp = tl.arange(0, BLOCK_K // 2)
    kg = tl.arange(0, BLOCK_K // 32)
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + wrapped[:, None] * stride_wn + kp[None, :] * stride_wk
    s_ptrs = ws_ptr + expert.to(tl.int64) * stride_se + wrapped[:, None] * stride_sn + kg[None, :] * stride_sk
    w_row = expert * N + col_block * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(inter_ptr + a_rows[:, None] * stride_im + (k0 + ks)[None, :] * stride_ik,
                    mask=(ks < K - k0)[None, :], other=0.0)
        w, w_e = _weight_tile(w_desc, w_ptrs, s_ptrs, w_row, k0, K, kp, kg, stride_wk, stride_sk, W_TMA)
        acc = _dot(a, w, w_e, acc, EMULATE_RTNE)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, _round(acc, out_ptr.dtype.element_ty, EMULATE_RTNE), mask=row_ok[:, None] & col_ok[None, :])


def mxfp4_tiles(tiles: GemmTiles) -> GemmTiles:
    """The bf16 tile choice (the MMAs are bf16) with BLOCK_K at least one scale group (32)."""
    return GemmTiles(tiles.block_n, max(tiles.block_k, MX_GROUP), tiles.group_m, tiles.num_warps, tiles.num_stages)


def experts_mxfp4(
    hidden: torch.Tensor,
    gate_up: MXFP4,
    down: MXFP4,
    plan: DispatchPlan,
    out: torch.Tensor,
    gemm1_tiles: GemmTiles,
    gemm2_tiles: GemmTiles,
    swiglu_limit: Optional[float] = None,
    *,
    use_pdl: bool = False,
) -> None:
    """Launch GEMM1 + SwiGLU, then GEMM2, on MXFP4 weights into ``out``."""
    num_tiles = plan.tile_expert.numel()
    width, hidden_size = down.shape[2], hidden.shape[1]
    if num_tiles == 0 or width == 0:
        return
    inter = torch.empty(plan.num_rows, width, dtype=hidden.dtype, device=hidden.device)
    interpreting = _runtime.interpreting()
    flags = {"EMULATE_RTNE": interpreting, "USE_PDL": use_pdl}  # EMULATE_RTNE: the interpreter's work-arounds
    launch = {"launch_pdl": True} if use_pdl else {}
    t1, t2 = mxfp4_tiles(gemm1_tiles), mxfp4_tiles(gemm2_tiles)
    w1, w2 = gate_up.values.view(torch.uint8), down.values.view(torch.uint8)
    desc1 = weight_descriptor(w1, t1.block_n, t1.block_k // 2)
    _gemm1_mxfp4_kernel[(num_tiles * triton.cdiv(width, t1.block_n),)](
        hidden, w1, w1 if desc1 is None else desc1, gate_up.scales, inter,
        plan.tile_expert, plan.tile_row_start, plan.expert_offsets, plan.permuted_to_expanded,
        num_tiles, width, hidden_size, plan.top_k, 0.0 if swiglu_limit is None else float(swiglu_limit),
        hidden.stride(0), hidden.stride(1), *w1.stride(), *gate_up.scales.stride(), *inter.stride(),
        HAS_LIMIT=swiglu_limit is not None, BLOCK_M=plan.block_m, BLOCK_N=t1.block_n, BLOCK_K=t1.block_k,
        GROUP_M=t1.group_m, W_TMA=desc1 is not None, num_warps=t1.num_warps, num_stages=t1.num_stages,
        **flags, **launch,
    )
    desc2 = weight_descriptor(w2, t2.block_n, t2.block_k // 2)
    _gemm2_mxfp4_kernel[(num_tiles * triton.cdiv(hidden_size, t2.block_n),)](
        inter, w2, w2 if desc2 is None else desc2, down.scales, out,
        plan.tile_expert, plan.tile_row_start, plan.expert_offsets,
        num_tiles, hidden_size, width,
        *inter.stride(), *w2.stride(), *down.scales.stride(), *out.stride(),
        BLOCK_M=plan.block_m, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, GROUP_M=t2.group_m,
        W_TMA=desc2 is not None, num_warps=t2.num_warps, num_stages=t2.num_stages, **flags, **launch,
    )
