"""Warm-up on any machine: the batch sizes it chooses, and its argument checks. (Whether a warmed-up layer
compiles anything afterwards is a GPU test, in test_gpu.py: the interpreter compiles nothing.)"""

from __future__ import annotations

import pytest
import torch

from moefuse import MoEConfig, MoELayer, preset
from moefuse.warmup import launch_signature, token_counts, warmup

SMALL = MoEConfig(hidden_size=40, intermediate_size=24, num_experts=12, top_k=3, num_shared_experts=1)


def test_batch_sizes_cover_every_signature_with_the_smallest_batch():
    layer = MoELayer(preset("deepseek-v3").scaled(), dtype=torch.bfloat16, device="meta")
    counts = token_counts(layer, 4096)
    assert counts == sorted(set(counts)) and counts[0] == 1
    assert set(range(1, layer.graphs.max_tokens + 1)) <= set(counts)  # every decode graph is captured
    assert len(counts) < 100, "a handful of variants per stage, not one per batch size"
    firsts = {}
    for tokens in range(1, 4097):
        firsts.setdefault(launch_signature(layer, tokens), tokens)
    assert sorted(firsts.values()) == counts


def test_cpu_layers_compile_nothing():
    layer = MoELayer(SMALL, dtype=torch.float32)
    report = warmup(layer, 64, progress=False)
    assert report.layers == 0 and report.token_counts == [] and report.graphs == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_max_tokens(bad):
    with pytest.raises(ValueError, match="max_tokens"):
        warmup(MoELayer(SMALL, dtype=torch.float32), bad)


# Integer arguments whose value follows the token count (rows, tiles, work items, chunks). Triton specializes an
# integer on being 1 or a multiple of 16, so one left specialized gives a token count a kernel variant that
# warm-up, which runs one count per launch signature, may not have compiled: a compile on the request path.
TOKEN_VARYING = {"M", "n_valid", "num_rows", "num_tiles", "num_chunks", "tiles_per_chunk", "items", "num_items",
                 "run_groups"}


def _launched_kernels():
    """Every Triton and Gluon kernel moefuse launches (``name[grid](...)`` in its module) as a ``JITFunction`` (under
    the interpreter ``triton.jit`` gives an ``InterpretedFunction``: rebuilt from its function and arguments)."""
    import importlib
    import inspect
    import pkgutil
    import re

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import moefuse

    for info in pkgutil.walk_packages(moefuse.__path__, "moefuse."):
        if info.name.endswith("__main__"):  # runs the CLI
            continue
        module = importlib.import_module(info.name)
        source = inspect.getsource(module)
        for name, obj in vars(module).items():
            if isinstance(obj, InterpretedFunction):
                obj = JITFunction(obj.fn, **obj.kwargs)
            if (isinstance(obj, JITFunction) and obj.fn.__module__ == info.name
                    and re.search(rf"\b{name}\[", source)):
                yield f"{info.name}.{name}", obj


def test_token_varying_integers_are_not_specialized():
    """The W4A8 kernel's ``items`` and ``num_rows`` were left specialized (found 2026-12-02: 3,072 and 3,078 rows
    gave two variants, offline with Triton's binder)."""
    kernels = dict(_launched_kernels())
    assert "moefuse.experts.mxfp4.w4a8._w4a8_kernel" in kernels and len(kernels) >= 15  # all stages
    specialized = [f"{name}: {p.name}" for name, fn in kernels.items() for p in fn.params
                   if p.name in TOKEN_VARYING and not p.is_constexpr and not p.do_not_specialize]
    assert specialized == []


def _tiles(signature: tuple):
    """The experts' tile config in a launch signature."""
    from moefuse.experts.configs import TileConfig

    (tiles,) = [part for part in signature if isinstance(part, TileConfig)]
    return tiles


def test_w4a8_layers_plan_w4a16_heights_or_128_rows():
    """MXFP4 experts with fp8 activations run the W4A8 kernels at every batch size: on W4A16's plan height where it
    is a decode kernel's (16 or 32 rows, ``mxfp4/w4a8_decode.py``), else on 128-row tiles; batch-invariant layers
    alike (both kernels sum in one K order). The signature says so for every count; by default (W4A16) no count is
    W4A8."""
    from moefuse.experts.mxfp4 import w4a8_decode

    config = preset("deepseek-v4-flash").scaled()
    w4a8 = MoELayer(config, quant="mxfp4", activation_quant="fp8", device="meta")
    invariant = MoELayer(config, quant="mxfp4", activation_quant="fp8", batch_invariant=True, device="meta")
    w4a16 = MoELayer(config, quant="mxfp4", device="meta")
    heights = set()
    for tokens in (1, 7, 64, 512, 4096):
        w4a16_height = _tiles(launch_signature(w4a16, tokens)).block_m
        height = _tiles(launch_signature(w4a8, tokens)).block_m
        assert height == (w4a16_height if w4a16_height in w4a8_decode.LAUNCH else 128)
        heights.add(height)
        assert _tiles(launch_signature(invariant, tokens)).block_m == height
        assert launch_signature(w4a8, tokens) != launch_signature(w4a16, tokens)
    assert heights & set(w4a8_decode.LAUNCH) and 128 in heights


def test_signature_follows_the_shared_expert_format():
    """An fp8 shared expert off the slot launches its own one-expert GEMMs (a part of the signature); an unquantized
    one beside quantized routed experts runs on cuBLAS, whose kernels ``_prime_cublas`` loads instead."""
    config = preset("deepseek-v4-flash").scaled()
    fp8 = launch_signature(MoELayer(config, quant="mxfp4", device="meta"), 4)
    plain = launch_signature(MoELayer(config, quant="mxfp4", shared_quant=None, device="meta"), 4)
    assert fp8[:-2] == plain[:-2] and fp8[-2] is not None and plain[-2] is None
