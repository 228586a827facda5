"""fp8 block-scale experts at decode (1, 2 and 16 tokens) with GEMM1 split along K, on one GPU.

    python -m research.fp8_decode_probe [--json FILE] [--layer] [--read | --fused [--quick] | --ws |
                                         --gemm2-launch | --layer-prefetch | --ncu-target P]

At one token GEMM1 has one program per tile and 128 intermediate columns: 8 · 16 = 128 programs for DeepSeek-V3,
96 for DeepSeek-V4-Flash, 88 for GLM-4.5-Air, 48 for Qwen3-30B-A3B, against 132 SMs; 144, 112 and 99 with the
shared expert as one more slot (as ``MoELayer`` runs it at decode). ``experts_fp8(split_k=s)`` runs each program's
K in s runs of steps, each its own program (on at most ``FP8_SPLIT_STAGES`` stages, so that two share an SM).

Per preset, token count and slots per token (top-k, and top-k + 1 where the preset has a shared expert): the
experts as ``moe_experts`` runs them (the op: split where ``configs.fp8_split_k`` says), then ``experts_fp8`` on
the same tiles with split_k 1-4; µs under CUDA-graph replay, rotating through enough routings that the touched
weights overflow the L2, and each GEMM's own device time (``torch.profiler``, the same calls eager, no PDL). The
read floors: the touched experts' values and scales, all and per GEMM, at the read bandwidth measured in the same
run. Then the error of each split against SPEC §5's float64 emulation, DeepSeek-V3 widths, 16 experts.

``--layer``: the fp8 ``MoELayer`` at one token per preset, captured as one CUDA graph: its graph time and where
each kernel of one replay starts and ends (PDL lets a kernel start before the one it waits for ends).

``--read``: what the memory system gives GEMM1's access pattern with next to no arithmetic: a kernel that streams
the touched experts' gate and up boxes through TMA (DeepSeek-V3 at one token: 8 experts, [4096, 7168] e4m3 each)
on GEMM1's grid (a program per expert and box of rows, split along K) and multiplies each by a block of ones (one
wgmma, so that the loads are pipelined as GEMM1's are), with boxes of 128 rows x 128 bytes (GEMM1's), 64 x 256 and
128 x 256, on 2-4 stages; µs and TB/s under graph replay. Then 128 x 128 boxes two K-adjacent ones a step, issued
back to back; the same bytes stored box by box (each 128 x 128 box 16 KB contiguous, as a repacked weight would
be), on 1, 2 and 4 splits at 3 and 4 stages; GEMM1's boxes on each preset's own one-token launch (grid, split,
stages, warps); and a plain grid-stride read (``_stream_kernel``: 4 or 8 programs an SM, no TMA) of exactly each
preset's one-token expert bytes, all and GEMM1's alone, against the floor the bench uses (bytes at the 1 GiB
``torch.sum`` read rate).

``--fused``: both GEMMs as one persistent launch (``fused_decode.py``). First every build (runs per GEMM1 column
block, warps and register cap, stages, activations quantized in GEMM1's loop or by items of their own, GEMM1 on
mma.sync or on swapped wgmma, the next item's first lines prefetched or not) and launch (programs an SM, lag) on
DeepSeek-V3 at one token; then the fastest few on every preset at 1, 2 and 16 tokens (and 1 with the shared
expert's slot), beside the op and ``experts_fp8`` split as the op splits. Each fused time comes with whether its
output has the same bits as ``experts_fp8`` split the same way on the same tiles (on mma.sync it must), and its
largest relative difference. ``--quick``: 24 of the 216 (split 7, two programs an SM, 4 warps or 8 at 128
registers): 70 s on an H200.

``--ws``: both GEMMs as one persistent, warp-specialized launch (``ws_decode.py``, Gluon): every launch (runs per
GEMM1 column block; programs an SM with their ring slots and registers; lag) on DeepSeek-V3 at one token, then the
fastest few on every preset, on 16-row tiles (the routings planned again where the op's are taller), beside the op.
Each time comes with whether its output has the same bits as the fused ``tl`` kernel's on swapped wgmma (the same
numerics), its largest difference from the op, and its error and the op's from SPEC §5's float64 emulation.

``--gemm2-launch``: ``experts_fp8`` at one token on every preset with GEMM2's launch changed (128 or 64 or 256
columns, 2-4 stages, 4 or 8 warps; GEMM1 and its split as the op's), beside the op: whether fewer stages (more
programs an SM, the grid in one wave) move GEMM2; each row says whether its output has the op's bits (the order of
the sums does not change, so it must).

``--layer-prefetch``: the fp8 layer at one token with its shared expert's weights asked of the L2 as the call
starts (``l2_prefetch.py``), per preset with a shared expert, against the layer as it is.

``--ncu-target PRESET [--fused-config JSON] [--ws-config JSON]``: that preset's one-token experts (and the fused
and warp-specialized kernels in those configurations) once each inside an NVTX range "meas", for Nsight Compute;
``scripts/ncu_table.py`` makes a table of what it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moefuse.bench import timing
from moefuse.bench.experts import _routing
from moefuse.config import preset
from moefuse.dispatch import moe_dispatch
from moefuse.experts import configs, experts_workspace, moe_experts, plan_block_m
from moefuse.experts.fp8.kernels import default_split_k, experts_fp8, fp8_tiles
from moefuse.experts.reference import moe_experts_fp8_torch
from moefuse.formats import BLOCK, BlockFP8, tile_dtype
from moefuse.layer import MoELayer
from moefuse.testing import rel_error, rms_rel_error
from research import ws_decode
from research.fused_decode import fused_experts_fp8
from research.l2_prefetch import with_shared_prefetch

PRESETS = ("deepseek-v3", "kimi-k2", "deepseek-v4-flash", "glm-4.5-air", "qwen3-30b-a3b")
SPLITS = (1, 2, 3, 4)


def random_fp8(E: int, N: int, K: int, device: torch.device) -> BlockFP8:
    """Weights for timing: random e4m3 codes (no NaN) and unit-scale blocks; the values do not change the time."""
    values = torch.empty(E, N, K, dtype=torch.uint8, device=device).random_(0, 0x7E).view(torch.float8_e4m3fn)
    scales = torch.full((E, -(-N // 128), -(-K // 128)), 1e-3, device=device)
    return BlockFP8(values, scales)


def kernel_us(calls: Sequence[Callable[[], object]], rounds: int = 4,
              kernels: Sequence[str] = ("gemm1", "gemm2")) -> dict[str, float]:
    """Mean device µs per call of the kernels the calls launch whose names hold ``_<name>_`` for each of
    ``kernels`` (the fp8 GEMMs unless told), as ``<name>_us`` (eager, under ``torch.profiler``)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            for call in calls:
                call()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for event in prof.events():
        for name in kernels:
            if event.device_type == torch.autograd.DeviceType.CUDA and f"_{name}_" in event.name:
                total[f"{name}_us"] += event.device_time_total / (rounds * len(calls))
    return dict(total)


