"""CUDA graphs a module captures of its own forward, for small fixed token counts (eager decode).

An eager decode step of a MoE layer launches about ten kernels and the torch ops around them; on the host that
costs more than the GPU needs to run them at one token (1,091 µs of host time against 199 µs on the GPU; H200,
2026-12-01).
:class:`DecodeGraphs` replays a graph captured on the first call at a given token count instead: the host then
spends a copy in, one replay and a copy out.

When a graph is (re)captured, and what it holds:

- One graph per token count up to ``max_tokens``, captured on the first call with that count (a warm-up call,
  then the capture: a few milliseconds, once).
- The graph reads the weights where they were at capture. The key of a graph holds every parameter's and
  buffer's address, dtype and device, and the caller's own settings: replacing a weight tensor, ``.to()`` or a
  dtype change re-captures (the old graph of that token count is dropped); an in-place update
  (``load_state_dict``, ``copy_``) keeps the addresses, and the graph reads the new values.
- Memory: the graphs of one :class:`DecodeGraphs` share one private pool, as large as the largest token count's
  intermediates (DeepSeek-V3 at 16 tokens: about 3 MB), plus a static input and output per token count.
  :meth:`DecodeGraphs.clear` frees them.
- The output is copied out of the graph's static buffer, so a result stays valid after later calls.

Graphs are used only where they are sound: CUDA tensors, no autograd (``torch.no_grad`` or inference mode), not
while another graph is being captured (a whole-model capture records the plain path), not under
``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor
    static_out: torch.Tensor


class DecodeGraphs:
    """Captured forwards of ``fn`` [M, H] -> [M, H'] for M <= ``max_tokens``, keyed by the module's state."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._key: Hashable = None
        self._graphs: dict[int, _Graph] = {}
        self._pool: Any = None  # a CUDA graph memory pool handle (torch's type is private)

    def __getstate__(self) -> dict:  # copy.deepcopy and torch.save of a module: the copy captures its own
        return {"max_tokens": self.max_tokens}

    def __setstate__(self, state: dict) -> None:
        DecodeGraphs.__init__(self, state["max_tokens"])

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph and the memory they hold."""
        self._graphs.clear()
        self._pool = None
        self._key = None

    def applies(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x`` [M, H] may replay a graph (see the module docstring)."""
        return (
            0 < x.shape[0] <= self.max_tokens
            and x.is_cuda
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing()
        )

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, key: Hashable) -> torch.Tensor:
        """``fn(x)``, replayed from the graph of x's token count when its key still matches, else captured anew."""
        if key != self._key:  # new weights, device or settings: every graph is stale
            self.clear()
            self._key = key
        entry = self._graphs.get(x.shape[0])
        if entry is None:
            entry = self._capture(fn, x)
        entry.static_in.copy_(x)
        entry.graph.replay()
        return entry.static_out.clone()

    def _capture(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> _Graph:
        static_in = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
        # Warm up on a side stream (PyTorch's recipe): kernels compile and libraries create handles outside the graph.
        main, side = torch.cuda.current_stream(x.device), torch.cuda.Stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            fn(static_in)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            static_out = fn(static_in)
        self._pool = graph.pool()
        entry = _Graph(graph, static_in, static_out)
        self._graphs[x.shape[0]] = entry
        return entry


def state_key(module: nn.Module) -> tuple:
    """Address and dtype of every parameter and buffer of ``module``: a graph replaying its forward is valid while
    this (and the device, which the caller adds) is unchanged; an in-place update keeps it.

    A plain walk over ``_parameters``/``_buffers``: ``module.parameters()`` costs several times as much, and
    this runs on every eager call.
    """
    key: list = []
    stack = [module]
    while stack:
        m = stack.pop()
        for tensors in (m._parameters, m._buffers):
            for t in tensors.values():
                if t is not None:
                    key += (t.data_ptr(), t.dtype)
        stack += [child for child in m._modules.values() if child is not None]
    return tuple(key)
