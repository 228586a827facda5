"""``research/fp8_timeline.py``: the K runs it charges each GEMM1 program with, and what it reads from stamps."""
import pytest
import torch

from research import fp8_timeline as timeline


@pytest.mark.parametrize(("K", "split", "runs"), [
    (4096, 1, [4096]), (4096, 3, [1536, 1536, 1024]),  # GLM-4.5-Air's split: the last run shorter
    (512, 4, [256, 256, 0, 0]),  # more runs than steps: empty runs
    (7168, 4, [1792, 1792, 1792, 1792]), (300, 2, [256, 44]),  # a last step past K
])
def test_run_lengths_cut_k_as_the_kernel_does(K, split, runs):
    assert timeline.run_lengths(K, 256, split) == runs
    assert sum(runs) == K


def stamps(rows):
    """[programs, 4] int64 ns from (start, loop end, end, SM) in µs (loop end 0: a program that ran no loop)."""
    return torch.tensor([[int(a * 1e3), int(b * 1e3), int(c * 1e3), sm] for a, b, c, sm in rows], dtype=torch.int64)


def test_summary_of_known_stamps():
    t0 = 5_000.0  # an arbitrary clock origin
    st = stamps([(t0, t0 + 10, t0 + 10.5, 0), (t0 + 1, t0 + 9, t0 + 9, 1), (t0 + 1, t0 + 13, t0 + 16, 1),
                 (t0 + 2, 0, 0, 2)])  # the last program had no tile: left out
    nbytes = torch.tensor([10e6, 8e6, 12e6, 99e6], dtype=torch.float64)
    s = timeline.summarize(st, nbytes)
    assert (s["programs"], s["sms"], s["most_per_sm"]) == (3, 2, 2)
    assert s["span_us"] == pytest.approx(16.0)
    assert s["last_start_us"] == pytest.approx(1.0)
    assert (s["loop_min_us"], s["loop_median_us"], s["loop_max_us"]) == pytest.approx((8.0, 10.0, 12.0))
    assert (s["first_loop_end_us"], s["last_loop_end_us"]) == pytest.approx((9.0, 13.0))
    assert s["epilogue_us"] == pytest.approx(3.0)
    assert s["tbps_over_span"] == pytest.approx(30e6 / 16.0 / 1e6)
    # from 1 to 9 µs all three read at 1 + 1 + 1 MB/µs: 3 TB/s at most
    assert s["tbps_peak_estimate"] == pytest.approx(3.0)
