"""Weight formats: one typed description per format, which the experts op and the layer pass along.

A plain tensor is a weight in its own dtype (bf16, fp16, fp32). :class:`BlockFP8` is the format DeepSeek-V3/V3.1,
Kimi-K2, GLM-4.5-FP8 and Qwen3-FP8 checkpoints ship their experts in: e4m3 values and one scale per block of
128 x 128, ``w[e, n, k] = values[e, n, k] * scales[e, n // 128, k // 128]`` (SPEC §5 has the numerics of the
experts on it). Each stage keeps what it does with a format in one place (``experts/fp8.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moefuse import _checks

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # the block edge of every shipped block-scale checkpoint


def ue8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales as fp32: ``float8_e8m0fnu``, or uint8 biased exponents (2^(e - 127); 255 is NaN)."""
    if exponents.dtype == torch.float8_e8m0fnu:
        exponents = exponents.view(torch.uint8)
    if exponents.dtype != torch.uint8:
        raise TypeError(f"ue8m0 scales must be float8_e8m0fnu or uint8, got {exponents.dtype}")
    e = exponents.to(torch.int32)
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
    return torch.where(e == 255, float("nan"), scale)


@dataclass(frozen=True, eq=False)
class BlockFP8:
    """Expert weights in e4m3 with one fp32 scale per [128, 128] block.

    ``values`` [E, N, K] ``float8_e4m3fn``; ``scales`` [E, ceil(N/128), ceil(K/128)] fp32 (blocks at the edges of N
    and K cover what is left). Build it with :meth:`from_checkpoint` (which also takes ue8m0 scales) or
    :meth:`quantize`.
    """

    values: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        values = _checks.check_tensor("values", self.values, dtypes=(torch.float8_e4m3fn,), ndim=3)
        E, N, K = values.shape
        _checks.check_tensor("scales", self.scales, dtypes=(torch.float32,),
                             shape=(E, math.ceil(N / BLOCK), math.ceil(K / BLOCK)), device=values.device)

    @classmethod
    def from_checkpoint(cls, values: torch.Tensor, scale_inv: torch.Tensor) -> BlockFP8:
        """From a checkpoint's ``weight`` and ``weight_scale_inv`` (fp32, or ue8m0 as float8_e8m0fnu / uint8)."""
        if not isinstance(scale_inv, torch.Tensor):
            raise TypeError(f"scale_inv must be a torch.Tensor, got {type(scale_inv).__name__}")
        if scale_inv.dtype in (torch.float8_e8m0fnu, torch.uint8):
            scale_inv = ue8m0_to_float(scale_inv)
        return cls(values, scale_inv)

    @classmethod
    @torch.no_grad()
    def quantize(cls, weight: torch.Tensor) -> BlockFP8:
        """Block-quantize ``weight`` [E, N, K]: scale = amax / 448 per block (1 for an all-zero block), values
        rounded to nearest e4m3. For tests and benchmarks; checkpoints come quantized."""
        E, N, K = weight.shape
        nb, kb = math.ceil(N / BLOCK), math.ceil(K / BLOCK)
        padded = torch.zeros(E, nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=weight.device)
        padded[:, :N, :K] = weight.float()
        blocks = padded.view(E, nb, BLOCK, kb, BLOCK)
        amax = blocks.abs().amax(dim=(2, 4))
        scales = torch.where(amax > 0, amax / FP8_MAX, 1.0)
        values = (blocks / scales[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return cls(values.view(E, nb * BLOCK, kb * BLOCK)[:, :N, :K].contiguous(), scales)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``values * scales`` per block, [E, N, K] in ``dtype``."""
        E, N, K = self.values.shape
        scales = self.scales.to(dtype).repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :N, :K]
        return self.values.to(dtype) * scales

    def __getitem__(self, index: int | slice | torch.Tensor) -> BlockFP8:
        """Experts ``index`` (dim 0) of both tensors."""
        values, scales = self.values[index], self.scales[index]
        if values.dim() == 2:
            values, scales = values[None], scales[None]
        return BlockFP8(values, scales)


ExpertWeight = torch.Tensor | BlockFP8


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token, per-128-column e4m3 quantization of activations (SPEC §5), in fp32.

    For each row and each group g of 128 columns (the last group covers what is left of the width):
    ``amax = max |x|``; ``scale = amax / 448`` and ``inv = 448 / amax`` (each one fp32 division, rounded to
    nearest); ``q = e4m3(clamp(x * inv, -448, 448))`` rounded to nearest even. An all-zero group has scale 0 and
    quantizes to zeros. NaN propagates (its group's scale is NaN). Returns ``(q [M, W] float8_e4m3fn, scales
    [M, ceil(W / 128)] fp32)``; ``q * scale`` per group approximates ``x``.
    """
    M, W = x.shape
    groups = math.ceil(W / BLOCK)
    padded = torch.zeros(M, groups * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :W] = x.float()
    blocks = padded.view(M, groups, BLOCK)
    amax = blocks.abs().amax(dim=2)
    scale = amax / FP8_MAX
    # A tensor divisor: torch computes ``448.0 / tensor`` as a reciprocal times 448, which rounds twice (a quarter
    # of the quotients off by an ulp, enough to flip the e4m3 rounding of near-ties that bf16 inputs make common).
    inv = torch.where(amax > 0, torch.full_like(amax, FP8_MAX) / amax, 0.0)
    inv = torch.where(amax.isnan(), amax, inv)
    q = (blocks * inv[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(M, groups * BLOCK)[:, :W], scale


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` per row and group of 128 columns: the inverse of :func:`quantize_rows`, in ``dtype``."""
    W = q.shape[1]
    return q.to(dtype) * scales.to(dtype).repeat_interleave(BLOCK, 1)[:, :W]
