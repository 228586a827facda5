"""Tile shapes of the experts' grouped GEMMs: tuned tables per GPU model as data, a first-principles fallback,
overrides.

:func:`pick` is the one source of tile shapes. Its ``block_m`` is the plan's tile height as well, so callers build
the plan with ``moe_dispatch(ids, E, pick_block_m(M, E, H, I, K, dtype))`` and
:func:`moefuse.experts.moe_experts` re-picks the rest of the config for the plan's ``block_m``.

Order of precedence:

1. :func:`override` (a scoped context manager over a ``ContextVar``: thread- and task-safe): tests force small
   tiles with it.
2. The tile table of the GPU model (``moefuse/configs/experts_<gpu>.json``, :data:`TABLES`; a table names the GPU
   it was tuned on and its SM count, and serves only a GPU of that name and SM count): the entry of the format and
   (E, H, I, K), at its token-count bucket nearest to M on a log scale. 16-bit entries hold whole configs; fp8 and
   MXFP4 entries hold the plan's tile height, the rest coming from :func:`heuristic` for that height.
   ``scripts/tune_experts.py`` writes the tables, over a dense grid of token counts (every 32 up to 1,024) so that
   a switch of tile height lands where it measured faster, not at a bucket's edge.
3. :func:`heuristic`, from first principles and the GPU's SM count and shared memory (any GPU gets a valid, if
   untuned, config; without a GPU, the interpreter's, an H100's properties).

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
from .._runtime import GPU, HOPPER

# What a launch choice is made for: a GPU (its name and SM count pick the table), a bare compute capability (no
# table: the heuristic on an H100's resources), or None (no GPU: the interpreter; the heuristic likewise).
Arch = Union[GPU, tuple[int, int], None]
_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TABLES: dict[str, Path] = {name: _CONFIGS / f"experts_{name}.json" for name in ("h100", "h200")}
HOPPER_SMEM = HOPPER.smem  # the most shared memory one block may opt in to on sm_90 (227 KB)
SMEM_SLACK = 15 * 1024  # the heuristic keeps its upper model of the operand buffers this far under the GPU's limit
SMEM_BUDGET = HOPPER_SMEM - SMEM_SLACK  # on an H100: 212 KB
# wgmma's M: tiles of fewer rows that must run wgmma swap their product (the weights as M, the rows as N) and take at
# least this many columns (fp8 GEMM2's decode tiles; 16-bit and fp8 GEMMs in the batch-invariant order).
WGMMA_MIN_ROWS = 64

# The tile tables' formats: the dtype that keys a tile choice (``formats.tile_dtype``) -> the name of its entries.
TABLE_FORMATS: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "bf16",
                                         torch.float8_e4m3fn: "fp8", torch.uint8: "mxfp4"}
TABLE_DTYPES = (torch.bfloat16, torch.float16)  # whose entries hold whole configs (the others: a tile height)
# fp8 (``experts/fp8/``): at most this many plan rows (M·K, a token to a few), GEMM1 runs 8 warps, and 5 pipeline
# stages where it is one wave of programs; 4 warps and 4 stages from 64 rows (faster at one token on every preset,
# H100, 2026-12-05; docs/PERF-NOTES.md, fp8 decode).
FP8_FEW_ROWS = 63
# fp8 at decode: GEMM1 split along K into runs of steps, each its own program, where one program per tile and column
# block would leave SMs idle or a short second wave (fp8_split_k), each on at most this many pipeline stages so that
# two share an SM.
FP8_SPLIT_STAGES = 3
# fp8 short tiles (below 64 rows: decode) take steps of two K-adjacent 128-deep boxes (a box: the 128 x 128 block of
# weights one scale covers, copied by one TMA load), on this many pipeline stages (two where GEMM1 is split, so that
# two split programs share an SM; Triton 3.6 buffers one step fewer than its stages in GEMM1, 139 KB at 3). Two
# boxes a step read like one box of 256-byte rows: DeepSeek-V3's GEMM1 boxes, read with no arithmetic, 89.9 µs box
# by box against 82.6 in pairs, 76.6 at the floor (H100, 2026-12-05).
FP8_PAIR_STAGES = 3
FP8_SPLIT_PAIR_STAGES = 2
# GEMM1 in gate and up halves (``fp8_halves``) runs 128-deep steps on this many warps and pipeline stages, whatever
# the tile choice asked for. DeepSeek-V3's batch-invariant token with its shared slot (288 half programs): on
# 16-row swapped tiles the layer took 161.1 µs on 3 stages, 164.9 on 4, 170.1 on 6 (three programs fit an SM, two
# on 6); on 64-row tiles GEMM1 162.6 on 3, 167.3 on 4, 205.6 and 215.1 on 2, 168.0 as whole tiles.
# DeepSeek-V4-Flash's shared expert (64 programs): the layer 65.1-66.7 µs on 3-8 stages (H100, 2026-12-06,
# research/invariant_one_token.py and research/fp8_halves_depth.py --layers).
FP8_HALVES_WARPS = 4
FP8_HALVES_STAGES = 3
# Halves of 64 columns (``fp8_half_columns``: every program an SM of its own, a lone expert's token) run deeper: the
# DeepSeek-V4-Flash MXFP4 layer's invariant token, its fp8 shared expert's 64 programs on 8 stages, took 65.1 / 64.4
# µs against 66.6 / 67.1 on 3 (6: 66.3 / 66.0; the default 63.6 / 62.8; two runs of alternating medians, H100,
# 2026-12-06, research/fp8_halves_depth.py --layers). Three programs an SM (the slot's halves of 128) ran slower deeper.
FP8_NARROW_HALVES_STAGES = 8
FP8_SPLIT_MAX = 4  # the most runs fp8_split_k splits GEMM1's K into (5, 6 and 8 measured no faster)
MXFP4_FEW_ROWS = 16  # at most this many routed rows: MXFP4's deeper decode tiles (heuristic, item 7)
# MXFP4's tile heights and the most rows per touched expert each takes before the next is faster (heuristic, item 7);
# more rows take 128-row tiles.
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


def arch_of(device: torch.device) -> Optional[GPU]:
    """The GPU a CUDA device is (:func:`moefuse._runtime.gpu`); None on CPU or under Triton's interpreter."""
    if device.type != "cuda" or _runtime.interpreting():
        return None
    return _runtime.gpu(device)


