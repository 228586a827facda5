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
TOKEN_VARYING = {"M", "n_valid", "num_rows", "num_tiles", "num_chunks", "tiles_per_chunk", "items"}


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
    assert "moefuse.experts.mxfp4_w4a8._w4a8_kernel" in kernels and len(kernels) >= 15  # all stages
    specialized = [f"{name}: {p.name}" for name, fn in kernels.items() for p in fn.params
                   if p.name in TOKEN_VARYING and not p.is_constexpr and not p.do_not_specialize]
    assert specialized == []
