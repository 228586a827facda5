"""Tile shapes of the experts' grouped GEMMs: tuned tables as data, a first-principles fallback, overrides.

:func:`pick` is the one source of tile shapes. Its ``block_m`` is the plan's tile height as well, so
callers build the plan with ``moe_dispatch(ids, E, pick_block_m(M, E, H, I, K, dtype))`` and
:func:`moefuse.experts.moe_experts` re-picks the rest of the config for the plan's ``block_m``.

Order of precedence:

1. :func:`override` (a scoped context manager over a ``ContextVar``: thread- and task-safe): tests force
   small tiles with it.
2. For bf16/fp16 on a GPU with a table (``moefuse/configs/experts_h200.json`` for sm90): the entry of
   (E, H, I, K) and its token-count bucket nearest to M on a log scale. ``scripts/tune_experts.py`` writes
   the table; entries marked ``"untuned seed"`` are :func:`heuristic`'s choices written down.
3. :func:`heuristic`, from first principles (see its docstring).

A table entry may also carry ``shared_slot_max_tokens`` (:func:`shared_slot_max_tokens`): a layer-level choice
measured per shape, kept here because it is a per-shape, per-GPU measurement like the tiles.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch

from .. import _runtime

Arch = Optional[tuple[int, int]]
TABLES: dict[Arch, Path] = {(9, 0): Path(__file__).resolve().parent.parent / "configs" / "experts_h200.json"}
NUM_SMS = 132  # H100/H200; the heuristic's target for how many programs keep the GPU busy
HOPPER_SMEM = 227 * 1024  # the most shared memory one block may opt in to on sm_90
SMEM_BUDGET = 212 * 1024  # the heuristic's limit on smem_bytes (an upper model; see there)

TABLE_DTYPES = (torch.bfloat16, torch.float16)  # the tile tables' activations; other dtypes take the heuristic
# fp8 (``experts/fp8/``): at most this many plan rows (M·K, a token to a few), GEMM1 runs 8 warps, and 5 pipeline
# stages where it is one wave of programs; 4 warps and 4 stages from 64 rows. One H100, the experts on quantized
# rows, 8 warps against 4: as fast or faster at one token on every preset (Kimi-K2 with the shared expert's slot
# 153.4 against 163.2 µs, GLM-4.5-Air 60.2 against 65.3), within 0.9 µs at two tokens (docs/PERF-NOTES.md,
# thirty-sixth session).
FP8_FEW_ROWS = 63
# fp8 at decode: GEMM1 split along K into runs of steps, each its own program, where one program per tile and column
# block would leave SMs idle or a short second wave (fp8_split_k), each on at most this many pipeline stages so that
# two share an SM (5 stages of the 8-warp 16-row tile take 115 KB of shared memory). One H200, one token (µs,
# experts): DeepSeek-V3 106.6 -> 103.9 with two runs; with the shared expert's slot (144 programs unsplit) GEMM1
# alone 104.0 -> 82.1 with three (scripts/fp8_decode_probe.py; docs/PERF-NOTES.md, twenty-fourth and twenty-fifth
# sessions).
FP8_SPLIT_STAGES = 3
# fp8 short tiles (below 64 rows: decode) take steps of two K-adjacent 128-deep boxes, on this many pipeline stages
# (two where GEMM1 is split, so that two split programs share an SM; under Triton 3.6 GEMM1 buffers one step fewer
# than its stages, 139 KB at 3). A box's rows are 128 bytes of fp8; two boxes a step read like one 256-byte-wide
# box: DeepSeek-V3's GEMM1 boxes, read with no arithmetic at its one-token launch, 89.9 µs box by box against 82.6 in
# pairs, 76.6 at the floor (one H100; docs/PERF-NOTES.md, thirty-ninth session). A fourth stage and four-box steps
# were no faster (fortieth session).
FP8_PAIR_STAGES = 3
FP8_SPLIT_PAIR_STAGES = 2
FP8_SPLIT_MAX = 4  # the most runs fp8_split_k splits GEMM1's K into (1-4 measured; 5, 6, 8 no faster, fortieth session)
MXFP4_FEW_ROWS = 16  # at most this many routed rows: MXFP4's deeper decode tiles (heuristic, item 7)
# MXFP4's tile heights and the most rows per touched expert each takes before the next is faster (heuristic, item 7);
# more rows take 128-row tiles. (The limits were measured when 128-row tiles ran W4A8; W4A16 now, unless asked.)
MXFP4_HEIGHTS = ((16, 13), (32, 32), (64, 58))


@dataclass(frozen=True)
class GemmTiles:
    """Launch shape of one grouped GEMM (the tile height is :attr:`TileConfig.block_m`)."""

    block_n: int  # output columns per program (GEMM1: of the gate and of the up projection each)
    block_k: int  # reduction step per pipeline stage
    group_m: int  # consecutive tiles that share a column block, run together so weight tiles hit L2 (0: per expert)
    num_warps: int
    num_stages: int  # software-pipeline depth (operand buffers in shared memory)

    def __post_init__(self) -> None:
        for name, low in (("block_n", 16), ("block_k", 16), ("num_warps", 1)):
            _check_pow2(f"GemmTiles.{name}", getattr(self, name), low)
        for name, low in (("group_m", 0), ("num_stages", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"GemmTiles.{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class TileConfig:
    """Tiles of both GEMMs. ``block_m`` rows per tile is shared: it is the dispatch plan's tile height."""

    block_m: int
    gemm1: GemmTiles  # hidden [rows, H] x gate_up_proj[e]^T -> SwiGLU -> intermediate [rows, I]
    gemm2: GemmTiles  # intermediate [rows, I] x down_proj[e]^T -> gemm2_out [rows, H]

    def __post_init__(self) -> None:
        _check_pow2("TileConfig.block_m", self.block_m, 16)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TileConfig:
        return cls(data["block_m"], GemmTiles(**data["gemm1"]), GemmTiles(**data["gemm2"]))