def resolve_arch(arch: Union[Arch, Literal["auto"]]) -> Arch:
    """``arch`` itself, or for "auto" the current CUDA device (None without one)."""
    if arch != "auto":
        return arch
    if not torch.cuda.is_available():
        return None
    return arch_of(torch.device("cuda", torch.cuda.current_device()))


def gpu_of(arch: Arch) -> GPU:
    """The resources a choice for ``arch`` plans with: the GPU's own, else an H100's with ``arch``'s capability."""
    if isinstance(arch, GPU):
        return arch
    return HOPPER if arch is None else replace(HOPPER, name="", capability=(arch[0], arch[1]))


def pick(
    M: int, E: int, H: int, I: int, K: int, dtype: torch.dtype,
    arch: Union[Arch, Literal["auto"]] = "auto", *, block_m: Optional[int] = None,
) -> TileConfig:
    """Tile config for M tokens, E experts of width I over model width H, top-K, activations of ``dtype``.

    A pure function of its arguments (and of an active :func:`override`, in eager mode; under ``torch.compile`` it
    is traced, so each token count M compiles its own graph). ``arch`` is a :class:`moefuse._runtime.GPU` (its table,
    if one was tuned on its model), a compute capability such as (9, 0) (the heuristic), None for no GPU (the
    interpreter), or "auto" for the current CUDA device. ``block_m`` forces the tile height (the plan's): a table
    entry with another height is then replaced by the heuristic.
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
    config = from_table(M, E, H, I, K, dtype, arch)
    if config is None or (block_m is not None and config.block_m != block_m):
        config = heuristic(M, E, H, I, K, dtype, block_m=block_m, gpu=gpu_of(arch))
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


@functools.cache
def load_table(path: Path) -> dict[str, Any]:
    """A tile table: ``{"gpu": {"name", "sms", "capability"}, "entries": [{"format", "E", "H", "I", "K", "status",
    "buckets": {"<M>": config or {"block_m": b}}}], ...}``. One table serves bf16 and fp16 alike (same bytes per
    element, same tensor-core rate); entries without a ``format`` are 16-bit."""
    return json.loads(Path(path).read_text())


def table_for(arch: Arch) -> Optional[str]:
    """The name of the table (:data:`TABLES`) tuned on ``arch``'s GPU model: the first whose GPU name is part of the
    device's name and whose SM count and capability are the device's; None (the heuristic) for any other GPU, a bare
    capability or no GPU."""
    if not isinstance(arch, GPU):
        return None
    for name, gpu in _GPUS.items():
        if gpu["name"] in arch.name and gpu["sms"] == arch.sms and tuple(gpu["capability"]) == arch.capability:
            return name
    return None


def _entry(E: int, H: int, I: int, K: int, dtype: torch.dtype, arch: Arch
           ) -> Optional[dict[int, Union[TileConfig, int]]]:
    """The buckets of the table entry for these shapes on ``arch`` (:func:`table_for`), or None."""
    fmt = TABLE_FORMATS.get(dtype)
    name = table_for(arch)
    if fmt is None or name is None:
        return None  # fp32 moves twice the bytes per tile: the tables' tiles would not fit; use the heuristic
    return _INDEX[name].get((fmt, E, H, I, K))


def tuned(E: int, H: int, I: int, K: int, dtype: torch.dtype, arch: Arch) -> bool:
    """Whether ``arch``'s table has an entry for these shapes (else :func:`pick` takes the heuristic)."""
    return _entry(E, H, I, K, dtype, arch) is not None


