"""Triton grouped GEMMs of the routed experts on MXFP4 weights (W4A16, SPEC §6).

Contract (inputs validated by :func:`moefuse.experts.moe_experts`):

- ``hidden`` [M, H] bf16, any strides; ``gate_up`` and ``down``: :class:`moefuse.formats.MXFP4` ([E, 2I, H] and
  [E, H, I] unpacked: e2m1 codes two per byte, one ue8m0 exponent per 32 K values of a row); ``plan`` as for the
  bf16 kernels. GEMM1 writes the intermediate [M·K, I] in bf16, GEMM2 ``out`` [M·K, H] in bf16.

The kernels follow the bf16 ones (``bf16.py``: same grid, tile order, gathered activation rows, SwiGLU
epilogue) with two changes. Each weight tile is read packed, as int32 words of eight codes (half a byte per
weight, plus a byte of scale per 32), and unpacked in registers to bf16 ``value(code) * 2^(e - 127)``, exact, by
a few bit operations and one bf16 multiply per pair of weights (``_UNPACK_ASM``; Hopper has no FP4 tensor cores).
And the MMA is swapped, ``(W x^T)^T``: the unpacked weights are its first operand, taken from registers, the
activations its second, so a decode tile's 16 or 32 rows are the MMA's N rather than rows padded to 64.

The K order is the registers' (``_mma_order``): the unpacking pairs weight k + j with k + j + 4 of each word (one
shift places both), and within each group of 32 the pairs are laid out so that the four pairs a thread holds of a
row in the MMA's first operand are the four pairs of one word. So each thread unpacks whole words straight into
its operand registers, with no trip through shared memory, and the activation tile is permuted to the same order
(``_paired``; the dot product does not depend on the order). No dequantized copy of a weight is ever written, and
the packed tensors are read as the checkpoint ships them (no re-layout).

Why this unpacking: on one H200 (DeepSeek-V4-Flash at 16 tokens, 2026-12-01) it ran at 1.8x the weights' read
floor against 3.7x for ``tl.dot_scaled`` and 4.7x for weights built with Triton integer ops; the alternatives and
their figures are in docs/PERF-NOTES.md. On Hopper the op runs the same work warp-specialized (``ws.py``), and
with ``activation_quant="fp8"`` the W4A8 kernels instead (``w4a8.py``: fp8 MMAs, SPEC §6).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ... import _runtime
from ...dispatch import DispatchPlan
from ...formats import MX_GROUP, MXFP4
from ..common import _program_start, _round, _swiglu, _tile_span, weight_descriptor
from ..configs import GemmTiles


def _unpack_asm(from_exponents: bool = False) -> str:
    """PTX that unpacks one 32-bit word of packed codes (weights k..k+7 of a row, weight k + j in bits 4j..4j+3,
    ``$8``) into four bf16 pairs (``$0``..``$7``), scaled by the bf16x2 multiplier ``$9``; or, ``from_exponents``,
    by one it builds from ``$9``, four exponent bytes each plus 126, and ``$10``, the PRMT selector of this word's
    byte (``0x0404 + 0x1010 * byte``): the byte lands in bits 8-15 and 24-31, one shift right makes both halves
    the bf16 2^(e - 1) (two instructions a word, where the Triton kernels' multiplier took three).

    Pair j holds weights k + j (low half) and k + j + 4 (high half), so one shift by 6 - 4j and a mask place both
    magnitudes (code bits 0-2 -> bf16 bits 6-8: the exponent's two low bits and the mantissa's top one) and a shift
    by 12 - 4j and a mask both signs (bit 3 -> bit 15). The bf16 so built is value(code) * 2^-126 (codes 1 and 0
    land on bf16 subnormals, the rest on normals, all with the same factor); one multiply by 2^(e - 1), exact, makes
    it value(code) * 2^(e - 127). Per 8 weights: 7 shifts, 8 logic ops, 4 bf16x2 multiplies (sm_90 SASS; Triton's
    own e2m1 conversion took about 50). The multiplier 2^(e - 1) is a bf16 for e <= 128, which bounds the exponents
    MXFP4 takes (SPEC §6).
    """

    def masked(reg: str, shift: int, mask: str) -> list[str]:
        if shift == 0:
            return [f"and.b32 {reg}, $8, {mask};"]
        op = "shl" if shift > 0 else "shr"
        return [f"{op}.b32 {reg}, $8, {abs(shift)};", f"and.b32 {reg}, {reg}, {mask};"]

    lines, multiplier = ["{", ".reg .b32 t, u;"], "$9"
    if from_exponents:
        lines += [".reg .b32 m;", "prmt.b32 m, $9, 0, $10;", "shr.b32 m, m, 1;"]
        multiplier = "m"
    for j in range(4):
        lines += [*masked("t", 6 - 4 * j, "0x01C001C0"), *masked("u", 12 - 4 * j, "0x80008000"), "or.b32 t, t, u;",
                  f"mul.rn.bf16x2 t, t, {multiplier};", f"mov.b32 {{${2 * j}, ${2 * j + 1}}}, t;"]
    return "\n" + "\n".join([*lines, "}"]) + "\n"


_UNPACK_ASM: tl.constexpr = tl.constexpr(_unpack_asm())


@triton.jit
def _mma_order(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 8] tensors of weights k = 0..7 of each packed word -> [BLOCK_N, BLOCK_K] in the K order
    of the MMA operand's registers: in each group of 32 columns, weight 8 t + j + 4 b (word t, pair j < 4, half b)
    at 8 j + 2 t + b, so that the four pairs a thread holds of a row are one word's."""
    G: tl.constexpr = BLOCK_K // 32
    p0 = tl.join(v0.reshape(BLOCK_N, G, 4), v4.reshape(BLOCK_N, G, 4))
    p1 = tl.join(v1.reshape(BLOCK_N, G, 4), v5.reshape(BLOCK_N, G, 4))
    p2 = tl.join(v2.reshape(BLOCK_N, G, 4), v6.reshape(BLOCK_N, G, 4))
    p3 = tl.join(v3.reshape(BLOCK_N, G, 4), v7.reshape(BLOCK_N, G, 4))
    pairs = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [BLOCK_N, G, t, b, m, n]: pair j = 2 m + n, half b
    return pairs.permute(0, 1, 4, 5, 2, 3).reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _paired(a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Activations [BLOCK_M, BLOCK_K] in the K order of ``_mma_order``: column 8 t + 4 b + j of each group of 32 at
    8 j + 2 t + b (the weights' order, so the dot product is unchanged)."""
    G: tl.constexpr = BLOCK_K // 32
    return a.reshape(BLOCK_M, G, 4, 2, 4).permute(0, 1, 4, 2, 3).reshape(BLOCK_M, BLOCK_K)


@triton.jit
def _unpack(words, exponents, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """bf16 (fp32 under the interpreter) weights [BLOCK_N, BLOCK_K] of packed ``words`` [BLOCK_N, BLOCK_K / 8]
    (int32) and their ``exponents`` [BLOCK_N, BLOCK_K / 32]: ``value(code) * 2^(e - 127)``, exact."""
    groups = exponents.to(tl.int32)[:, :, None]
    per_word = tl.broadcast_to(groups, (BLOCK_N, BLOCK_K // 32, 4)).reshape(BLOCK_N, BLOCK_K // 8)
    if INTERPRETED:  # no inline assembly: decode each code (table formula) and scale in fp32
        scale = tl.exp2(per_word.to(tl.float32) - 127.0)
        v0 = _code_value(words, 0) * scale
        v1 = _code_value(words, 1) * scale
        v2 = _code_value(words, 2) * scale
        v3 = _code_value(words, 3) * scale
        v4 = _code_value(words, 4) * scale
        v5 = _code_value(words, 5) * scale
        v6 = _code_value(words, 6) * scale
        v7 = _code_value(words, 7) * scale
        weights = _mma_order(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N, BLOCK_K)
    else:
        half = (per_word + 126) << 7  # bf16 bits of 2^(e - 1)
        x0, x4, x1, x5, x2, x6, x3, x7 = tl.inline_asm_elementwise(
            _UNPACK_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, half | (half << 16)], dtype=(tl.bfloat16,) * 8,
            is_pure=True, pack=1)
        weights = _mma_order(x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N, BLOCK_K)
    return weights


@triton.jit
def _code_value(words, k: tl.constexpr):
    """fp32 value of code k (bits 4k..4k+3) of each word: (-1)^s (0, 0.5, 1, 1.5, 2, 3, 4, 6)[m]."""
    code = (words >> (4 * k)) & 0xF
    magnitude = code & 7  # 2^(m/2 - 1) (1 + (m & 1) / 2) for m >= 2, m / 2 below
    value = tl.where(magnitude >= 2, tl.exp2((magnitude >> 1).to(tl.float32) - 1.0) * (1.0 + 0.5 * (magnitude & 1)),
                     0.5 * magnitude.to(tl.float32))
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _dot(a, words, exponents, acc_t, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr):
    """``acc_t + (a @ w)^T``, swapped: the weights [BLOCK_N, BLOCK_K], unpacked in registers, are the MMA's first
    operand and the activations ``a`` [BLOCK_M, BLOCK_K] (bf16) its second, so the 16 or 32 rows of a decode tile
    are the MMA's N, not rows padded to 64. ``acc_t`` is [BLOCK_N, BLOCK_M]; float64 under the interpreter, whose
    fp32 sums (numpy's) follow the operands' shapes, so a row's bits would follow the tile's height: products of a
    decoded weight (two significant bits, scaled) and a bf16 activation are exact in float64, and so are their sums
    over a row of ordinary magnitudes, whatever the order."""
    w = _unpack(words, exponents, INTERPRETED, BLOCK_N, BLOCK_K)
    a = _paired(a, BLOCK_M, BLOCK_K)
    if INTERPRETED:
        acc_t = tl.dot(w.to(tl.float64), a.to(tl.float64).T, acc_t, input_precision="ieee")
    else:
        acc_t = tl.dot(w, a.T, acc_t)
    return acc_t


@triton.jit
def _weight_tile(w_desc, w_ptrs, s_ptrs, row, k0, K, kw, kg, stride_wk, stride_sk, W_TMA: tl.constexpr):
    """The packed weight tile at K offset ``k0``: words [BLOCK_N, BLOCK_K / 8] (int32, eight codes each) and
    exponents [BLOCK_N, BLOCK_K / 32]. Rows ``row ..`` of the [E·N, K/8] view through TMA (zeros past K), else
    through ``w_ptrs`` [BLOCK_N, BLOCK_K / 8] (masked past K)."""
    if W_TMA:
        words = w_desc.load([row, k0 // 8])
    else:
        words = tl.load(w_ptrs + (k0 // 8) * stride_wk, mask=(kw < (K - k0) // 8)[None, :], other=0)
    # Groups past K hold code 0, zero whatever their exponent.
    exponents = tl.load(s_ptrs + (k0 // 32) * stride_sk, mask=(kg < (K - k0) // 32)[None, :], other=127)
    return words, exponents


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
    kw = tl.arange(0, BLOCK_K // 8)
    kg = tl.arange(0, BLOCK_K // 32)
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + wrapped[:, None] * stride_wn + kw[None, :] * stride_wk
    up_ptrs = gate_ptrs + N * stride_wn
    gate_s_ptrs = ws_ptr + expert.to(tl.int64) * stride_se + wrapped[:, None] * stride_sn + kg[None, :] * stride_sk
    up_s_ptrs = gate_s_ptrs + N * stride_sn
    gate_row = expert * 2 * N + col_block * BLOCK_N  # first weight row of the tile in the [E·2N, K/2] view
    ACC: tl.constexpr = tl.float64 if EMULATE_RTNE else tl.float32  # the interpreter's sums: see _dot
    acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=ACC)  # transposed: see _dot
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(hidden_ptr + tokens[:, None] * stride_hm + (k0 + ks)[None, :] * stride_hk,
                    mask=(ks < K - k0)[None, :], other=0.0)
        gate_w, gate_e = _weight_tile(w_desc, gate_ptrs, gate_s_ptrs, gate_row, k0, K, kw, kg, stride_wk, stride_sk,
                                      W_TMA)
        up_w, up_e = _weight_tile(w_desc, up_ptrs, up_s_ptrs, gate_row + N, k0, K, kw, kg, stride_wk, stride_sk,
                                  W_TMA)
        acc_gate = _dot(a, gate_w, gate_e, acc_gate, EMULATE_RTNE, BLOCK_M, BLOCK_N, BLOCK_K)
        acc_up = _dot(a, up_w, up_e, acc_up, EMULATE_RTNE, BLOCK_M, BLOCK_N, BLOCK_K)

    act = _swiglu(acc_gate.to(tl.float32).T, acc_up.to(tl.float32).T, limit, HAS_LIMIT)
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
    kw = tl.arange(0, BLOCK_K // 8)
    kg = tl.arange(0, BLOCK_K // 32)
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + wrapped[:, None] * stride_wn + kw[None, :] * stride_wk
    s_ptrs = ws_ptr + expert.to(tl.int64) * stride_se + wrapped[:, None] * stride_sn + kg[None, :] * stride_sk
    w_row = expert * N + col_block * BLOCK_N
    ACC: tl.constexpr = tl.float64 if EMULATE_RTNE else tl.float32  # the interpreter's sums: see _dot
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=ACC)  # transposed: see _dot
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(inter_ptr + a_rows[:, None] * stride_im + (k0 + ks)[None, :] * stride_ik,
                    mask=(ks < K - k0)[None, :], other=0.0)
        w, w_e = _weight_tile(w_desc, w_ptrs, s_ptrs, w_row, k0, K, kw, kg, stride_wk, stride_sk, W_TMA)
        acc = _dot(a, w, w_e, acc, EMULATE_RTNE, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = acc.to(tl.float32).T
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, _round(acc, out_ptr.dtype.element_ty, EMULATE_RTNE), mask=row_ok[:, None] & col_ok[None, :])


def _words(values: torch.Tensor) -> torch.Tensor:
    """The packed codes as int32 words [E, N, K/8], eight codes each: a view where the bytes allow (a row's bytes
    contiguous, word-aligned), else a contiguous copy."""
    packed = values.view(torch.uint8)
    if packed.stride(2) != 1 or packed.storage_offset() % 4 or any(s % 4 for s in packed.stride()[:2]):
        packed = packed.contiguous()
    return packed.view(torch.int32)


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
    """Launch GEMM1 + SwiGLU, then GEMM2, on MXFP4 weights into ``out`` (W4A16), with the ``tl`` kernels: off
    Hopper, under the interpreter, and where the warp-specialized ones (``ws.py``) do not take the shapes
    (the op chooses)."""
    num_tiles = plan.tile_expert.numel()
    width, hidden_size = down.shape[2], hidden.shape[1]
    if num_tiles == 0 or width == 0:
        return
    inter = torch.empty(plan.num_rows, width, dtype=hidden.dtype, device=hidden.device)
    interpreting = _runtime.interpreting()
    flags = {"EMULATE_RTNE": interpreting, "USE_PDL": use_pdl}  # EMULATE_RTNE: the interpreter's work-arounds
    launch = {"launch_pdl": True} if use_pdl else {}
    t1, t2 = mxfp4_tiles(gemm1_tiles), mxfp4_tiles(gemm2_tiles)
    if hidden.stride(1) != 1:
        # Rows must be read with unit inner stride: with any other, Triton 3.6 fails to compile GEMM1 for sm_90 (in
        # its dot-operand layout conversion of the activation tile that ``_paired`` permutes, at every tile height).
        # A copy of the M x H activations is small next to the weights the GEMMs stream.
        hidden = hidden.contiguous()
    w1, w2 = _words(gate_up.values), _words(down.values)
    desc1 = weight_descriptor(w1, t1.block_n, t1.block_k // 8)
    _gemm1_mxfp4_kernel[(num_tiles * triton.cdiv(width, t1.block_n),)](
        hidden, w1, w1 if desc1 is None else desc1, gate_up.scales, inter,
        plan.tile_expert, plan.tile_row_start, plan.expert_offsets, plan.permuted_to_expanded,
        num_tiles, width, hidden_size, plan.top_k, 0.0 if swiglu_limit is None else float(swiglu_limit),
        hidden.stride(0), hidden.stride(1), *w1.stride(), *gate_up.scales.stride(), *inter.stride(),
        HAS_LIMIT=swiglu_limit is not None, BLOCK_M=plan.block_m, BLOCK_N=t1.block_n, BLOCK_K=t1.block_k,
        GROUP_M=t1.group_m, W_TMA=desc1 is not None, num_warps=t1.num_warps, num_stages=t1.num_stages,
        **flags, **launch,
    )
    desc2 = weight_descriptor(w2, t2.block_n, t2.block_k // 8)
    _gemm2_mxfp4_kernel[(num_tiles * triton.cdiv(hidden_size, t2.block_n),)](
        inter, w2, w2 if desc2 is None else desc2, down.scales, out,
        plan.tile_expert, plan.tile_row_start, plan.expert_offsets,
        num_tiles, hidden_size, width,
        *inter.stride(), *w2.stride(), *down.scales.stride(), *out.stride(),
        BLOCK_M=plan.block_m, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, GROUP_M=t2.group_m,
        W_TMA=desc2 is not None, num_warps=t2.num_warps, num_stages=t2.num_stages, **flags, **launch,
    )
