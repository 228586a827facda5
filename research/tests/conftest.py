"""Set-up of the probes' tests, as ``tests/conftest.py``'s: without a GPU, Triton kernels run through the
interpreter (``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set before any probe is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from research.tests.cases import DEVICE  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded generator per test: inputs are new each run, and the seed is printed on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)