def _check_pow2(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {low}, got {value!r}")


_OVERRIDE: contextvars.ContextVar[Optional[TileConfig]] = contextvars.ContextVar("moefuse_experts_tiles", default=None)


@contextlib.contextmanager
def override(config: TileConfig) -> Iterator[TileConfig]:
    """Within the block, :func:`pick` returns ``config`` for every shape (its block_m replaced by a forced one)."""
    if not isinstance(config, TileConfig):
        raise TypeError(f"config must be a TileConfig, got {type(config).__name__}")
    token = _OVERRIDE.set(config)
    try:
        yield config
    finally:
        _OVERRIDE.reset(token)


def arch_of(device: torch.device) -> Arch:
    """Compute capability of a CUDA device; None on CPU or under Triton's interpreter."""
    if device.type != "cuda" or _runtime.interpreting():
        return None
    return _runtime.capability(device)


def resolve_arch(arch: Union[Arch, Literal["auto"]]) -> Arch:
    """``arch`` itself, or for "auto" the current CUDA device's capability (None without one)."""
    if arch != "auto":
        return arch
    if not torch.cuda.is_available():
        return None
    return arch_of(torch.device("cuda", torch.cuda.current_device()))


def pick(
    M: int, E: int, H: int, I: int, K: int, dtype: torch.dtype,
    arch: Union[Arch, Literal["auto"]] = "auto", *, block_m: Optional[int] = None,
) -> TileConfig:
    """Tile config for M tokens, E experts of width I over model width H, top-K, activations of ``dtype``.

    A pure function of its arguments (and of an active :func:`override`, in eager mode; under
    ``torch.compile`` it is traced, so each token count M compiles its own graph). ``arch`` is a compute capability
    such as (9, 0), None for no GPU (the interpreter), or "auto" for the current CUDA device. ``block_m``
    forces the tile height (the plan's): a table entry with another height is then replaced by the heuristic.
    """
    M = int(M)  # under torch.compile with dynamic shapes: specialize on the token count (a guard per M)
    if torch.compiler.is_compiling():  # traced: no ContextVar, no cache
        return _choose(M, E, H, I, K, dtype, resolve_arch(arch), block_m)
    forced = _OVERRIDE.get()
    if forced is not None:
        return forced if block_m is None else replace(forced, block_m=block_m)
    return _choose_cached(M, E, H, I, K, dtype, resolve_arch(arch), block_m)


def _choose(M: int, E: int, H: int, I: int, K: int, dtype: torch.dtype, arch: Arch,
            block_m: Optional[int]) -> TileConfig:
    config = _from_table(M, E, H, I, K, dtype, arch)
    if config is None or (block_m is not None and config.block_m != block_m):
        config = heuristic(M, E, H, I, K, dtype, block_m=block_m)
    return config


# Eager calls choose once per shape: the table lookup and the heuristic cost tens of µs of host time per call.
_choose_cached = functools.lru_cache(maxsize=4096)(_choose)


def pick_block_m(
    M: int, E: int, H: int, I: int, K: int, dtype: torch.dtype, arch: Union[Arch, Literal["auto"]] = "auto"
) -> int:
    """The dispatch plan's ``block_m`` for these shapes: ``pick(...).block_m``."""
    return pick(M, E, H, I, K, dtype, arch).block_m


def nearest_bucket(buckets: Iterable[int], M: int) -> int:
    """The tuned token count nearest to M on a log scale (M = 0 counts as 1; ties go to the smaller)."""
    target = math.log2(max(M, 1))
    best, best_distance = 0, math.inf
    for bucket in sorted(buckets):  # a plain loop: torch.compile traces it (not min(key=...))
        distance = abs(math.log2(bucket) - target)
        if distance < best_distance:
            best, best_distance = bucket, distance
    return best


def _from_table(M: int, E: int, H: int, I: int, K: int, dtype: torch.dtype, arch: Arch) -> Optional[TileConfig]:
    if dtype not in TABLE_DTYPES:
        return None  # fp32 moves twice the bytes per tile: the tables' tiles would not fit; use the heuristic
    buckets = _INDEX.get(arch, {}).get((E, H, I, K))
    return None if buckets is None else buckets[nearest_bucket(list(buckets), M)]


@functools.cache
def load_table(path: Path) -> dict[str, Any]:
    """A tile table: ``{"entries": [{"E", "H", "I", "K", "status", "buckets": {"<M>": config}}], ...}``.

    One table serves bf16 and fp16 alike (same bytes per element, same tensor-core rate).
    """
    return json.loads(Path(path).read_text())


def _index_table(path: Path) -> dict[tuple[int, int, int, int], dict[int, TileConfig]]:
    """(E, H, I, K) -> {bucket M: config} of a table file; {} when the file is missing."""
    if not path.exists():
        return {}
    return {
        (entry["E"], entry["H"], entry["I"], entry["K"]): {
            int(m): TileConfig.from_dict(config) for m, config in entry["buckets"].items()
        }
        for entry in load_table(path)["entries"]
    }


def _index_shared_slot(path: Path) -> dict[tuple[int, int, int, int], int]:
    """(E, H, I, K) -> an entry's ``shared_slot_max_tokens`` (absent: 0) of a table file."""
    if not path.exists():
        return {}
    return {(e["E"], e["H"], e["I"], e["K"]): int(e.get("shared_slot_max_tokens", 0))
            for e in load_table(path)["entries"]}


# Parsed once at import, so that tracing pick() (torch.compile) reads no files.
_INDEX = {arch: _index_table(path) for arch, path in TABLES.items()}
_SHARED_SLOT = {arch: _index_shared_slot(path) for arch, path in TABLES.items()}


def shared_slot_max_tokens(E: int, H: int, I: int, K: int, arch: Arch) -> int:
    """Up to how many tokens a layer of this shape runs its shared expert as one more slot of the grouped GEMMs.

    A measured, per-shape choice kept in the tile table (``"shared_slot_max_tokens"`` of an entry; 0 when absent,
    and with no table for ``arch``): ``moefuse bench layer`` times both ways at decode sizes.
    """
    return _SHARED_SLOT.get(arch, {}).get((E, H, I, K), 0)


def smem_bytes(block_m: int, tiles: GemmTiles, operands: int, element_size: int) -> int:
    """An upper model of the pipelined operand buffers: ``stages x (A tile + operands x B tile)``.

    The compiler allocates less (sm_90, TMA weights, Triton 3.6 to 3.9): ``stages - 1`` buffers of each weight
    tile, as many of the activation tile for wgmma tiles (64 rows or more) and a single one below. So a launch
    inside this model fits; the heuristic keeps to it. ``scripts/sass.py experts`` reads the compiled size.
    """
    per_stage = block_m * tiles.block_k + operands * tiles.block_k * tiles.block_n
    return tiles.num_stages * per_stage * element_size


def weight_buffer_bytes(tiles: GemmTiles, operands: int, element_size: int) -> int:
    """A lower bound on a TMA launch's shared memory: the ``stages - 1`` weight-tile buffers it always gets.

    A launch above :data:`HOPPER_SMEM` by this bound cannot fit; one below may (the compiler decides).
    """
    return max(1, tiles.num_stages - 1) * operands * tiles.block_k * tiles.block_n * element_size


def _fit(
    block_m: int, n: int, k: int, operands: int, element_size: int, num_tiles: int, *,
    block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int, spread: bool,
) -> GemmTiles:
    """Shrink a wish-list launch to the problem: dims, SM coverage (``spread``), shared memory."""
    block_n = min(block_n, max(16, _next_pow2(n)))
    block_k = min(block_k, max(16, _next_pow2(k)))
    # Memory-bound GEMMs need a program per SM in flight (deep pipelines keep each one streaming).
    while spread and block_n > 64 and num_tiles * -(-n // block_n) < NUM_SMS:
        block_n //= 2
    # Give up pipeline depth beyond 3 first, then long reduction steps, then the last stage, then width.
    while smem_bytes(block_m, GemmTiles(block_n, block_k, group_m, num_warps, num_stages), operands,
                     element_size) > SMEM_BUDGET:
        if num_stages > 3:
            num_stages -= 1
        elif block_k > 64:
            block_k //= 2
        elif num_stages > 2:
            num_stages -= 1
        elif block_k > 16:
            block_k //= 2
        else:
            block_n //= 2
    return GemmTiles(block_n, block_k, group_m, num_warps, num_stages)


def _next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1))))


