"""``research/prefill_probe.py``'s CPU parts: the controlled ragged routings and the fit of ``--ragged``."""
import pytest
import torch

from research import prefill_probe as probe


@pytest.mark.parametrize("routing", ["balanced", "pm1", "pm64"])
def test_controlled_routings_give_each_expert_its_rows_and_each_token_distinct_experts(routing):
    ids = probe.routed_ids(4096, routing, torch.device("cpu"), torch.Generator())
    assert ids.shape == (4096, probe.K) and ids.dtype == torch.int32
    assert not (ids.sort(dim=1).values.diff(dim=1) == 0).any(), "an expert twice in one token"
    counts = torch.bincount(ids.reshape(-1).long(), minlength=probe.E)
    d = 0 if routing == "balanced" else int(routing[2:])
    assert counts[0::2].eq(128 + d).all() and counts[1::2].eq(128 - d).all()


def test_fit_recovers_the_costs_it_was_made_of():
    points = [(i, b, 4.6 * i + 2.85 * b + 990) for i, b in [(256, 512), (384, 640), (384, 512), (374, 630)]]
    a, b, c = probe.fit_items_blocks(points)
    assert (a, b, c) == pytest.approx((4.6, 2.85, 990), rel=1e-9)
