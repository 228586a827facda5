"""The benchmarks' inputs, which run on a GPU only: skewed routing is as skewed as the issue measured it."""

from __future__ import annotations

import pytest
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


def test_grouped_peer_multiplies_each_expert_rows_by_its_own_weights():
    """``bench.prefill.grouped_calls``, the peer on the same ragged work: torch's grouped GEMM must give expert e
    exactly its counts[e] rows in expert order, empty experts included (checked on CPU against one matmul per
    expert; the bf16 path, torch._grouped_mm)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    from moefuse.bench.prefill import grouped_calls

    gen = torch.Generator().manual_seed(0)
    E, H, I = 4, 32, 16
    counts = torch.tensor([3, 0, 5, 2])
    w1 = torch.randn(E, 2 * I, H, generator=gen).bfloat16()
    w2 = torch.randn(E, H, I, generator=gen).bfloat16()
    a = torch.randn(10, H, generator=gen).bfloat16()
    h = torch.randn(10, I, generator=gen).bfloat16()
    up, out = grouped_calls(counts, w1, w2, (a, h))()
    # bf16 outputs of fp32 sums: one rounding, 2^-9 relative; a row at another expert's weights errs O(1)
    starts = [0, *torch.cumsum(counts, 0).tolist()]
    for e in range(E):
        rows = slice(starts[e], starts[e + 1])
        torch.testing.assert_close(up[rows].float(), a[rows].float() @ w1[e].float().t(), atol=2e-2, rtol=4e-3)
        torch.testing.assert_close(out[rows].float(), h[rows].float() @ w2[e].float().t(), atol=2e-2, rtol=4e-3)