def heuristic(
    M: int, E: int, H: int, I: int, K: int, dtype: torch.dtype, *, block_m: Optional[int] = None
) -> TileConfig:
    """First-principles tiles for a Hopper-class GPU (any GPU gets a valid, if untuned, config).

    1. Tile height: the average rows per touched expert, ``M*K / min(E, M*K)``, rounded up to a power of
       two in [16, 128] ([16, 32] in fp32, item 4). Each tile reads its expert's whole weight slab, so a tile
       much taller than an expert's rows wastes tensor-core work, and a much shorter one re-reads the weights.
    2. Short tiles (<= 32 rows: decode and small batches) are bound by reading the weights once: long
       reduction steps (BLOCK_K 128) and BLOCK_N 128, halved (down to 64) until there is a program per SM;
       GEMM1 8 warps and 3 stages (two weight operands), GEMM2 4 warps and 4 stages. Tuning DeepSeek-V3,
       Kimi-K2 and DeepSeek-V4 at M = 1 and 16 on an H200 picked BLOCK_N 128 for 4 of the 6 GEMM1s (64 for
       DeepSeek-V4) and all 6 GEMM2s, and BLOCK_K 128 for 8 of the 12 (64 for the rest); the earlier seed
       (BLOCK_N 32-64, two programs per SM) cost Kimi-K2's layer 20 µs at M = 1.
    3. Tall tiles (prefill) are bound by tensor-core throughput: 8 warps, BLOCK_N 128 (GEMM1 keeps gate and
       up accumulators) or 256 (GEMM2, one accumulator, when 128 rows tall), BLOCK_K 64, 4 stages (TMA
       weight loads leave room for them: 224 KB compiled with the 64-row tail piece of 128-row tiles, see
       ``bf16.py``; ``smem_bytes`` models one tile height), and each expert's tiles one group sharing a column block
       (GROUP_M 0), so its weight tiles are read from L2 by all its tiles however skewed the routing (DeepSeek-V3
       on an H200, against groups of 4: within noise to 3% faster at 4096 tokens, uniform and skewed, 5% at 8192).
    4. fp32 operands take IEEE products on the FMA units, not the tensor cores, so the operand tiles live in
       registers: tiles of at most 32 rows, BLOCK_N 64, BLOCK_K 32, 8 warps. Compiled for sm_90, those are
       the largest that do not spill (``scripts/sass.py experts``; the 16-bit tiles above spilled up to 23 KB
       per thread in fp32).
    5. Every block is capped by its dimension (next power of two, at least 16: the smallest ``tl.dot``);
       stages and BLOCK_K shrink until the operand buffers fit in shared memory.
    6. fp8 block-scale weights (``dtype`` float8_e4m3fn, ``experts/fp8/kernels.py``): BLOCK_K 128 (one scale step) and
       GEMM1's BLOCK_N 128 (one intermediate scale group); tiles of 16 rows up to 16 rows per expert, else 64.
       16-row tiles step through K two K-adjacent 128-deep boxes at a time (BLOCK_K 256), 3 pipeline stages in
       both GEMMs (``FP8_PAIR_STAGES``; 2 in a split GEMM1): each box still promoted on its own, so the same sums.
       One H100, the op against one-box steps in interleaved fresh processes (thirty-ninth session, µs at 1 / 16 /
       128 tokens): DeepSeek-V3 135.6 -> 130.4 / 1,552.5 -> 1,486.7 / 3,826.7 -> 3,655.6; Kimi-K2 136.0 -> 131.9 /
       1,716.0 -> 1,645.3 / 5,428.2 -> 5,187.7; GLM-4.5-Air 60.4 -> 59.8 / 540.7 -> 524.6 / 785.4 -> 760.2;
       Qwen3-30B-A3B 24.0 -> 23.8 / 157.8 -> 153.7 / 225.8 -> 219.3; DeepSeek-V4-Flash 0.9% slower at one token
       (66.5 -> 67.1, within its spread between processes), 719.1 -> 686.5 at 16 and 2,138.4 -> 2,047.0 at 128.
       The rest of this item was measured on one-box steps (its stage counts now hold for 64-row tiles only):
       GEMM1 8 warps where it quantizes its own activations or the tiles are tall, else 4 (swept on an H200: 4 warps
       and 4 stages saved 2% at 16 and 128 tokens); GEMM1 5 stages where it quantizes its own activations and its
       programs fit one wave on the SMs (a token or a few: one program per SM streams its weight tiles, and more of
       them in flight paid; DeepSeek-V3 experts at M = 1, 128 programs: 107–108 against 132–133 µs for 4 stages,
       three fresh processes each), else 4 (the DeepSeek-V3 layer at M = 1 runs its shared expert as a ninth slot,
       144 programs: 149 µs against 183 for 5 stages); GEMM2 4 warps (at 64 rows, DeepSeek-V3: 1,854 against 1,971 µs at
       4096 tokens, 750 against 939 at 1024); tall tiles grouped per expert (GROUP_M 0: an expert's tiles share its
       weight tiles through L2 however many it has; 5,605 against 5,665 µs for groups of 4). Each 128-deep step adds
       a fresh fp32 product tile into the accumulator, so a program holds twice the accumulators of the bf16 kernel:
       64 rows keep GEMM1's gate and up tiles in registers, 128 rows spilled (sm_90 compile). 32 rows run on
       mma.sync, not wgmma: on one H200 (DeepSeek-V3, M = 1024, 32 rows per expert) 64-row tiles took 3,483 µs
       against 4,480 for 32 rows; at M = 4096, 7,749 against 13,784.
    7. MXFP4 weights (``dtype`` uint8, ``experts/mxfp4/kernels.py``): short tiles [128, 128] on 8 warps, 3 stages, for
       both GEMMs; for a few tokens (at most 16 rows: few programs, each streaming long rows) [64, 256] on 4 warps,
       4 stages. Swept on one H200 (DeepSeek-V4-Flash, 2026-12-01, µs at M = 1 / 16 / 128 / 1024): [128, 128] w8 s3
       73 (s5) / 461 / 1,391 / 1,864; [64, 256] w4 s4 64 / 552 / - / -; [64, 128] w4 s3 - / 475 / 1,439 / 1,983;
       [64, 64] w4 s3 - / 499 / 1,529 / 2,020; [128, 256] and [256, 128] w8 s3 slower (635 / 1,929 / 2,372 and
       644 / 2,005 / 2,355). Tall tiles as for bf16 with 3 stages (M = 4096: 4,365 µs, against 4,775 for 4 stages
       with tiles grouped per expert, 4,917 for [64, 64] and 5,083 for [128, 64]). On sm_90, models whose H and I
       are multiples of 128 run the warp-specialized kernels of ``mxfp4/ws.py`` instead (their launch shape is
       per tile height, ``ws.LAUNCH``); the tiles here serve the rest. Tile heights by the rows per
       touched expert (``MXFP4_HEIGHTS``), not item 1's power of two: 16 rows up to 13, 32 up to 32, 64 up to 58,
       then 128 (W4A8's). A tile's unpacking is paid per tile, so an expert with a second tile costs nearly twice
       as much, and with uniform routing a share of the experts has more rows than the mean; the limits are where
       the next height measured faster, DeepSeek-V4-Flash experts on one H200 (2026-12-02, µs, rows per expert:
       shorter / taller tile): 12: 1,409 / 1,555; 15: 1,708 / 1,597; 30: 2,040 / 2,280; 36: 2,602 / 2,301;
       57: 2,606 / 2,761 (W4A8); 60: 2,877 / 2,768; 63: 3,182 / 2,747.
    """
    M = int(M)
    rows = max(M * K, 1)
    touched = min(E, rows)
    per_expert = -(-rows // touched)
    fp32 = dtype == torch.float32
    fp8 = dtype == torch.float8_e4m3fn
    mxfp4 = dtype == torch.uint8
    if block_m is None and fp8:
        block_m = 16 if per_expert <= 16 else 64
    elif block_m is None and mxfp4:
        block_m = next((height for height, most in MXFP4_HEIGHTS if per_expert <= most), 128)
    elif block_m is None:
        block_m = min(32 if fp32 else 128, max(16, _next_pow2(per_expert)))
    num_tiles = touched * -(-per_expert // block_m)
    size = dtype.itemsize  # MXFP4 (uint8): bf16 activation tiles, but packed weight tiles of 5/8 byte per weight
    if fp32:
        gemm1 = _fit(block_m, I, H, 2, size, num_tiles, block_n=64, block_k=32, group_m=1, num_warps=8,
                     num_stages=3, spread=False)
        gemm2 = _fit(block_m, H, I, 1, size, num_tiles, block_n=64, block_k=32, group_m=1, num_warps=8,
                     num_stages=3, spread=False)
    elif mxfp4 and block_m <= 32:
        few = rows <= MXFP4_FEW_ROWS
        block_n, block_k, warps, stages = (64, 256, 4, 4) if few else (128, 128, 8, 3)
        gemm1 = _fit(block_m, I, H, 2, size, num_tiles, block_n=block_n, block_k=block_k, group_m=1,
                     num_warps=warps, num_stages=stages, spread=False)
        gemm2 = _fit(block_m, H, I, 1, size, num_tiles, block_n=block_n, block_k=block_k, group_m=1,
                     num_warps=warps, num_stages=stages, spread=False)
    elif mxfp4:
        gemm1 = _fit(block_m, I, H, 2, size, num_tiles, block_n=128, block_k=128, group_m=4, num_warps=8,
                     num_stages=3, spread=False)
        gemm2 = _fit(block_m, H, I, 1, size, num_tiles, block_n=256 if block_m >= 128 else 128, block_k=64,
                     group_m=4, num_warps=8, num_stages=3, spread=False)
    elif fp8:
        tall = block_m >= 64
        few = rows <= FP8_FEW_ROWS
        deep = few and num_tiles * -(-I // 128) <= NUM_SMS  # 5 stages only where GEMM1 is one wave of programs
        # short tiles step through K two 128-deep boxes at a time (BLOCK_K 256: fp8.kernels' BOXES)
        block_k = 128 if tall else 256
        gemm1 = _fit(block_m, I, H, 2, size, num_tiles, block_n=128, block_k=block_k, group_m=0 if tall else 1,
                     num_warps=8 if tall or few else 4, num_stages=(5 if deep else 4) if tall else FP8_PAIR_STAGES,
                     spread=False)
        gemm2 = _fit(block_m, H, I, 1, size, num_tiles, block_n=128, block_k=block_k, group_m=0 if tall else 1,
                     num_warps=4, num_stages=4 if tall else FP8_PAIR_STAGES, spread=not tall)
    elif block_m <= 32:
        gemm1 = _fit(block_m, I, H, 2, size, num_tiles, block_n=128, block_k=128, group_m=1, num_warps=8,
                     num_stages=3, spread=True)
        gemm2 = _fit(block_m, H, I, 1, size, num_tiles, block_n=128, block_k=128, group_m=1, num_warps=4,
                     num_stages=4, spread=True)
    else:
        gemm1 = _fit(block_m, I, H, 2, size, num_tiles, block_n=128, block_k=64, group_m=0, num_warps=8,
                     num_stages=4, spread=False)
        gemm2 = _fit(block_m, H, I, 1, size, num_tiles, block_n=256 if block_m >= 128 else 128, block_k=64,
                     group_m=0, num_warps=8, num_stages=4, spread=False)
    return TileConfig(block_m, gemm1, gemm2)


def fp8_split_k(rows: int, width: int, sms: int) -> int:
    """GEMM1's split along K for fp8 block-scale experts (``experts_fp8``) on a plan of ``rows`` token rows (M·K)
    and intermediate width I = ``width`` on a GPU of ``sms`` SMs.

    Where the unsplit grid (a program per row and 128 columns at most: rows · ceil(I / 128)) would fill at most
    two programs per SM (a token or two), the split in 1..``FP8_SPLIT_MAX`` whose programs fill the largest share of
    their waves, the fewest on a tie; else 1. A wave is ``sms`` unsplit programs (``FP8_PAIR_STAGES`` of two-box
    steps hold an SM's shared memory) or 2 · ``sms`` split ones (two share an SM on ``FP8_SPLIT_PAIR_STAGES``).
    On one H100 (132 SMs, the experts on two-box steps, thirty-ninth session, best of two CUDA-graph timings per
    split, µs at splits 1 / 2 / 3 / 4) it picks: DeepSeek-V3 1 (132.5 / 137.1 / 137.0 / 136.9), 3 with the shared
    expert's slot (176.7 / 172.0 / 152.8 / 158.0); Kimi-K2 the same; DeepSeek-V4-Flash 1 with and without the slot
    (67.6 / 69.7 / 71.3 / 69.0; 74.8 / 76.4 / 79.4 / 79.2); GLM-4.5-Air 3 (the op, 60.3 and 59.8 µs in two
    processes, against 63.1 unsplit), 1 with the slot (69.6 / 70.9 / 73.4 / 72.0); Qwen3-30B-A3B 4 (28.1 / 28.2 /
    27.6 / 28.0: within 0.5 µs). Split runs there were timed without a workspace, so with the counters' zeroing
    kernel the op does not run."""
    programs = rows * -(-width // 128)
    if programs > 2 * sms:
        return 1

    def filled(split: int) -> float:
        slots = sms if split == 1 else 2 * sms
        return programs * split / (-(-programs * split // slots) * slots)

    return max(range(1, FP8_SPLIT_MAX + 1), key=lambda split: (filled(split), -split))
