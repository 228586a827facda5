"""Weight formats: one typed description per format, which the experts op and the layer pass along.

A plain tensor is a weight in its own dtype (bf16, fp16, fp32). :class:`BlockFP8` is the format DeepSeek-V3/V3.1,
Kimi-K2, GLM-4.5-FP8 and Qwen3-FP8 checkpoints ship their experts in: e4m3 values and one scale per block of
128 x 128, ``w[e, n, k] = values[e, n, k] * scales[e, n // 128, k // 128]`` (SPEC §5 has the numerics of the
experts on it). :class:`MXFP4` is DeepSeek-V4's: e2m1 values two per byte and one power-of-two scale per 32
consecutive K values of a row (SPEC §6). Each stage keeps what it does with a format in one place
(``experts/fp8/``, ``experts/mxfp4/``), and which of transformers' modules a format takes is in
:mod:`moefuse.hf_formats`: the formats here never name transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Optional, cast

import torch
from typing_extensions import Self

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


def _block_scales(scale_inv: object) -> torch.Tensor:
    """A checkpoint's block ``weight_scale_inv`` in fp32: ue8m0 ones converted, fp32 ones as they are."""
    if not isinstance(scale_inv, torch.Tensor):
        raise TypeError(f"scale_inv must be a torch.Tensor, got {type(scale_inv).__name__}")
    return ue8m0_to_float(scale_inv) if scale_inv.dtype in (torch.float8_e8m0fnu, torch.uint8) else scale_inv


