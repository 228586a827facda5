"""``research/fp8_halves_depth.py``'s stand-in for ``fp8_tiles``: the halves' launch steps the boxes on the stages
it names, every other launch as ``fp8_tiles`` gives it; and the two-box halves fit an H100's shared memory."""
from __future__ import annotations

from moefuse.experts import configs
from moefuse.experts.fp8 import kernels as fp8_kernels
from research.fp8_halves_depth import LAUNCHES, _depth


def test_halves_take_the_launch_named_and_nothing_else_does():
    base = configs.GemmTiles(128, 256, 1, 8, 2)
    for boxes, stages in LAUNCHES.values():
        tiles = _depth(boxes, stages)
        halves = tiles(base, 64, True, 2, 1, fp8_kernels.SMEM_BUDGET, half_columns=128)
        assert (halves.block_k, halves.num_stages) == (boxes * fp8_kernels.BLOCK, stages)
        assert halves.num_warps == fp8_kernels.FP8_HALVES_WARPS
        # shared memory: stages x boxes x (the 128 x 128 weight box + 64 rows of e4m3 activations)
        assert stages * boxes * fp8_kernels.BLOCK * (128 + 64) <= 227 * 1024
        for args in ((base, 64, True, 2, 3), (base, 16, False, 1)):
            assert tiles(*args) == fp8_kernels.fp8_tiles(*args)
        narrow = configs.GemmTiles(32, 128, 1, 4, 3)
        assert tiles(narrow, 16, False, 1, wgmma=True) == fp8_kernels.fp8_tiles(narrow, 16, False, 1, wgmma=True)
