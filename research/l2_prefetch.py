"""A layer-level candidate for fp8 decode: the shared expert's weights asked of the L2 while the router chain runs.

At one token the fp8 layer runs the shared expert as one more slot of the grouped GEMMs (``shared_slot_max_tokens``),
so its weights stream only once dispatch has run: the router linear, the gate and dispatch (6-11 µs, PERF-NOTES,
2026-12-04) leave DRAM idle. The shared expert's weights do not depend on the routing. Here a small
kernel on a side stream, forked as the layer starts, asks the L2 for them (``prefetch.global.L2``, no data into
the SMs, a few CTAs so that the router's kernels keep theirs); the grouped GEMMs then find the slot's weights
there. Forking the shared expert's whole computation before the router was measured on 2026-12-02 and lost (its
GEMMs took the SMs the router linear needed); a prefetch holds no SM for long.

A probe: ``fp8_decode_probe --layer-prefetch`` times the layer with and without it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from moefuse.formats import ExpertWeight
from moefuse.layer import MoELayer

# The inline PTX of ``_prefetch_l2``, with and without the eviction hint: a dummy output, as inline_asm_elementwise
# needs one.
_PREFETCH = tl.constexpr("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;")
_PREFETCH_EVICT_LAST = tl.constexpr("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;")


@triton.jit
def _prefetch_l2(ptrs, EVICT_LAST: tl.constexpr):
    """Ask the L2 for the 128-byte lines at ``ptrs`` (``EVICT_LAST``: to be kept there first); nothing comes back.
    Inline PTX: compiled kernels only (``fused_decode.py`` asks for its next item's lines with it too)."""
    tl.inline_asm_elementwise(_PREFETCH_EVICT_LAST if EVICT_LAST else _PREFETCH, "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Ask the L2 for every 128-byte line of ``ptr[0:nbytes]``, ``LINES`` lines a program's step, grid-stride."""
    for start in range(tl.program_id(0) * LINES, tl.cdiv(nbytes, 128), tl.num_programs(0) * LINES):
        lines = start + tl.arange(0, LINES)
        _prefetch_l2(ptr + tl.minimum(lines, tl.cdiv(nbytes, 128) - 1).to(tl.int64) * 128,  # past the end: the last
                     EVICT_LAST)


def prefetch_into_l2(tensors: list[torch.Tensor], programs: int, evict_last: bool) -> None:
    """Ask the L2 for each contiguous tensor's bytes (``programs`` programs of 4 warps each)."""
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("prefetch_into_l2 takes contiguous tensors")
        if t.numel():
            _l2_prefetch_kernel[(programs,)](t, t.numel() * t.element_size(), LINES=512, EVICT_LAST=evict_last,
                                             num_warps=4)


def _expert(weight: ExpertWeight, e: int) -> list[torch.Tensor]:
    """Expert ``e``'s tensors of a stacked weight: the tensor's slice, or a quantized format's values and scales."""
    if isinstance(weight, torch.Tensor):
        return [weight[e]]
    return [weight.values[e], weight.scales[e]]


def with_shared_prefetch(layer: MoELayer, programs: int, evict_last: bool) -> Callable[[], None]:
    """Make ``layer`` (a :class:`moefuse.MoELayer` whose shared expert runs as a slot) fork the prefetch of its
    shared expert's values and scales (expert E of the stacked weights) onto a side stream as each slot call
    starts, joined when the call ends. Returns the undo. A decode graph the layer captured itself before
    (``graph_max_tokens``) replays without it: build the layer with ``graph_max_tokens=0`` and capture around it."""
    original = layer._forward_shared_slot
    E = layer.config.num_experts
    side = torch.cuda.Stream(layer.gate.weight.device)

    def forward(x: torch.Tensor, gate_up_proj: ExpertWeight, down_proj: ExpertWeight) -> torch.Tensor:
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch_into_l2([t for weight in (gate_up_proj, down_proj) for t in _expert(weight, E)], programs,
                             evict_last)
        out = original(x, gate_up_proj, down_proj)
        main.wait_stream(side)
        return out

    setattr(layer, "_forward_shared_slot", forward)  # noqa: B010  (the instance's, before the class's)

    def undo() -> None:
        delattr(layer, "_forward_shared_slot")

    return undo