class QuantizedWeight:
    """What the weight formats share: ``values`` and ``scales`` tensors with experts in dim 0."""

    values: torch.Tensor
    scales: torch.Tensor
    tile_dtype: ClassVar[torch.dtype]  # keys the experts' tile choice (``configs.pick``)
    row_step: ClassVar[int]  # where rows (N) may be cut without splitting a scale
    col_step: ClassVar[int]  # where columns (K) may be cut likewise
    # The activation precisions the experts take with this format (``moe_experts(activation_quant=...)``), its
    # default first: None, activations as given (hidden's dtype); "fp8", e4m3 per token and 128 columns (SPEC §5).
    activation_quants: ClassVar[tuple[Optional[str], ...]]
    activation_dtypes: ClassVar[tuple[torch.dtype, ...]]  # what ``hidden`` may be with this format

    if TYPE_CHECKING:  # what every format (a dataclass of these two fields) provides

        def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None: ...

        @property
        def shape(self) -> torch.Size: ...

        @classmethod
        def quantize(cls, weight: torch.Tensor) -> Self: ...

        def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    @classmethod
    def unchecked(cls, values: torch.Tensor, scales: torch.Tensor) -> Self:
        """Built without the checks of the constructor: for the tensors of an instance already checked (the ops
        rebuild one from its tensors; an MXFP4's check reads its scales back from the device)."""
        weight = object.__new__(cls)
        object.__setattr__(weight, "values", values)
        object.__setattr__(weight, "scales", scales)
        return weight

    @property
    def device(self) -> torch.device:
        return self.values.device

    def __getitem__(self, index: int | slice | torch.Tensor) -> Self:
        """Experts ``index`` (dim 0) of both tensors."""
        values, scales = self.values[index], self.scales[index]
        if values.dim() == 2:
            values, scales = values[None], scales[None]
        return type(self)(values, scales)

    @classmethod
    def cat_rows(cls, parts: list[Self]) -> Self:
        """The parts' rows (dim 1) one after the other, as one weight (new tensors)."""
        return cls(torch.cat([p.values for p in parts], 1), torch.cat([p.scales for p in parts], 1))

    def rows(self, start: int, stop: int) -> Self:
        """Rows ``[start, stop)`` (dim 1, N) of every expert, as a view; cuts at multiples of :attr:`row_step`."""
        return self._cut(1, start, stop, self.row_step)

    def cols(self, start: int, stop: int) -> Self:
        """Columns ``[start, stop)`` (dim 2, K: what the weight multiplies) of every expert, as a view."""
        return self._cut(2, start, stop, self.col_step)

    def _cut(self, dim: int, start: int, stop: int, step: int) -> Self:
        size = self.shape[dim]
        if not (0 <= start < stop <= size and start % step == 0 and (stop % step == 0 or stop == size)):
            raise ValueError(f"{type(self).__name__}: dim {dim} can only be cut at multiples of {step} (the scale "
                             f"blocks), got [{start}, {stop}) of {size}")
        stored = self.values.shape[dim]  # stored values along dim: size, or size / 2 for packed MXFP4 K
        values = self.values.narrow(dim, start * stored // size, (stop - start) * stored // size)
        first, last = start // step, -(-stop // step)  # the step is the scale's span, so its blocks cut with it
        return type(self)(values, self.scales.narrow(dim, first, last - first))



@dataclass(frozen=True, eq=False)
class BlockFP8(QuantizedWeight):
    """Expert weights in e4m3 with one fp32 scale per [128, 128] block.

    ``values`` [E, N, K] ``float8_e4m3fn``; ``scales`` [E, ceil(N/128), ceil(K/128)] fp32 (blocks at the edges of N
    and K cover what is left). Build it with :meth:`from_checkpoint` (which also takes ue8m0 scales) or
    :meth:`quantize`.
    """

    values: torch.Tensor
    scales: torch.Tensor
    tile_dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn  # the GEMMs' operands: keys the tile choice
    row_step: ClassVar[int] = BLOCK
    col_step: ClassVar[int] = BLOCK
    activation_quants: ClassVar[tuple[Optional[str], ...]] = ("fp8",)  # W8A8 only
    activation_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float16)

    def __post_init__(self) -> None:
        values = _checks.check_tensor("values", self.values, dtypes=(torch.float8_e4m3fn,), ndim=3)
        E, N, K = values.shape
        _checks.check_tensor("scales", self.scales, dtypes=(torch.float32,),
                             shape=(E, math.ceil(N / BLOCK), math.ceil(K / BLOCK)), device=values.device)

    @classmethod
    def from_checkpoint(cls, values: torch.Tensor, scale_inv: torch.Tensor) -> BlockFP8:
        """From a checkpoint's ``weight`` and ``weight_scale_inv`` (fp32, or ue8m0 as float8_e8m0fnu / uint8)."""
        return cls(values, _block_scales(scale_inv))

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

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``values * scales`` per block, [E, N, K] in ``dtype``."""
        E, N, K = self.values.shape
        scales = self.scales.to(dtype).repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :N, :K]
        return self.values.to(dtype) * scales


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by code
MX_GROUP = 32  # K values per MXFP4 scale
# ue8m0 exponents the kernels take (SPEC §6): scales 2^-127 .. 2^1. The kernels scale each unpacked weight by one
# bf16 multiply by 2^(e - 1) (experts/mxfp4/kernels.py), a bf16 up to e = 128. 255 is NaN.
MXFP4_EXPONENTS = (0, 128)


def ue8m0_of(scales: torch.Tensor) -> torch.Tensor:
    """ue8m0 exponents (uint8, 2^(e - 127)) of ``float8_e8m0fnu``/uint8 exponents or fp32 powers of two."""
    if scales.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return scales.view(torch.uint8)
    if scales.dtype != torch.float32:
        raise TypeError(f"MXFP4 scales must be float8_e8m0fnu, uint8 exponents or fp32, got {scales.dtype}")
    mantissa, exponent = torch.frexp(scales)
    if not bool(((mantissa == 0.5) & (exponent - 1 >= -127) & (exponent - 1 <= 127)).all()):
        raise ValueError("MXFP4 scales given as fp32 must all be powers of two in [2^-127, 2^127]")
    return (exponent - 1 + 127).to(torch.uint8)


@dataclass(frozen=True, eq=False)
class MXFP4(QuantizedWeight):
    """Expert weights in MXFP4: e2m1 codes two per byte, one ue8m0 scale per 32 consecutive K values of a row.

    ``values`` [E, N, K/2] int8 or uint8, element ``2j`` in the low nibble of byte j and ``2j + 1`` in the high
    one (a code's bit 3 is the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6); ``scales`` [E, N, K/32] uint8
    exponents: ``w[e, n, k] = E2M1_VALUES[code] * 2^(scales[e, n, k // 32] - 127)``. K must be a multiple of 32
    (every shipped checkpoint's is), and the exponents within :data:`MXFP4_EXPONENTS` (checked once, here: it
    reads the scales back to the host). Build it with :meth:`from_checkpoint` or :meth:`quantize`.
    """

    values: torch.Tensor
    scales: torch.Tensor
    tile_dtype: ClassVar[torch.dtype] = torch.uint8  # packed e2m1: the heuristic's MXFP4 tiles (configs.heuristic)
    row_step: ClassVar[int] = 1  # one scale per row
    col_step: ClassVar[int] = MX_GROUP
    # W4A16 by default, at every batch size (docs/CHOICES.md); "fp8" opts in to W4A8 (SPEC §6)
    activation_quants: ClassVar[tuple[Optional[str], ...]] = (None, "fp8")
    activation_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16,)

    def __post_init__(self) -> None:
        values = _checks.check_tensor("values", self.values, dtypes=(torch.int8, torch.uint8), ndim=3)
        E, N, half_k = values.shape
        if half_k % (MX_GROUP // 2):
            raise ValueError(f"values must be [E, N, K/2] with K a multiple of {MX_GROUP}, got K = {2 * half_k}")
        scales = _checks.check_tensor("scales", self.scales, dtypes=(torch.uint8,),
                                      shape=(E, N, 2 * half_k // MX_GROUP), device=values.device)
        low, high = MXFP4_EXPONENTS
        if scales.numel() and not bool(((scales >= low) & (scales <= high)).all()):
            found = (int(scales.min()), int(scales.max()))
            raise ValueError(f"scales must be ue8m0 exponents in [{low}, {high}] (2^-127 .. 2^1), found {found}")

    @classmethod
    def from_checkpoint(cls, values: torch.Tensor, scale_inv: torch.Tensor) -> MXFP4:
        """From a checkpoint's packed ``weight`` (int8) and ``weight_scale_inv`` (``float8_e8m0fnu``, uint8
        exponents or fp32 powers of two); shares ``values`` (and ue8m0 scales) with the checkpoint."""
        if not isinstance(scale_inv, torch.Tensor):
            raise TypeError(f"scale_inv must be a torch.Tensor, got {type(scale_inv).__name__}")
        return cls(values, ue8m0_of(scale_inv))

    @classmethod
    @torch.no_grad()
    def quantize(cls, weight: torch.Tensor) -> MXFP4:
        """MXFP4 of ``weight`` [E, N, K] (K a multiple of 32): per group of 32, the smallest power-of-two scale
        that puts the amax within 6 (2^-126 for an all-zero group; at most 2, so magnitudes past 12 saturate), codes
        nearest to ``w / scale`` (ties to the lower magnitude). For tests and benchmarks; checkpoints come quantized."""
        E, N, K = weight.shape
        groups = weight.float().reshape(E, N, K // MX_GROUP, MX_GROUP)
        amax = groups.abs().amax(dim=3)
        exps = torch.ceil(torch.log2(amax / 6.0)).nan_to_num(-126.0).clamp(*(e - 127 for e in MXFP4_EXPONENTS))
        scaled = groups / torch.exp2(exps)[..., None]
        grid = torch.tensor(E2M1_VALUES[:8], device=weight.device)
        magnitude = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)
        codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8).reshape(E, N, K)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return cls(packed, (exps + 127).to(torch.uint8))

    @property
    def shape(self) -> torch.Size:
        """[E, N, K]: the unpacked weight's shape."""
        E, N, half_k = self.values.shape
        return torch.Size((E, N, 2 * half_k))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights [E, N, K] in ``dtype``: a 16-entry table of the codes times the scales, in fp32 (exact: two
        significant bits; a product past fp32's, and bf16's, range is inf), then cast (exact to bf16 or wider)."""
        packed = self.values.view(torch.uint8)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
        scales = torch.exp2(self.scales.float() - 127)  # exact: powers of two within fp32's normals
        return (table[codes] * scales.repeat_interleave(MX_GROUP, dim=2)).to(dtype)


ExpertWeight = torch.Tensor | BlockFP8 | MXFP4


def tile_dtype(weight: ExpertWeight, activation_dtype: torch.dtype) -> torch.dtype:
    """The dtype that keys the experts' tile choice (``configs.pick``): a format's operand type, or the
    activations' for a plain tensor."""
    return activation_dtype if isinstance(weight, torch.Tensor) else weight.tile_dtype


class LayerFormat:
    """A weight format as a layer builds, names, loads and checks it: the layer asks its format and never names one
    (``MoELayer(quant=..., shared_quant=...)`` look theirs up in :data:`LAYER_FORMATS`). This base is the plain
    format: one parameter per projection, in the activations' dtype.

    Each projection's tensors are named as transformers names a checkpoint's (``gate_up_proj`` and, with scales,
    ``gate_up_proj_scale_inv``; a shared expert's ``weight`` and ``weight_scale_inv``), so a state dict loads as it
    ships. The typed weight the experts op takes (a tensor, :class:`BlockFP8`, :class:`MXFP4`) is :meth:`weight`'s.
    """

    name: ClassVar[Optional[str]] = None  # what ``quant`` / ``shared_quant`` say
    suffixes: ClassVar[tuple[str, ...]] = ("",)  # each parameter's name after the projection's
    activation_dtypes: ClassVar[Optional[tuple[torch.dtype, ...]]] = None  # None: the weights' own dtype
    width_step: ClassVar[int] = 1  # H and I must be multiples of this
    shared_width_step: ClassVar[Optional[int]] = 1  # a shared expert's width; None: no shared expert takes it
    implied_shared: ClassVar[Optional[str]] = None  # the shared expert's format beside these routed experts
    split_step: ClassVar[int] = 1  # where I may be cut between ranks (expert TP) without splitting a scale
    stored_dtype: ClassVar[Optional[torch.dtype]] = None  # a checkpoint's values (None: any float dtype)
    values_per_element: ClassVar[int] = 1  # K values per stored element along K (packed formats)
    weight_type: ClassVar[type] = torch.Tensor  # the class :meth:`weight` returns

    @property
    def quantized(self) -> bool:
        return len(self.suffixes) > 1

    def params(self, E: int, N: int, K: int, dtype: torch.dtype, device: torch.device | str | None
               ) -> tuple[torch.nn.Parameter, ...]:
        """Empty parameters of ``E`` projections [N, K], in the order of :attr:`suffixes`."""
        return (torch.nn.Parameter(torch.empty(E, N, K, dtype=dtype, device=device)),)

    def weight(self, *tensors: torch.Tensor) -> ExpertWeight:
        """The weight the experts op takes, over ``tensors`` (the parameters, in the order of :attr:`suffixes`)."""
        return tensors[0]

    def check(self, *tensors: torch.Tensor) -> None:
        """Check loaded ``tensors`` for what the forward does not (it would read the device); ValueError if bad."""

    def checkpoint_scales(self, values: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """A checkpoint's ``*_scale_inv`` of ``values`` as the layer keeps it (shared where it can be)."""
        raise ValueError(f"{self.name!r} weights have no scales")


class BlockFP8Format(LayerFormat):
    """:class:`BlockFP8` (SPEC §5): e4m3 values and fp32 scales per 128 x 128 block, activations bf16 or fp16."""

    name = "fp8"
    suffixes = ("", "_scale_inv")
    activation_dtypes = BlockFP8.activation_dtypes
    shared_width_step = BLOCK  # a checkpoint's gate and up blocks are separate: the [gate; up] seam on a block edge
    implied_shared = "fp8"
    split_step = BLOCK
    stored_dtype = torch.float8_e4m3fn
    weight_type = BlockFP8

    def params(self, E: int, N: int, K: int, dtype: torch.dtype, device: torch.device | str | None
               ) -> tuple[torch.nn.Parameter, ...]:
        values = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=device)
        scales = torch.empty(E, math.ceil(N / BLOCK), math.ceil(K / BLOCK), dtype=torch.float32, device=device)
        return torch.nn.Parameter(values, requires_grad=False), torch.nn.Parameter(scales, requires_grad=False)

    def weight(self, *tensors: torch.Tensor) -> ExpertWeight:
        return BlockFP8(*tensors)

    def checkpoint_scales(self, values: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """fp32 scales (ue8m0 ones converted: a small new tensor; fp32 ones shared). transformers allocates at least
        two block rows for a fused gate_up projection (``min_sf_out=2``) even when 2I fits one block: the rows past
        ``ceil(N/128)`` are not part of the format and are left out."""
        return _block_scales(scale_inv)[..., : -(-values.shape[-2] // BLOCK), :]


class MXFP4Format(LayerFormat):
    """:class:`MXFP4` (SPEC §6): packed e2m1 values (int8, as transformers stores them) and ue8m0 scales, bf16
    activations; H and I multiples of 32. No checkpoint ships an MXFP4 shared expert."""

    name = "mxfp4"
    suffixes = ("", "_scale_inv")
    activation_dtypes = MXFP4.activation_dtypes
    width_step = MX_GROUP
    shared_width_step = None
    implied_shared = "fp8"  # as DeepSeek-V4 ships it
    split_step = MX_GROUP
    stored_dtype = torch.int8  # as transformers stores packed e2m1
    values_per_element = 2
    weight_type = MXFP4

    def params(self, E: int, N: int, K: int, dtype: torch.dtype, device: torch.device | str | None
               ) -> tuple[torch.nn.Parameter, ...]:
        values = torch.empty(E, N, K // 2, dtype=torch.int8, device=device)
        scales = torch.empty(E, N, K // MX_GROUP, dtype=torch.float8_e8m0fnu, device=device)
        return torch.nn.Parameter(values, requires_grad=False), torch.nn.Parameter(scales, requires_grad=False)

    def weight(self, *tensors: torch.Tensor) -> ExpertWeight:
        values, scales = tensors
        return MXFP4.unchecked(values, scales.view(torch.uint8))  # checked when loaded: :meth:`check`

    def check(self, *tensors: torch.Tensor) -> None:
        values, scales = tensors
        MXFP4(values, scales.view(torch.uint8))  # the exponents' range (reads the scales back to the host)

    def checkpoint_scales(self, values: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """ue8m0 scales as the layer keeps them: a view of ue8m0 ones, fp32 powers of two converted once."""
        return ue8m0_of(scale_inv).view(torch.float8_e8m0fnu)


# What ``quant`` and ``shared_quant`` may say (the keys of :data:`LAYER_FORMATS`, spelled out for type checkers): a
# shared expert takes the formats whose ``shared_width_step`` is not None (no checkpoint ships an MXFP4 one).
Quant = Literal[None, "fp8", "mxfp4"]
SharedQuant = Literal[None, "fp8"]

LAYER_FORMATS: dict[Optional[str], LayerFormat] = {f.name: f for f in (LayerFormat(), BlockFP8Format(), MXFP4Format())}


def format_of_stored(dtype: torch.dtype) -> LayerFormat:
    """The format whose checkpoints store values in ``dtype`` (the plain format for any other)."""
    for fmt in LAYER_FORMATS.values():
        if fmt.stored_dtype == dtype:
            return fmt
    return LAYER_FORMATS[None]


def layer_format(name: object, argument: str = "quant") -> LayerFormat:
    """The format ``name`` says (None, "fp8", "mxfp4"); a ValueError naming ``argument`` for any other."""
    if name not in LAYER_FORMATS:
        raise ValueError(f"{argument} must be one of {tuple(LAYER_FORMATS)}, got {name!r}")
    return LAYER_FORMATS[cast(Optional[str], name)]


ACTIVATION_QUANTS = ("default", None, "fp8")  # what ``activation_quant`` may say


def resolve_activation_quant(weight: ExpertWeight, activation_quant: object) -> Optional[str]:
    """The activation precision the experts run with on ``weight``: None (activations as given) or "fp8" (e4m3
    per token and 128 columns, SPEC §5). ``"default"`` is the format's own (plain tensors and MXFP4: None; BlockFP8:
    "fp8"); a precision the format has no kernels for is a ValueError naming ``activation_quant``."""
    if activation_quant not in ACTIVATION_QUANTS:
        raise ValueError(f"activation_quant must be one of {ACTIVATION_QUANTS}, got {activation_quant!r}")
    takes = (None,) if isinstance(weight, torch.Tensor) else weight.activation_quants
    if activation_quant == "default":
        return takes[0]
    if activation_quant not in takes:
        name = "plain tensors" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"activation_quant={activation_quant!r} is not available for {name} weights; they take "
                         f"{takes}")
    return cast(Optional[str], activation_quant)