def time_presets(device: torch.device, read_tbps: float) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator(device).manual_seed(0)
    for name in PRESETS:
        cfg = preset(name)
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        w1, w2 = random_fp8(E, 2 * I, H, device), random_fp8(E, H, I, device)
        bytes1, bytes2 = (w.values[0].numel() + w.scales[0].numel() * 4 for w in (w1, w2))
        for M, K in preset_shapes(name):
            shape, touched = make_shape(M, K, w1, w2, gen)
            floor1, floor2 = (touched * b / (read_tbps * 1e12) * 1e6 for b in (bytes1, bytes2))
            op = shape.op_calls()
            row: dict[str, Any] = {
                "model": name, "M": M, "slots": K, "block_m": shape.plans[0].block_m, "experts_touched": touched,
                "gemm1_programs": M * K * -(-I // 128), "rule_split": shape.op_split,
                "read_floor_us": floor1 + floor2, "gemm1_floor_us": floor1, "gemm2_floor_us": floor2,
                "op_us": timing.time_or_none(op), **{f"op_{k}": v for k, v in kernel_us(op).items()}}
            for split in SPLITS if M < 16 else (1, 2):
                calls = shape.split_calls(split)
                row[f"split{split}_us"] = timing.time_or_none(calls)
                row.update({f"split{split}_{k}": v for k, v in kernel_us(calls).items()})
            rows.append(row)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del w1, w2
        torch.cuda.empty_cache()
    return rows


def errors(device: torch.device) -> list[dict[str, Any]]:
    """Each split against the float64 emulation of SPEC §5, DeepSeek-V3 widths on 16 experts, 3 routings each."""
    gen = torch.Generator(device).manual_seed(1)
    E, H, I, K = 16, 7168, 2048, 8
    w1 = BlockFP8.quantize(torch.randn(E, 2 * I, H, device=device, generator=gen) / H**0.5)
    w2 = BlockFP8.quantize(torch.randn(E, H, I, device=device, generator=gen) / I**0.5)
    rows = []
    for M in (1, 2, 16):
        for _ in range(3):
            x = torch.randn(M, H, device=device, generator=gen).bfloat16()
            plan = moe_dispatch(_routing(M, E, K, device, gen)[1], E, plan_block_m(M, w1, K, torch.bfloat16))
            n = int(plan.expert_offsets[-1])
            zeros = torch.zeros(plan.num_rows, H, dtype=torch.float64, device=device)
            ref = moe_experts_fp8_torch(x, w1, w2, plan, dtype=torch.float64, out=zeros)[:n]
            tiles = configs.pick(M, E, H, I, K, tile_dtype(w1, torch.bfloat16), block_m=plan.block_m)
            for split in SPLITS:
                out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=device)
                experts_fp8(x, w1, w2, plan, out, tiles.gemm1, tiles.gemm2, split_k=split)
                rows.append({"M": M, "split_k": split, "err": rel_error(out[:n], ref),
                             "rms": rms_rel_error(out[:n], ref)})
                print(rows[-1], flush=True)
    return rows


