"""``research/swap_bits.py``'s K order for ``--permute``: a bijection within each group of 32 that puts a thread's
word (codes 8t..8t+7) at the fp8 register operand's positions 4t..4t+3 and 16+4t..16+4t+3."""
from __future__ import annotations

from research.swap_bits import word_order


def test_word_order_puts_each_word_in_its_threads_operand_registers():
    K = 128
    order = word_order(K)
    assert sorted(order.tolist()) == list(range(K))
    for group in range(K // 32):
        within = order[32 * group:32 * group + 32] - 32 * group
        assert bool(((within >= 0) & (within < 32)).all())
        for t in range(4):
            assert within[4 * t:4 * t + 4].tolist() == list(range(8 * t, 8 * t + 4))
            assert within[16 + 4 * t:20 + 4 * t].tolist() == list(range(8 * t + 4, 8 * t + 8))

