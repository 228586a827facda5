"""The fp8 decode probes' kernels compiled offline for sm_90 (no GPU needed): every build ``fp8_decode_probe``
times (``fused_decode.py``; ``ws_decode.py``, Gluon) compiles within a block's shared memory, the Gluon one without
spills and with as many programs an SM as its launch puts there, and the L2 prefetch kernel compiles.

``research/sass_decode.py --check`` runs in a subprocess because this process may have ``TRITON_INTERPRET=1`` and
the kernels must be compiled, not interpreted.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_probe_builds_fit_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-m", "research.sass_decode", "--check"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
