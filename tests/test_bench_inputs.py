"""The benchmarks' inputs, which run on a GPU only: skewed routing is as skewed as the issue measured it."""

from __future__ import annotations

import torch

from moefuse.bench.experts import _routing, load_stats


def test_zipf_routing_skew():
    """DeepSeek-V3 at 1024 tokens (E = 256, top-8): uniform, then Zipf popularity at gains 0.6, 1.0 and 3.0 (the
    issue measured 247 / 146 / 24 experts touched and a busiest expert 22x the mean at 0.6)."""
    gen = torch.Generator().manual_seed(0)
    stats = {gain: load_stats(_routing(1024, 256, 8, torch.device("cpu"), gen, gain)[1], 256)
             for gain in (0.0, 0.6, 1.0, 3.0)}
    assert stats[0.0][0] == 256 and stats[0.0][1] < 3
    assert stats[0.6][0] > 230 and stats[0.6][1] > 10
    assert 100 < stats[1.0][0] < 200
    assert stats[3.0][0] < 60
    weights, ids = _routing(7, 16, 3, torch.device("cpu"), gen, 1.0)
    assert ids.shape == (7, 3) and ids.dtype == torch.int32
    assert all(len(set(row.tolist())) == 3 for row in ids)  # distinct experts per token
    assert torch.all(weights > 0)
