"""``research/router_switch.py``'s switch: the smallest size on the grid from which the tensor-core kernel is never
slower than cuBLAS (a size where it loses after winning pushes the switch past it)."""
from __future__ import annotations

from research.router_switch import switch_for


def test_switch_is_where_the_kernel_stops_losing():
    assert switch_for({256: (10.0, 12.0), 512: (20.0, 19.0), 768: (30.0, 31.0), 1024: (40.0, 30.0)}) == 1024
    assert switch_for({256: (10.0, 9.0), 512: (20.0, 19.0)}) == 256
    assert switch_for({256: (10.0, 10.0)}) == 256  # a tie goes to the kernel
    assert switch_for({256: (1.0, 2.0)}) == 512  # never faster on the grid: past its end