@triton.jit
def _read_boxes_kernel(desc, experts_ptr, out_ptr, N, K, BOX_N: tl.constexpr, BOX_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, TILED: tl.constexpr = False, PAIRS: tl.constexpr = False):
    """Program (p, s): expert ``experts[p // (N / BOX_N)]``'s rows of block p % (N / BOX_N) (gate and, N further on,
    up), the s-th of SPLIT_K runs of K, box by box through TMA, each box times a 16-column block of ones: one fp8
    wgmma per box (about one instruction per weight), so that Triton pipelines the loads as it does GEMM1's.
    ``TILED``: the weights stored box by box, box (n-block, k-step) of the [E·2N, K] weights at rows
    (n-block · K/BOX_K + k-step) · BOX_N of the [-1, BOX_K] view ``desc`` covers (BOX_N · BOX_K contiguous bytes).
    ``PAIRS``: two K-adjacent boxes of each block a step, issued back to back (the checkpoint's layout): whether
    the DRAM sees them as one box twice as wide."""
    blocks = N // BOX_N
    steps = K // BOX_K
    expert = tl.load(experts_ptr + tl.program_id(0) // blocks)
    gate = expert * 2 * blocks + tl.program_id(0) % blocks  # the gate rows' n-block; up's is `blocks` further
    depth: tl.constexpr = 2 * BOX_K if PAIRS else BOX_K
    per = tl.cdiv(tl.cdiv(K, depth), SPLIT_K) * depth
    k_begin = tl.program_id(1) * per
    ones = tl.full([BOX_K, 16], 1.0, tl.float32).to(tl.float8e4nv)
    acc = tl.zeros([BOX_N, 16], dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + per, K), depth):
        for n_block in tl.static_range(2):  # gate, then up
            if TILED:
                box = desc.load([((gate + n_block * blocks) * steps + k0 // BOX_K) * BOX_N, 0])
            else:
                box = desc.load([(gate + n_block * blocks) * BOX_N, k0])
            acc = tl.dot(box, ones, acc)
            if PAIRS:
                acc = tl.dot(desc.load([(gate + n_block * blocks) * BOX_N, k0 + BOX_K]), ones, acc)
    tl.store(out_ptr + tl.program_id(0) * SPLIT_K + tl.program_id(1) + tl.zeros([1], tl.int32),
             tl.sum(tl.sum(acc, 1), 0)[None])


# read_pattern's layouts: (layout, box shape, stage counts); the splits are 1, 2 and 4 for each.
READ_LAYOUTS = [("checkpoint", box, (2, 3, 4)) for box in ((128, 128), (64, 256), (128, 256))] + [
    ("checkpoint, pairs", (128, 128), (2, 3)), ("box by box", (128, 128), (3, 4))]


def read_pattern(device: torch.device, read_tbps: float) -> list[dict[str, Any]]:
    """GEMM1's boxes streamed with no arithmetic (DeepSeek-V3 at one token), per layout (the checkpoint's, or the
    same bytes stored box by box: ``_read_boxes_kernel``'s ``TILED``), box shape, split and stages."""
    cfg = preset("deepseek-v3")
    E, H, I, K = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    values = torch.empty(E * 2 * I, H, dtype=torch.uint8, device=device).random_(0, 0x7E).view(torch.float8_e4m3fn)
    gen = torch.Generator(device).manual_seed(2)
    sets = timing.rotations(K * 2 * I * H)
    experts = [torch.randperm(E, device=device, generator=gen)[:K].int() for _ in range(sets)]
    out = torch.empty(1 << 16, dtype=torch.float32, device=device)
    rows = []
    for layout, (box_n, box_k), stage_counts in READ_LAYOUTS:
        tiled, pairs = layout == "box by box", layout.endswith("pairs")
        desc = TensorDescriptor.from_tensor(values.view(-1, box_k) if tiled else values, [box_n, box_k])
        for split in (1, 2, 4):
            for stages in stage_counts:
                grid = (K * I // box_n, split)
                calls = [lambda e=e: _read_boxes_kernel[grid](desc, e, out, I, H, box_n, box_k, split, tiled, pairs,
                                                             num_warps=4, num_stages=stages) for e in experts]
                us = timing.time_or_none(calls)
                if us is None:
                    continue
                rows.append({"layout": layout, "box": [box_n, box_k], "split_k": split, "stages": stages,
                             "programs": grid[0] * split, "us": us, "tbps": K * 2 * I * H / us / 1e6,
                             "floor_us": K * 2 * I * H / (read_tbps * 1e12) * 1e6})
                print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    return rows


def read_launches(device: torch.device, read_tbps: float) -> list[dict[str, Any]]:
    """GEMM1's boxes streamed with no arithmetic on each preset's one-token launch as the op takes it (the
    checkpoint's layout, 128 x 128 boxes, the op's grid, split, steps of one box or two, stages and warps): what
    the op's access pattern alone costs over a plain read of the same bytes (``read_sizes``)."""
    out = torch.empty(1 << 16, dtype=torch.float32, device=device)
    gen = torch.Generator(device).manual_seed(2)
    rows = []
    for model in PRESETS:
        cfg = preset(model)
        E, H, I, K = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k  # noqa: E741
        values = torch.empty(E * 2 * I, H, dtype=torch.uint8, device=device).random_(0, 0x7E)
        desc = TensorDescriptor.from_tensor(values.view(torch.float8_e4m3fn), [BLOCK, BLOCK])
        tiles = configs.pick(1, E, H, I, K, BlockFP8.tile_dtype)  # the plan's block_m at one token: the table's
        split = default_split_k(K, I, device)  # the op's split for one token's K rows
        gemm1 = fp8_tiles(tiles.gemm1, tiles.block_m, True, 2, split)
        grid = (K * I // BLOCK, split)
        sets = timing.rotations(K * 2 * I * H)
        experts = [torch.randperm(E, device=device, generator=gen)[:K].int() for _ in range(sets)]
        pairs = gemm1.block_k > BLOCK  # the op's steps of two boxes
        calls = [lambda e=e: _read_boxes_kernel[grid](desc, e, out, I, H, BLOCK, BLOCK, split, False, pairs,
                                                     num_warps=gemm1.num_warps, num_stages=gemm1.num_stages)
                 for e in experts]
        us = timing.time_or_none(calls)
        floor = K * 2 * I * H / (read_tbps * 1e12) * 1e6
        rows.append({"model": model, "split_k": split, "pairs": pairs, "stages": gemm1.num_stages,
                     "warps": gemm1.num_warps,
                     "programs": grid[0] * split, "us": us, "floor_us": floor,
                     "x_floor": None if us is None else us / floor})
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    return rows


@triton.jit
def _stream_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """A grid-stride sum of ``n`` fp32 values: the plainest way to read the bytes."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, programs * BLOCK):
        acc += tl.load(x_ptr + start + offs, mask=start + offs < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(acc))


def read_sizes(device: torch.device, read_tbps: float) -> list[dict[str, Any]]:
    """``_stream_kernel`` at each preset's one-token fp8 expert bytes (top-k experts, both GEMMs; then GEMM1's
    alone), the best of 4 or 8 programs an SM and 4,096 or 8,192 values a program's step."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    part = torch.empty(16 * sms, device=device)
    rows = []
    for model in PRESETS:
        cfg = preset(model)
        per = cfg.top_k * cfg.hidden_size * cfg.intermediate_size
        for what, nbytes in (("experts", 3 * per), ("gemm1", 2 * per)):
            bufs = [torch.empty(nbytes // 4, device=device).normal_() for _ in range(timing.rotations(nbytes))]
            best = min(timing.graph_time_us([lambda b=b: _stream_kernel[(sms * per_sm,)](b, part, b.numel(), block,
                                                                                         num_warps=8)
                                             for b in bufs], replays=30)
                       for per_sm in (4, 8) for block in (4096, 8192))
            floor = nbytes / (read_tbps * 1e12) * 1e6
            rows.append({"model": model, "bytes": what, "nbytes": nbytes, "us": best, "floor_us": floor,
                         "x_floor": best / floor})
            print(rows[-1], flush=True)
            del bufs
    return rows


def layer_timelines(device: torch.device) -> list[dict[str, Any]]:
    """The fp8 layer at one token as one CUDA graph: its time, and each kernel's start and end in one replay."""
    rows = []
    for name in PRESETS:
        cfg = preset(name)
        layer = MoELayer(cfg, device=device, quant="fp8").init_random_(seed=1)
        x = torch.randn(1, cfg.hidden_size, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            us = timing.graph_time_us([lambda: layer(x)], replays=30)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layer(x)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    graph.replay()
                    torch.cuda.synchronize()
        events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                        key=lambda e: e.time_range.start)
        last = events[-len(events) // 5:]
        start = last[0].time_range.start
        kernels = [{"kernel": e.name.split("<")[0][:60], "start_us": e.time_range.start - start,
                    "end_us": e.time_range.end - start} for e in last]
        rows.append({"model": name, "layer_us": us, "kernels": kernels})
        print(name, round(us, 1), [(k["kernel"], round(k["start_us"], 1), round(k["end_us"], 1)) for k in kernels],
              flush=True)
        del layer
        torch.cuda.empty_cache()
    return rows


# The fused kernel's builds and launches swept on DeepSeek-V3 at one token: runs of GEMM1's H per column block
# (56 steps: 8 or 4 steps an item), (warps, register cap), stages (3: two programs an SM fit in shared memory, as
# the op's split GEMM1 takes), GEMM1's arithmetic (prequant, swap1: activations quantized in the loop on mma.sync,
# by items of their own on mma.sync, or by items of their own on swapped wgmma), the next item's prefetch; programs
# an SM, and the lag (None: GEMM1 first).
FUSED_SPLITS = (7, 14)
FUSED_BUILDS = ((4, None), (8, None), (8, 128))
FUSED_STAGES = (3,)
FUSED_GEMM1 = ((False, False), (True, False), (True, True))
FUSED_PREFETCH = (False, True)
FUSED_PER_SM = (1, 2, 3)
FUSED_LAGS = (1, None)
FUSED_QUICK = {"splits": (7,), "builds": ((4, None), (8, 128)), "per_sm": (2,)}  # --quick: 24 of the 216


def lag_of(c: dict[str, Any], plan: Any) -> int:
    """A configuration's lag on ``plan``'s tiles: its ``lag``, or None for all of GEMM1 first (a lag of every tile)."""
    return plan.tile_expert.numel() if c["lag"] is None else c["lag"]


def run_fused(c: dict[str, Any], x: torch.Tensor, w1: BlockFP8, w2: BlockFP8, plan: Any, out: torch.Tensor,
              sms: int) -> torch.Tensor | None:
    """``fused_experts_fp8`` in configuration ``c`` (a ``--fused`` row's keys; lag None: all of GEMM1 first) on
    ``sms`` SMs; returns the launcher's give-up flag."""
    return fused_experts_fp8(x, w1, w2, plan, out, split=c["split"], lag=lag_of(c, plan), programs=c["per_sm"] * sms,
                             num_warps=c["warps"], num_stages=c["stages"], maxnreg=c["maxnreg"],
                             prequant=c["prequant"], prefetch=c["prefetch"], swap1=c["swap1"])


@dataclasses.dataclass
class Shape:
    """One preset at one token count, as a sweep's candidates run on it: the weights, the input, a rotation of
    routings (enough that the touched weights overflow the L2) with their plans and outputs, the op's tiles, and the
    GPU's SM count."""

    x: torch.Tensor
    w1: BlockFP8
    w2: BlockFP8
    ids: list  # the routings
    plans: list
    outs: list
    tiles: Any
    sms: int

    @property
    def H(self) -> int:
        return self.x.shape[1]

    @property
    def I(self) -> int:  # noqa: E743 (the model's intermediate width, as SPEC names it)
        return self.w2.shape[2]

    @property
    def op_split(self) -> int:
        """GEMM1's split along K as the op takes it on these routings (``default_split_k``)."""
        return default_split_k(self.ids[0].numel(), self.I, self.x.device)

    def reference(self, plan: Any) -> torch.Tensor:
        """SPEC §5's float64 emulation of ``plan``'s valid rows (a plan of the first routing)."""
        out = torch.zeros(plan.num_rows, self.H, dtype=torch.float64, device=self.x.device)
        return moe_experts_fp8_torch(self.x, self.w1, self.w2, plan, dtype=torch.float64,
                                     out=out)[: int(plan.expert_offsets[-1])]

    def op_calls(self, workspace: torch.Tensor | None = None) -> list[Callable[[], object]]:
        """``moe_experts`` on each routing's plan, into its output."""
        return [lambda p=p, o=o: moe_experts(self.x, self.w1, self.w2, p, out=o, workspace=workspace)
                for p, o in zip(self.plans, self.outs)]

    def split_calls(self, split: int) -> list[Callable[[], object]]:
        """``experts_fp8`` on the op's tiles with GEMM1 split ``split`` ways, on each routing's plan."""
        return [lambda p=p, o=o: experts_fp8(self.x, self.w1, self.w2, p, o, self.tiles.gemm1, self.tiles.gemm2,
                                             split_k=split) for p, o in zip(self.plans, self.outs)]


def make_shape(M: int, K: int, w1: BlockFP8, w2: BlockFP8, gen: torch.Generator) -> tuple[Shape, float]:
    """The :class:`Shape` of M tokens of K slots on these weights, on the op's plans, with as many random routings
    as the touched weights need to overflow the L2; and the experts a routing touches, on average."""
    E, H, I = w1.shape[0], w1.shape[2], w2.shape[2]  # noqa: E741 (SPEC's name)
    device = w1.values.device
    bytes_per_expert = sum(w.values[0].numel() + w.scales[0].numel() * 4 for w in (w1, w2))
    x = torch.randn(M, H, device=device, generator=gen).bfloat16()
    block_m = plan_block_m(M, w1, K, torch.bfloat16)
    ids = [_routing(M, E, K, device, gen)[1] for _ in range(timing.rotations(M * K * bytes_per_expert))]
    plans = [moe_dispatch(i, E, block_m) for i in ids]
    touched = sum(int(torch.unique(p.tile_expert[p.tile_expert >= 0]).numel()) for p in plans) / len(plans)
    tiles = configs.pick(M, E, H, I, K, tile_dtype(w1, torch.bfloat16), block_m=block_m)
    outs = [torch.empty(p.num_rows, H, dtype=torch.bfloat16, device=device) for p in plans]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return Shape(x, w1, w2, ids, plans, outs, tiles, sms), touched


def preset_shapes(name: str) -> list[tuple[int, int]]:
    """(tokens, slots a token) a sweep times per preset: 1, 2 and 16 tokens, and 1 with the shared expert's slot."""
    cfg = preset(name)
    return [(1, cfg.top_k), (2, cfg.top_k), (16, cfg.top_k)] + ([(1, cfg.top_k + 1)] if cfg.num_shared_experts
                                                                else [])


def sweep_rows(device: torch.device, read_tbps: float, name: str, shape_list: Sequence[tuple[int, int]],
               configs_: Sequence[dict[str, Any]], candidate: Callable[[Shape, dict[str, Any]], dict | None],
               gen: torch.Generator) -> list[dict[str, Any]]:
    """Per shape of preset ``name``: the op and ``experts_fp8`` split as the op splits, then one row per
    configuration that ``candidate(shape, c)`` times (None: it does not run there; a missing row, not a stop)."""
    cfg = preset(name)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w1, w2 = random_fp8(E, 2 * I, H, device), random_fp8(E, H, I, device)
    bytes_per_expert = sum(w.values[0].numel() + w.scales[0].numel() * 4 for w in (w1, w2))
    rows = []
    for M, K in shape_list:
        shape, touched = make_shape(M, K, w1, w2, gen)
        workspace = experts_workspace(device)  # as MoELayer passes one: the split's counters need no zeroing kernel
        base = {"model": name, "M": M, "slots": K, "block_m": shape.plans[0].block_m,
                "read_floor_us": touched * bytes_per_expert / (read_tbps * 1e12) * 1e6,
                "op_us": timing.time_or_none(shape.op_calls()),
                "op_workspace_us": timing.time_or_none(shape.op_calls(workspace)),
                "split_op_us": timing.time_or_none(shape.split_calls(shape.op_split)), "op_split": shape.op_split}
        for c in configs_:
            extra = candidate(shape, c)
            if extra is None:
                continue
            rows.append({**base, **c, **extra})
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    del w1, w2
    torch.cuda.empty_cache()
    return rows


def sweep_then_presets(device: torch.device, read_tbps: float, every: Sequence[dict[str, Any]],
                       candidate: Callable[[Shape, dict[str, Any]], dict | None], key: str,
                       save: Callable[[dict[str, Any]], None], seed: int, keep: int = 4) -> None:
    """Every configuration on DeepSeek-V3 at one token, then the ``keep`` fastest (by ``key``) on every preset and
    token count; ``save`` gets the results so far after the sweep and after each preset."""
    gen = torch.Generator(device).manual_seed(seed)
    sweep = sweep_rows(device, read_tbps, "deepseek-v3", [(1, preset("deepseek-v3").top_k)], every, candidate, gen)
    save({"sweep": sweep})
    timed = sorted((r for r in sweep if r[key] is not None), key=lambda r: r[key])
    best = [{k: r[k] for k in every[0]} for r in timed[:keep]]
    presets: list[dict[str, Any]] = []
    for name in PRESETS:
        presets += sweep_rows(device, read_tbps, name, preset_shapes(name), best, candidate, gen)
        save({"sweep": sweep, "presets": presets})


def fused_candidate(shape: Shape, c: dict[str, Any]) -> dict[str, Any] | None:
    """The fused kernel in configuration ``c``: its time, its give-up flag, and whether its output has the same
    bits as ``experts_fp8`` split the same way on the same tiles (on mma.sync it must)."""
    calls = [lambda p=p, o=o: run_fused(c, shape.x, shape.w1, shape.w2, p, o, shape.sms)
             for p, o in zip(shape.plans, shape.outs)]
    us = timing.time_or_none(calls)
    if us is None:  # did not compile or launch here (reported on stderr)
        return None
    plan, got = shape.plans[0], shape.outs[0]
    want = torch.empty_like(got)
    experts_fp8(shape.x, shape.w1, shape.w2, plan, want, shape.tiles.gemm1,
                dataclasses.replace(shape.tiles.gemm2, block_n=128), split_k=c["split"])
    gave_up = calls[0]()
    n = int(plan.expert_offsets[-1])
    steps_per_run = triton.cdiv(triton.cdiv(shape.H, 128), c["split"])
    return {"fused_us": us, "same_bits": bool(torch.equal(got[:n], want[:n])), "rel_diff": rel_error(got[:n], want[:n]),
            "gave_up": int(gave_up), "gemm1_item_kb": 2 * 128 * 128 * steps_per_run / 1024,
            "gemm2_item_kb": 128 * shape.I / 1024}


def fused_sweep(device: torch.device, read_tbps: float, save: Callable[[dict[str, Any]], None],
                quick: bool = False) -> None:
    """The fused kernel against the op: every configuration (``quick``: ``FUSED_QUICK``'s) on DeepSeek-V3 at one
    token, then the fastest few on every preset and token count."""
    splits, builds, per_sms = ((FUSED_QUICK["splits"], FUSED_QUICK["builds"], FUSED_QUICK["per_sm"]) if quick
                               else (FUSED_SPLITS, FUSED_BUILDS, FUSED_PER_SM))
    every = [{"split": split, "warps": warps, "maxnreg": maxnreg, "stages": stages, "prequant": prequant,
              "swap1": swap1, "prefetch": prefetch, "per_sm": per_sm, "lag": lag}
             for split in splits for warps, maxnreg in builds for stages in FUSED_STAGES
             for prequant, swap1 in FUSED_GEMM1 for prefetch in FUSED_PREFETCH for per_sm in per_sms
             for lag in FUSED_LAGS]
    sweep_then_presets(device, read_tbps, every, fused_candidate, "fused_us", save, seed=3)


# The warp-specialized kernel's launches swept on DeepSeek-V3 at one token: runs of GEMM1's H per column block,
# (programs an SM, ring slots, registers a thread at launch: one program an SM at 168, two at 128 with at most 6
# slots of 16 KB, so that two fit in shared memory), and the lag (None: GEMM1 first).
WS_SPLITS = (7, 14)
WS_LAUNCHES = ((1, 8, 168), (1, 12, 168), (2, 4, 128), (2, 6, 128))
WS_LAGS = (1, 3, None)


def ws_table(c: dict[str, Any], plan: Any, H: int, I: int) -> torch.Tensor:  # noqa: E741 (SPEC's name)
    """The item table of a ``--ws`` configuration ``c`` (lag None: all of GEMM1 first) on ``plan``'s tiles."""
    runs, _ = ws_decode.runs_of(H, c["split"])
    return ws_decode.item_table(plan.tile_expert.numel(), lag_of(c, plan), (I // 128) * runs, H // 128,
                                plan.tile_expert.device)


def run_ws(c: dict[str, Any], x: torch.Tensor, w1: BlockFP8, w2: BlockFP8, plan: Any, out: torch.Tensor, sms: int,
           table: torch.Tensor) -> torch.Tensor | None:
    """``ws_experts_fp8`` in configuration ``c`` (a ``--ws`` row's keys) on ``sms`` SMs, over ``table``
    (:func:`ws_table`); returns the launcher's give-up flag."""
    return ws_decode.ws_experts_fp8(x, w1, w2, plan, out, table, split=c["split"], programs=c["per_sm"] * sms,
                                    stages=c["stages"], maxnreg=c["maxnreg"])


def ws_candidate(shape: Shape, c: dict[str, Any]) -> dict[str, Any] | None:
    """The warp-specialized kernel in configuration ``c``: its time, its give-up flag, whether its output has the
    same bits as the fused ``tl`` kernel's on swapped wgmma (``swap1``, the same split and order: the same numerics
    on another structure), its largest difference from the op, and both errors from SPEC §5's float64 emulation."""
    plans, outs = shape.plans, shape.outs
    if plans[0].block_m != ws_decode.BLOCK_M:  # the op's taller tiles at 16 tokens: the same routings in 16s
        plans = [moe_dispatch(i, shape.w1.shape[0], ws_decode.BLOCK_M) for i in shape.ids]
        outs = [torch.empty(p.num_rows, shape.H, dtype=torch.bfloat16, device=shape.x.device) for p in plans]
    plan, got = plans[0], outs[0]
    table = ws_table(c, plan, shape.H, shape.I)  # a shape's plans have the same tile count: one table for all
    us = timing.time_or_none([lambda p=p, o=o: run_ws(c, shape.x, shape.w1, shape.w2, p, o, shape.sms, table)
                              for p, o in zip(plans, outs)])
    if us is None:  # did not compile or launch here (reported on stderr)
        return None
    n = int(plan.expert_offsets[-1])
    swap1 = torch.empty_like(got)
    fused_experts_fp8(shape.x, shape.w1, shape.w2, plan, swap1, split=c["split"], lag=lag_of(c, plan),
                      programs=2 * shape.sms, num_warps=8, maxnreg=128, prequant=True, swap1=True)
    op = torch.empty_like(got)
    moe_experts(shape.x, shape.w1, shape.w2, plan, out=op)
    gave_up = run_ws(c, shape.x, shape.w1, shape.w2, plan, got, shape.sms, table)
    ref = shape.reference(plan)
    return {"ws_us": us, "gave_up": int(gave_up), "same_bits_as_swap1": bool(torch.equal(got[:n], swap1[:n])),
            "rel_diff_op": rel_error(got[:n], op[:n]), "err_f64": rel_error(got[:n], ref),
            "rms_f64": rms_rel_error(got[:n], ref), "op_err_f64": rel_error(op[:n], ref)}


def ws_sweep(device: torch.device, read_tbps: float, save: Callable[[dict[str, Any]], None]) -> None:
    """The warp-specialized kernel against the op: every launch on DeepSeek-V3 at one token, then the fastest few
    on every preset and token count."""
    every = [{"split": split, "per_sm": per_sm, "stages": stages, "maxnreg": maxnreg, "lag": lag}
             for split in WS_SPLITS for per_sm, stages, maxnreg in WS_LAUNCHES for lag in WS_LAGS]
    sweep_then_presets(device, read_tbps, every, ws_candidate, "ws_us", save, seed=5)


# GEMM2's launches tried inside the op at one token (columns a program, stages, warps): fewer stages fit more
# programs an SM (DeepSeek-V3's 448 at 128 columns: 3 an SM on 4 stages, 1.13 waves; 4 an SM on 3, one wave).
GEMM2_LAUNCHES = ((128, 4, 4), (128, 3, 4), (128, 2, 4), (64, 4, 4), (64, 3, 4), (256, 3, 4), (256, 3, 8),
                  (128, 3, 8))


def gemm2_candidate(shape: Shape, c: dict[str, Any]) -> dict[str, Any] | None:
    """``experts_fp8`` with GEMM2's launch ``c`` (GEMM1 and its split as the op's, with a workspace): its time, and
    whether its output has the op's bits (the order of the sums does not change, so it must)."""
    gemm2 = dataclasses.replace(shape.tiles.gemm2, block_n=c["block_n"], num_stages=c["stages"], num_warps=c["warps"])
    split, workspace = shape.op_split, experts_workspace(shape.x.device)
    outs = [torch.empty_like(o) for o in shape.outs]
    us = timing.time_or_none([lambda p=p, o=o: experts_fp8(shape.x, shape.w1, shape.w2, p, o, shape.tiles.gemm1,
                                                           gemm2, split_k=split, workspace=workspace)
                              for p, o in zip(shape.plans, outs)])
    if us is None:  # did not compile or launch here (reported on stderr)
        return None
    plan = shape.plans[0]
    n = int(plan.expert_offsets[-1])
    want = moe_experts(shape.x, shape.w1, shape.w2, plan)
    return {"gemm2_us": us, "same_bits": bool(torch.equal(outs[0][:n], want[:n])),
            "op_gemm2": dataclasses.asdict(shape.tiles.gemm2)}


def gemm2_launches(device: torch.device, read_tbps: float) -> list[dict[str, Any]]:
    """Per preset at one token: the op, then ``experts_fp8`` with each of ``GEMM2_LAUNCHES`` (``gemm2_candidate``)."""
    gen = torch.Generator(device).manual_seed(7)
    launches = [{"block_n": block_n, "stages": stages, "warps": warps} for block_n, stages, warps in GEMM2_LAUNCHES]
    return [row for name in PRESETS
            for row in sweep_rows(device, read_tbps, name, [(1, preset(name).top_k)], launches, gemm2_candidate, gen)]


# The layer-level prefetch's launches: (programs, evict_last); 0 programs: the layer as it is.
PREFETCH_LAUNCHES = ((0, False), (8, False), (8, True), (32, False), (32, True))


def layer_prefetch(device: torch.device) -> list[dict[str, Any]]:
    """The fp8 layer at one token with its shared expert's weights asked of the L2 as the call starts
    (``l2_prefetch.with_shared_prefetch``), per preset with a shared expert and launch. Three layers of the preset
    are called in turn, so that a layer's shared expert is not still in the L2 from its last call (the other two
    stream about 800 MB between); µs per layer call under graph replay, and whether the outputs keep their bits."""
    rows = []
    for name in PRESETS:
        cfg = preset(name)
        if not cfg.num_shared_experts:
            continue
        # no self-captured graphs: one captured before the wrapper would replay without it (the timing captures)
        layers = [MoELayer(cfg, device=device, quant="fp8", graph_max_tokens=0).init_random_(seed=seed)
                  for seed in range(3)]
        x = torch.randn(1, cfg.hidden_size, device=device, dtype=torch.bfloat16)
        if not layers[0].uses_shared_slot(1, device):
            print(name, "runs its shared expert on the side stream at one token: not a slot, skipped", flush=True)
            continue
        with torch.no_grad():
            want = [layer(x) for layer in layers]
            for programs, evict_last in PREFETCH_LAUNCHES:
                undo = [with_shared_prefetch(layer, programs, evict_last) for layer in layers] if programs else []
                us = timing.time_or_none([lambda layer=layer: layer(x) for layer in layers], replays=30)
                same = us is not None and all(torch.equal(layer(x), w) for layer, w in zip(layers, want))
                for u in undo:
                    u()
                rows.append({"model": name, "programs": programs, "evict_last": evict_last, "layer_us": us,
                             "same_bits": same})
                print(rows[-1], flush=True)
        del layers
        torch.cuda.empty_cache()
    return rows


def ncu_target(device: torch.device, name: str, fused: dict[str, Any] | None, ws: dict[str, Any] | None) -> None:
    """Preset ``name``'s experts at one token for Nsight Compute: each call once to compile, then the op once (and the
    fused kernel once, with the configuration ``fused`` as ``fused_sweep`` writes it, and the warp-specialized one
    with ``ws`` as ``ws_sweep`` does) inside an NVTX range "meas" (``ncu --nvtx --nvtx-include "meas/"`` profiles
    just those kernels)."""
    cfg = preset(name)
    E, H, I, K = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    w1, w2 = random_fp8(E, 2 * I, H, device), random_fp8(E, H, I, device)
    gen = torch.Generator(device).manual_seed(4)
    x = torch.randn(1, H, device=device, generator=gen).bfloat16()
    ids = _routing(1, E, K, device, gen)[1]
    plan = moe_dispatch(ids, E, plan_block_m(1, w1, K, torch.bfloat16))
    out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    calls: list[Callable[[], object]] = [lambda: moe_experts(x, w1, w2, plan, out=out)]
    if fused is not None:
        calls.append(lambda: run_fused(fused, x, w1, w2, plan, out, sms))
    if ws is not None:
        ws_plan = plan if plan.block_m == ws_decode.BLOCK_M else moe_dispatch(ids, E, ws_decode.BLOCK_M)
        ws_out = torch.empty(ws_plan.num_rows, H, dtype=torch.bfloat16, device=device)
        table = ws_table(ws, ws_plan, H, I)
        calls.append(lambda: run_ws(ws, x, w1, w2, ws_plan, ws_out, sms, table))
    for call in calls:
        call()
    torch.cuda.synchronize()
    for call in calls:
        torch.cuda.nvtx.range_push("meas")
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--layer", action="store_true", help="the fp8 layers' one-token timelines too")
    parser.add_argument("--read", action="store_true", help="only GEMM1's boxes streamed with no arithmetic")
    parser.add_argument("--fused", action="store_true", help="only the one-launch kernel over both GEMMs")
    parser.add_argument("--quick", action="store_true", help="with --fused: 24 of its 216 configurations")
    parser.add_argument("--ws", action="store_true", help="only the warp-specialized kernel over both GEMMs")
    parser.add_argument("--gemm2-launch", action="store_true", help="only the op at one token with GEMM2's launch "
                        "changed")
    parser.add_argument("--layer-prefetch", action="store_true",
                        help="only the fp8 layer at one token with its shared expert's weights prefetched into L2")
    parser.add_argument("--ncu-target", choices=PRESETS, help="only one preset's one-token calls, for ncu")
    parser.add_argument("--ws-config", type=json.loads, help="with --ncu-target: the warp-specialized kernel too, "
                        "this configuration (JSON, the keys of a --ws row)")
    parser.add_argument("--fused-config", type=json.loads, help="with --ncu-target: the fused kernel too, this "
                        "configuration (JSON, the keys of a --fused row)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")

    def write(**results: Any) -> None:
        """``results`` into ``--json`` (if given), after the GPU's name and torch's version."""
        if args.json:
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                             **results}, indent=1))

    if args.ncu_target:
        ncu_target(device, args.ncu_target, args.fused_config, args.ws_config)
        return 0
    if args.layer_prefetch:
        write(layer_prefetch=layer_prefetch(device))
        return 0
    ceilings = timing.measure_ceilings(gemm=False)
    if args.fused or args.ws:
        def save(results: dict[str, Any]) -> None:
            write(triton=triton.__version__, read_tbps=ceilings.read_tbps, **results)

        if args.ws:
            ws_sweep(device, ceilings.read_tbps, save)
        else:
            fused_sweep(device, ceilings.read_tbps, save, quick=args.quick)
        return 0
    if args.gemm2_launch:
        write(read_tbps=ceilings.read_tbps, gemm2_launch=gemm2_launches(device, ceilings.read_tbps))
        return 0
    if args.read:
        write(read_tbps=ceilings.read_tbps, read=read_pattern(device, ceilings.read_tbps),
              launches=read_launches(device, ceilings.read_tbps), sizes=read_sizes(device, ceilings.read_tbps))
        return 0
    result: dict[str, Any] = {"read_tbps": ceilings.read_tbps, "errors": errors(device),
                              "time": time_presets(device, ceilings.read_tbps)}
    if args.layer:
        result["layer"] = layer_timelines(device)
    write(**result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