def from_table(M: int, E: int, H: int, I: int, K: int, dtype: torch.dtype, arch: Arch) -> Optional[TileConfig]:
    """The table's config for these shapes on ``arch`` (:func:`table_for`), or None where it has no entry."""
    buckets = _entry(E, H, I, K, dtype, arch)
    if buckets is None:
        return None
    bucket = buckets[nearest_bucket(list(buckets), M)]
    if isinstance(bucket, int):  # a tile height: the rest as the heuristic launches that height
        return heuristic(M, E, H, I, K, dtype, block_m=bucket, gpu=gpu_of(arch))
    return bucket


def _index_table(path: Path) -> dict[tuple[str, int, int, int, int], dict[int, Union[TileConfig, int]]]:
    """(format, E, H, I, K) -> {bucket M: config, or a tile height} of a table file; {} when the file is missing."""
    if not path.exists():
        return {}
    index: dict[tuple[str, int, int, int, int], dict[int, Union[TileConfig, int]]] = {}
    for entry in load_table(path)["entries"]:
        fmt = entry.get("format", "bf16")
        index[(fmt, entry["E"], entry["H"], entry["I"], entry["K"])] = {
            int(m): TileConfig.from_dict(config) if fmt == "bf16" else int(config["block_m"])
            for m, config in entry["buckets"].items()
        }
    return index


def _index_shared_slot(path: Path) -> dict[tuple[int, int, int, int], int]:
    """(E, H, I, K) -> a 16-bit entry's ``shared_slot_max_tokens`` (absent: 0) of a table file."""
    if not path.exists():
        return {}
    return {(e["E"], e["H"], e["I"], e["K"]): int(e.get("shared_slot_max_tokens", 0))
            for e in load_table(path)["entries"] if e.get("format", "bf16") == "bf16"}


# Parsed once at import, so that tracing pick() (torch.compile) reads no files.
_GPUS = {name: load_table(path)["gpu"] for name, path in TABLES.items() if path.exists()}
_INDEX = {name: _index_table(path) for name, path in TABLES.items()}
_SHARED_SLOT = {name: _index_shared_slot(path) for name, path in TABLES.items()}


