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
