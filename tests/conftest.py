"""Test set-up: without a GPU, Triton kernels run through the interpreter.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any test module
imports moefuse. On a GPU machine the kernels compile for the device instead.
"""

import fcntl
import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded generator per test: inputs are new each run, and the seed is printed on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def full_size_gpu() -> Iterator[None]:
    """Tests that build full-size layers on a GPU take turns, and hand their memory back when done: the suite's
    workers share one card, and two such layers (Kimi-K2 bf16: 34 GB) beside the rest of the suite outgrow an
    80 GB H100. A no-op without a GPU."""
    if not torch.cuda.is_available():
        yield
        return
    with open(Path(tempfile.gettempdir()) / f"moefuse-tests-full-size-{os.getuid()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            gc.collect()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)