def shared_slot_max_tokens(E: int, H: int, I: int, K: int, arch: Arch) -> int:
    """Up to how many tokens a layer of this shape runs its shared expert as one more slot of the grouped GEMMs.

    A measured, per-shape choice kept in the tile table (``"shared_slot_max_tokens"`` of an entry; 0 when absent,
    and with no table for ``arch``): ``moefuse bench layer`` times both ways at decode sizes.
    """
    name = table_for(arch)
    return 0 if name is None else _SHARED_SLOT[name].get((E, H, I, K), 0)


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


def spread_columns(block_n: int, num_tiles: int, n: int, least: int, gpu: GPU) -> int:
    """``block_n`` halved (not below ``least``) until ``num_tiles`` rows of tiles over ``n`` columns make a program
    for each of ``gpu``'s SMs: a memory-bound GEMM streams from every SM."""
    while block_n > least and num_tiles * -(-n // block_n) < gpu.sms:
        block_n //= 2
    return block_n


def programs_per_sm(program_smem: int, gpu: GPU) -> int:
    """How many programs of ``program_smem`` bytes of shared memory fit one of ``gpu``'s SMs (a block's opt-in limit
    and the 1 KB the driver reserves per block make up the SM's shared memory)."""
    reserved = 1024
    return (gpu.smem + reserved) // (program_smem + reserved)


def one_wave(block_m: int, tiles: GemmTiles, num_tiles: int, n: int, operands: int, element_size: int,
             gpu: GPU) -> GemmTiles:
    """``tiles``, or where their programs exceed one wave on ``gpu``'s SMs, half as wide on the deepest pipeline
    (at least 2 stages) at which every program of the narrower grid is resident at once, if there is one.

    A short second wave runs on a few SMs while the rest idle. DeepSeek-V3's batch-invariant token with its shared
    slot (9 tiles of 16 rows, I = 2,048): GEMM1 on 128 columns is 144 programs of 209 KB, one an SM, 132 then 12;
    on 64 columns and 2 stages 288 programs of 74 KB, three an SM, one wave: the routed experts 282.6 -> 267.2 µs
    (64 columns on 3 stages, two an SM and a second wave of 24: 283.9; H100, 2026-12-06,
    research/invariant_one_token.py). The column width orders no sum: the same bits."""
    def resident(t: GemmTiles) -> bool:  # every program of the grid on an SM at once
        programs = num_tiles * -(-n // t.block_n)
        return programs <= gpu.sms * programs_per_sm(smem_bytes(block_m, t, operands, element_size), gpu)

    if tiles.block_n < 128 or resident(tiles):
        return tiles
    for stages in range(tiles.num_stages, 1, -1):
        narrow = replace(tiles, block_n=tiles.block_n // 2, num_stages=stages)
        if resident(narrow):
            return narrow
    return tiles


def _spread(M: int, E: int, K: int) -> tuple[int, int, int]:
    """M tokens' top-K rows over E experts: (rows, experts touched at most, rows per touched expert, rounded up)."""
    rows = max(int(M) * K, 1)
    touched = min(E, rows)
    return rows, touched, -(-rows // touched)


@functools.lru_cache(maxsize=4096)  # asked on every eager forward that runs the slot
def slot_tiles(config: TileConfig, M: int, E: int, I: int, K: int, dtype: torch.dtype, arch: Arch) -> TileConfig:
    """A 16-bit ``config`` chosen for the routed shape (E experts, top-K; :data:`TABLE_DTYPES`, whose tables hold
    whole configs), for a plan that also runs the shared expert as one more slot (E + 1 experts, K + 1 a token):
    GEMM1 in :func:`one_wave` of the slot plan's tiles. The table's one-token DeepSeek-V3 launch (128 columns, 3
    stages, one program an SM) is 144 programs with the slot, 132 and then 12 (H100, Nsight Compute of the
    batch-invariant layer: GEMM1 193 µs at 82% of DRAM peak, 1.21 waves, against the default's 156 at 91%)."""
    if config.block_m > 32 or dtype not in TABLE_DTYPES:
        return config
    _, touched, per_expert = _spread(M, E + 1, K + 1)
    num_tiles = touched * -(-per_expert // config.block_m)
    gemm1 = one_wave(config.block_m, config.gemm1, num_tiles, I, 2, dtype.itemsize, gpu_of(arch))
    return replace(config, gemm1=gemm1)


def _fit(
    block_m: int, n: int, k: int, operands: int, element_size: int, num_tiles: int, *,
    block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int, spread: bool, gpu: GPU = HOPPER,
) -> GemmTiles:
    """Shrink a wish-list launch to the problem: dims, SM coverage (``spread``), the GPU's shared memory."""
    block_n = min(block_n, max(16, _next_pow2(n)))
    block_k = min(block_k, max(16, _next_pow2(k)))
    # Memory-bound GEMMs need a program per SM in flight (deep pipelines keep each one streaming).
    if spread:
        block_n = spread_columns(block_n, num_tiles, n, 64, gpu)
    # Give up pipeline depth beyond 3 first, then long reduction steps, then the last stage, then width.
    budget = gpu.smem - SMEM_SLACK
    while smem_bytes(block_m, GemmTiles(block_n, block_k, group_m, num_warps, num_stages), operands,
                     element_size) > budget:
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
    M: int, E: int, H: int, I: int, K: int, dtype: torch.dtype, *, block_m: Optional[int] = None,
    gpu: GPU = HOPPER,
) -> TileConfig:
    """First-principles tiles for a Hopper-class GPU of ``gpu``'s SM count and shared memory (any GPU gets a valid,
    if untuned, config). The measurements behind each rule are in docs/PERF-NOTES.md.

    1. Tile height: the average rows per touched expert, ``M*K / min(E, M*K)``, rounded up to a power of two in
       [16, 128] ([16, 32] in fp32, item 4). Each tile reads its expert's whole weight slab, so a tile much taller
       than an expert's rows wastes tensor-core work, and a much shorter one re-reads the weights.
    2. Short tiles (<= 32 rows: decode and small batches) are bound by reading the weights once: long reduction
       steps (BLOCK_K 128) and BLOCK_N 128, halved (down to 64) until there is a program per SM; GEMM1 8 warps and 3
       stages (two weight operands), GEMM2 4 warps and 4 stages.
    3. Tall tiles (prefill) are bound by tensor-core throughput: 8 warps, BLOCK_N 128 (GEMM1 keeps gate and up
       accumulators) or 256 (GEMM2, one accumulator, when 128 rows tall), BLOCK_K 64, 4 stages, and each expert's
       tiles one group sharing a column block (GROUP_M 0), so its weight tiles are read from L2 by all its tiles
       however skewed the routing.
    4. fp32 operands take IEEE products on the FMA units, not the tensor cores, so the operand tiles live in
       registers: tiles of at most 32 rows, BLOCK_N 64, BLOCK_K 32, 8 warps (the largest that do not spill on
       sm_90: ``scripts/sass.py experts``).
    5. Every block is capped by its dimension (next power of two, at least 16: the smallest ``tl.dot``); stages and
       BLOCK_K shrink until the operand buffers fit in the GPU's shared memory.
    6. fp8 block-scale weights (``dtype`` float8_e4m3fn, ``experts/fp8/kernels.py``): BLOCK_K 128 (one scale step)
       and GEMM1's BLOCK_N 128 (one intermediate scale group); tiles of 16 rows up to 16 rows per expert, else 64.
       16-row tiles step through K two K-adjacent boxes at a time (BLOCK_K 256), on ``FP8_PAIR_STAGES`` in both
       GEMMs (each box still promoted on its own: the same sums). 64-row tiles: GEMM1 8 warps where the plan has a
       few rows (``FP8_FEW_ROWS``) or the tiles are tall, else 4; GEMM1 5 stages where it is one wave of programs
       on the SMs, 2 where a few rows make up to two programs an SM (two then share an SM), else 4; GEMM2 4 warps
       and 4 stages; tall tiles grouped per expert. 32-row fp8 tiles would run on mma.sync, slower than 64-row
       wgmma tiles at every size measured, so they are never chosen.
    7. MXFP4 weights (``dtype`` uint8, ``experts/mxfp4/kernels.py``): short tiles [128, 128] on 8 warps, 3 stages;
       for a few tokens (at most ``MXFP4_FEW_ROWS`` rows) [64, 256] on 4 warps, 4 stages; tall tiles as for bf16
       with 3 stages. Tile heights by the rows per touched expert (``MXFP4_HEIGHTS``), not item 1's power of two:
       a tile's unpacking is paid per tile, so an expert with a second tile costs nearly twice as much. On sm_90,
       models whose H and I are multiples of 128 run the warp-specialized kernels of ``mxfp4/ws.py`` (their launch
       shape is per tile height, ``ws.LAUNCH``); the tiles here serve the rest.
    """
    M = int(M)
    rows, touched, per_expert = _spread(M, E, K)
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
                     num_stages=3, spread=False, gpu=gpu)
        gemm2 = _fit(block_m, H, I, 1, size, num_tiles, block_n=64, block_k=32, group_m=1, num_warps=8,
                     num_stages=3, spread=False, gpu=gpu)
    elif mxfp4 and block_m <= 32:
        few = rows <= MXFP4_FEW_ROWS
        block_n, block_k, warps, stages = (64, 256, 4, 4) if few else (128, 128, 8, 3)
        gemm1 = _fit(block_m, I, H, 2, size, num_tiles, block_n=block_n, block_k=block_k, group_m=1,
                     num_warps=warps, num_stages=stages, spread=False, gpu=gpu)
        gemm2 = _fit(block_m, H, I, 1, size, num_tiles, block_n=block_n, block_k=block_k, group_m=1,
                     num_warps=warps, num_stages=stages, spread=False, gpu=gpu)
    elif mxfp4:
        gemm1 = _fit(block_m, I, H, 2, size, num_tiles, block_n=128, block_k=128, group_m=4, num_warps=8,
                     num_stages=3, spread=False, gpu=gpu)
        gemm2 = _fit(block_m, H, I, 1, size, num_tiles, block_n=256 if block_m >= 128 else 128, block_k=64,
                     group_m=4, num_warps=8, num_stages=3, spread=False, gpu=gpu)
    elif fp8:
        tall = block_m >= 64
        few = rows <= FP8_FEW_ROWS
        programs = num_tiles * -(-I // 128)
        deep = few and programs <= gpu.sms  # 5 stages only where GEMM1 is one wave of programs
        # 2 stages where its programs fill the SMs once and a few twice (a batch-invariant token with the shared slot:
        # 144 programs on 132 SMs), so that two share an SM in one wave instead of a second wave running alone
        shared = few and gpu.sms < programs <= 2 * gpu.sms
        # short tiles step through K two 128-deep boxes at a time (BLOCK_K 256: fp8.kernels' BOXES)
        block_k = 128 if tall else 256
        gemm1 = _fit(block_m, I, H, 2, size, num_tiles, block_n=128, block_k=block_k, group_m=0 if tall else 1,
                     num_warps=8 if tall or few else 4,
                     num_stages=(5 if deep else 2 if shared else 4) if tall else FP8_PAIR_STAGES, spread=False,
                     gpu=gpu)
        gemm2 = _fit(block_m, H, I, 1, size, num_tiles, block_n=128, block_k=block_k, group_m=0 if tall else 1,
                     num_warps=4, num_stages=4 if tall else FP8_PAIR_STAGES, spread=not tall, gpu=gpu)
    elif block_m <= 32:
        gemm1 = one_wave(block_m, _fit(block_m, I, H, 2, size, num_tiles, block_n=128, block_k=128, group_m=1,
                                       num_warps=8, num_stages=3, spread=True, gpu=gpu), num_tiles, I, 2, size, gpu)
        gemm2 = _fit(block_m, H, I, 1, size, num_tiles, block_n=128, block_k=128, group_m=1, num_warps=4,
                     num_stages=4, spread=True, gpu=gpu)
    else:
        gemm1 = _fit(block_m, I, H, 2, size, num_tiles, block_n=128, block_k=64, group_m=0, num_warps=8,
                     num_stages=4, spread=False, gpu=gpu)
        gemm2 = _fit(block_m, H, I, 1, size, num_tiles, block_n=256 if block_m >= 128 else 128, block_k=64,
                     group_m=0, num_warps=8, num_stages=4, spread=False, gpu=gpu)
    return TileConfig(block_m, gemm1, gemm2)


def fp8_halves(rows: int, width: int, sms: int) -> bool:
    """Whether unsplit fp8 GEMM1 (``experts_fp8``'s ``halves``) on a plan of ``rows`` token rows (M·K) and
    intermediate width I = ``width`` runs its gate and up tiles as programs of their own on a GPU of ``sms`` SMs:
    where its grid (a program per row and 128 columns at most: rows · ceil(I / 128)) fills at most two programs an
    SM, as where :func:`fp8_split_k` would split it (a batch-invariant layer may not: DeepSeek-V3's token with its
    shared slot is 144 programs on 132 SMs, twelve of them running two)."""
    return _gemm1_programs(rows, width) <= 2 * sms


def fp8_half_columns(rows: int, width: int, sms: int) -> int:
    """The columns each program of fp8 GEMM1's halves sums on a plan of ``rows`` token rows and intermediate width
    ``width`` on ``sms`` SMs: 64 (four programs a tile) where even then every program has an SM of its own (a dense
    shared expert's token: more SMs reading), else 128. Where programs share SMs, a 64-column program keeps half
    the weight bytes in flight: DeepSeek-V3's invariant token with its shared slot took 126 µs in GEMM1 on 576
    programs of 64 columns against 110 on 288 of 128; DeepSeek-V4-Flash's fp8 shared expert beside the MXFP4
    experts 39.5 on 64 against 49.1 on 32 (H100, layer graph replays, research/layer_graph_timeline.py)."""
    return 64 if 4 * _gemm1_programs(rows, width) <= sms else 128


def _gemm1_programs(rows: int, width: int) -> int:
    """fp8 GEMM1's unsplit grid on ``rows`` token rows and intermediate width ``width``: a program per row (at
    most: a tile may hold several) and 128 columns."""
    return rows * -(-width // 128)


def fp8_split_k(rows: int, width: int, sms: int) -> int:
    """GEMM1's split along K for fp8 block-scale experts (``experts_fp8``) on a plan of ``rows`` token rows (M·K)
    and intermediate width I = ``width`` on a GPU of ``sms`` SMs.

    Where the unsplit grid (a program per row and 128 columns at most: rows · ceil(I / 128)) would fill at most
    two programs per SM (a token or two), the split in 1..``FP8_SPLIT_MAX`` whose programs fill the largest share of
    their waves, the fewest on a tie; else 1. A wave is ``sms`` unsplit programs (``FP8_PAIR_STAGES`` of two-box
    steps hold an SM's shared memory) or 2 · ``sms`` split ones (two share an SM on ``FP8_SPLIT_PAIR_STAGES``).
    The splits it picks on the presets, and their times, are in docs/PERF-NOTES.md (fp8 decode)."""
    if not fp8_halves(rows, width, sms):  # the unsplit grid already fills more than two programs an SM
        return 1
    programs = _gemm1_programs(rows, width)

    def filled(split: int) -> float:
        slots = sms if split == 1 else 2 * sms
        return programs * split / (-(-programs * split // slots) * slots)

    return max(range(1, FP8_SPLIT_MAX + 1), key=lambda split: (filled(split), -split))
