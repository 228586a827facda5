"""``research/layer_graph_timeline.py``'s arithmetic: replays cut from the kernels in start order, and per position
the median start offset, duration and gap (negative where a kernel overlaps the ones before it)."""
from __future__ import annotations

import pytest

from research.layer_graph_timeline import replays_of, timeline


def test_replays_and_their_timeline():
    # two replays of three kernels: b overlaps a by 1 µs on a side stream, c waits 2 µs after both
    first = [("a", 100.0, 110.0), ("b", 109.0, 112.0), ("c", 114.0, 120.0)]
    second = [("a", 200.0, 212.0), ("b", 211.0, 214.0), ("c", 216.0, 220.0)]
    runs = replays_of(second[::-1] + first, 2)
    assert runs == [first, second]
    got = timeline(runs)
    assert got["span_us"] == 20.0
    assert [k["kernel"] for k in got["kernels"]] == ["a", "b", "c"]
    assert [k["start_us"] for k in got["kernels"]] == [0.0, 10.0, 15.0]
    assert [k["us"] for k in got["kernels"]] == [11.0, 3.0, 5.0]
    assert [k["gap_us"] for k in got["kernels"]] == [0.0, -1.0, 2.0]


def test_kernels_are_matched_by_name_where_streams_start_them_in_another_order():
    first = [("a", 0.0, 10.0), ("b", 1.0, 4.0), ("c", 2.0, 5.0)]
    second = [("a", 100.0, 110.0), ("c", 101.0, 103.0), ("b", 102.0, 106.0)]  # the side stream's b came later
    got = timeline([first, second])
    assert [k["kernel"] for k in got["kernels"]] == ["a", "b", "c"]
    assert [k["start_us"] for k in got["kernels"]] == [0.0, 1.5, 1.5]
    assert [k["us"] for k in got["kernels"]] == [10.0, 3.5, 2.5]


def test_kernels_that_do_not_split_into_replays_are_refused():
    with pytest.raises(ValueError, match="do not split"):
        replays_of([("a", 0.0, 1.0)] * 5, 2)
