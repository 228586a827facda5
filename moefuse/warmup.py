"""Warm-up: compile every kernel variant a layer can launch up to a token count, before serving.

Triton compiles a kernel the first time it sees a new combination of compile-time constants (tile shapes from the
tile table, block sizes derived from the token count, ...). On the request path that is a stall of 0.1 to 2 s.
Integer arguments that vary with the token count are marked ``do_not_specialize`` in every launched kernel
(``tests/test_warmup.py`` checks it), so a variant is decided by the launch-shape functions of the stages alone;
:func:`launch_signature` collects them for one token count, and :func:`warmup` runs each layer once at the smallest
token count of each distinct signature (never a full-size activation per bucket when a smaller batch compiles the
same thing), and at every token count that the layer's self-captured decode graphs cover
(``MoELayer.graph_max_tokens``), so those are captured too.

Triton keeps what it compiled on disk (``TRITON_CACHE_DIR``, default ``~/.triton/cache``): a later process loads
instead of compiling, which :func:`warmup` then does in a fraction of the time. Ship that folder with a container
image (run the warm-up once while building it) and set ``TRITON_CACHE_DIR`` to it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from moefuse import _runtime
from moefuse.dispatch.kernel import launch_shape as dispatch_shape
from moefuse.experts import configs, plan_block_m
from moefuse.experts.op import launch_variant, rows_linear_tiles
from moefuse.finalize.kernel import finalize_tile
from moefuse.formats import tile_dtype
from moefuse.layer import MoELayer
from moefuse.route import kernel as gate_kernel
from moefuse.route import linear

if TYPE_CHECKING:
    from triton.runtime.jit import JITFunction


@dataclass
class WarmupReport:
    """What :func:`warmup` did."""

    layers: int = 0
    token_counts: list[int] = field(default_factory=list)  # the batch sizes run on the first layer of each shape
    compiled: int = 0  # kernel variants compiled or loaded from the disk cache
    graphs: int = 0  # decode graphs captured, over all layers
    seconds: float = 0.0

    def __str__(self) -> str:
        return (f"moefuse warm-up: {self.layers} layer(s), {len(self.token_counts)} batch sizes, "
                f"{self.compiled} kernel variants compiled or loaded, {self.graphs} decode graphs captured, "
                f"{self.seconds:.1f} s")


def launch_signature(layer: MoELayer, num_tokens: int) -> tuple:
    """Everything that decides which kernel variants a forward of ``num_tokens`` tokens launches (and, up to the
    layer's ``graph_max_tokens``, the token count itself: each has its own decode graph)."""
    c = layer.config
    device, dtype = layer.experts.gate_up_proj.device, layer.activation_dtype
    slot = layer.uses_shared_slot(num_tokens, device)
    top_k = c.top_k + slot
    arch = configs.arch_of(device)
    gate_up = layer.experts.weights()[0]
    # The plan's tile height and launch as the layer picks them (MXFP4 with fp8 activations: the W4A8 kernels'
    # heights; with the shared expert as a slot, the quantized formats' launch counts it).
    invariant = _runtime.batch_invariant(layer.batch_invariant)
    _, tiles = layer.expert_tiles(num_tokens, device, slot)
    # What else the experts op keys its kernels on (its weights' format decides: experts.launch_variant).
    variant = launch_variant(gate_up, num_tokens * top_k, layer.activation_quant, invariant)
    # A quantized shared expert not run as one more slot of the routed GEMMs (MoELayer.uses_shared_slot): cuBLAS,
    # or a one-expert grouped GEMM (an unquantized one runs on cuBLAS through nn.Linear: primed by _prime_cublas).
    shared: object = None
    if layer.shared_format.quantized and layer.shared_experts is not None and not slot:
        if layer.shared_experts.runs_on_cublas(num_tokens, dtype, device):
            shared = "cublas"
        else:
            shared_up = layer.shared_weights()[0]
            shared_dtype = tile_dtype(shared_up, dtype)
            shared_m = plan_block_m(num_tokens, shared_up, 1, dtype, "default", arch, batch_invariant=invariant,
                                    persistent=layer.persistent)
            shared_tiles = configs.pick(num_tokens, 1, c.hidden_size, c.shared_intermediate_size, 1, shared_dtype, arch,
                                        block_m=shared_m)
            shared = (shared_tiles, dispatch_shape(num_tokens, 1, shared_tiles.block_m),
                      launch_variant(shared_up, num_tokens, "default", invariant))
    elif invariant and layer.shared_experts is not None:  # rows_linear: GEMM2 tiles of the two projection shapes
        shared = tuple(rows_linear_tiles(num_tokens, proj.weight, dtype, arch).gemm2
                       for proj in (layer.shared_experts.gate_proj, layer.shared_experts.down_proj))
    return (
        num_tokens if num_tokens <= layer.graphs.max_tokens else None,
        slot,
        layer.supports_deferred_finalize,
        "invariant" if invariant else linear.launch_key(num_tokens, c.num_experts, c.hidden_size, dtype,
                                                        layer.gate.weight.dtype, device),
        (1, 1) if invariant else gate_kernel.launch_config(num_tokens, c.num_experts, c.num_expert_group),
        dispatch_shape(num_tokens * top_k, c.num_experts + slot, tiles.block_m),
        tiles,
        variant,
        shared,
        finalize_tile(num_tokens, c.hidden_size, dtype),
    )


def token_counts(layer: MoELayer, max_tokens: int) -> list[int]:
    """The smallest token count of each distinct :func:`launch_signature` in ``1..max_tokens``."""
    seen: dict[tuple, int] = {}
    for num_tokens in range(1, max_tokens + 1):
        seen.setdefault(launch_signature(layer, num_tokens), num_tokens)
    return sorted(seen.values())


class Compilations:
    """The moefuse kernel variants compiled (or loaded from the disk cache) since it was made, read live:
    ``len()`` counts them and iteration gives their names.

    It compares the size of each kernel's in-memory variant cache with its size at the start, instead of using
    Triton's ``jit_cache_hook``: before calling that hook Triton serializes the variant's constants to JSON, which
    fails on a Gluon kernel's layout constants (Triton 3.6 and 3.9), so a hook would break the first launch of every
    Gluon kernel. Kernels of modules imported later count from zero. Under the interpreter nothing is compiled and
    nothing is counted."""

    def __init__(self) -> None:
        self._start = {fn: _variants(fn) for fn in _kernels()}

    def names(self) -> list[str]:
        """One kernel name per new variant."""
        return [fn.fn.__qualname__ for fn in _kernels() for _ in range(_variants(fn) - self._start.get(fn, 0))]

    def __len__(self) -> int:
        return len(self.names())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def _kernels() -> list[JITFunction]:
    """The Triton and Gluon kernels defined in moefuse's imported modules."""
    from triton.runtime.jit import JITFunction

    return [obj for name, module in list(sys.modules.items())
            if module is not None and (name == "moefuse" or name.startswith("moefuse."))
            for obj in vars(module).values() if isinstance(obj, JITFunction) and obj.fn.__module__ == name]


def _variants(fn: JITFunction) -> int:
    """Variants of ``fn`` in memory, over all devices (``device_caches``: each device's first entry is its cache)."""
    return sum(len(cache[0]) for cache in getattr(fn, "device_caches", {}).values())


def _layers(module: nn.Module) -> list[MoELayer]:
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def _progress(message: str) -> None:
    print(f"[moefuse warmup {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@torch.no_grad()
def warmup(module: nn.Module, max_tokens: int = 4096, *, progress: bool = True) -> WarmupReport:
    """Compile every kernel variant the ``MoELayer`` s in ``module`` (a layer, or a model patched by
    :func:`moefuse.patch`) can launch for 1 to ``max_tokens`` tokens, and capture their decode graphs.

    Runs each layer shape once per distinct launch signature (on random activations of the smallest batch that
    has it), and every further layer of the same shape only at its graph sizes. Layers on the CPU or with the
    reference backend compile nothing and are skipped. Returns a :class:`WarmupReport`; with ``progress`` it
    reports on stderr as it goes.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    start = time.perf_counter()
    layers = [m for m in _layers(module) if m.experts.gate_up_proj.is_cuda and m.backend != "reference"]
    report = WarmupReport(layers=len(layers))
    done: dict[tuple, list[int]] = {}
    compiled = Compilations()
    for i, layer in enumerate(layers, 1):
        layer.check_weights()  # what the forward does not check (e.g. MXFP4 exponents): before any request
        weight = layer.experts.gate_up_proj
        shape = (layer.config, weight.dtype, weight.device, layer.graphs.max_tokens, layer.shared_slot_max_tokens,
                 layer.shared_slot_weights() is not None, layer.shared_quant, layer.activation_quant,
                 layer.activation_dtype)
        first_of_shape = shape not in done
        if first_of_shape:
            done[shape] = token_counts(layer, max_tokens)
            report.token_counts += done[shape]
            counts = done[shape]
        else:  # kernels compiled already: only this layer's own decode graphs are left to capture
            counts = [m for m in done[shape] if m <= layer.graphs.max_tokens]
        for j, num_tokens in enumerate(counts, 1):
            if progress and (j == len(counts) or j % 8 == 1):
                _progress(f"layer {i}/{len(layers)}: batch size {num_tokens} ({j}/{len(counts)}), "
                          f"{len(compiled)} variants so far")
            x = torch.randn(num_tokens, layer.config.hidden_size, device=weight.device,
                            dtype=layer.activation_dtype)
            layer(x, input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=weight.device))
        if first_of_shape:
            _prime_cublas(layer, max_tokens)
        report.graphs += len(layer.graphs)
        torch.cuda.synchronize(layer.experts.gate_up_proj.device)
    report.compiled = len(compiled)
    report.seconds = time.perf_counter() - start
    if progress:
        _progress(str(report))
    return report


def _prime_cublas(layer: MoELayer, max_tokens: int) -> None:
    """Run the layer's cuBLAS GEMMs (router linear past ``linear.MAX_TOKENS`` tokens, shared expert) at every token
    count up to ``max_tokens`` that does not replay a graph. cuBLAS picks a kernel per shape and loads it on its
    first use: 2.3 to 3.1 ms each on an H200 (torch 2.11), which a first call at a new batch size would
    otherwise pay, once per GEMM. One activation buffer of ``max_tokens`` rows serves every count."""
    device = layer.experts.gate_up_proj.device
    x = torch.randn(max_tokens, layer.config.hidden_size, device=device, dtype=layer.activation_dtype)
    for num_tokens in range(layer.graphs.max_tokens + 1, max_tokens + 1):
        if num_tokens > linear.MAX_TOKENS:
            layer.gate.logits(x[:num_tokens])
        if layer.shared_experts is not None and not layer.uses_shared_slot(num_tokens, device):
            layer._shared(x[:num_tokens])

