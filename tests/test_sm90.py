"""The kernels compiled offline for sm_90 (no GPU needed): every launch the presets can make must fit an H200.

The interpreter (how the other CPU tests run the kernels) accepts tiles that a GPU rejects: a tile table entry
asking for more shared memory than a Hopper block may have fails only at launch there (``OutOfResources``).
``scripts/sass.py --check`` compiles each launch for sm_90 and fails on that, on a compile error, and on a
16-bit tile of 64 rows or more that is not on wgmma. It runs in a subprocess because this process has
``TRITON_INTERPRET=1`` and the kernels must be compiled, not interpreted.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moefuse.config import PRESETS

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "sass.py"


def run_check(*args: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, str(SCRIPT), *args, "--check"], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"{result.stdout[-6000:]}\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_expert_tiles_of_each_preset_fit_sm90(preset):
    run_check("experts", "--preset", preset)


def test_router_configs_fit_sm90():
    run_check("router")


def test_mxfp4_warp_specialized_kernels_fit_sm90():
    """The Gluon kernels (``experts/mxfp4/ws.py``, ``w4a8.py`` and ``w4a8_decode.py``): compiled at every tile
    height, none spills."""
    run_check("mxfp4-ws")


def test_persistent_kernels_fit_sm90():
    """The persistent prefill GEMMs (``experts/persistent.py``, Gluon): bf16 and fp16, with and without the clamp,
    none spills."""
    run_check("persistent")

