"""Where and how a stage runs: backend choice, Triton's interpreter, PDL, and the bounds-check switch.

Every public op takes ``backend`` and resolves it here, once, before any launch:

- ``"reference"``: the readable PyTorch version of the stage, on any device.
- ``"triton"``: the Triton kernel. CUDA tensors run on the GPU; CPU tensors run through Triton's
  interpreter, which must be switched on with ``TRITON_INTERPRET=1`` before Triton is imported.
- ``"auto"``: Triton on CUDA tensors, the reference elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Literal

import torch

Backend = Literal["auto", "reference", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "triton")


def interpreting() -> bool:
    """True when Triton kernels run through the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, device: torch.device) -> Literal["reference", "triton"]:
    """Turn the user's ``backend`` argument into ``"reference"`` or ``"triton"`` for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if backend == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"backend='triton' on {device.type} tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before importing moefuse, or use backend='reference'"
        )
    return backend  # type: ignore[return-value]


def direct_call() -> bool:
    """Whether a public op may call its implementation directly instead of through ``torch.ops.moefuse``.

    The custom op exists for tracing (``torch.compile``, fake tensors, export), and its dispatcher costs about
    20 µs of host time per call, as much as the launch it wraps. So plain eager calls skip it; anything that
    traces (Dynamo, or a dispatch mode such as ``FakeTensorMode`` or ``make_fx``) goes through the custom op.
    """
    return not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of CUDA ``device`` (read once per device: the driver query costs microseconds)."""
    return _capability(_index(device))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (read once per device, as :func:`capability`)."""
    return _sm_count(_index(device))


def pdl_enabled(enable_pdl: bool | None, device: torch.device) -> bool:
    """Whether to launch with programmatic dependent launch.

    ``None`` means: on where the GPU supports it (compute capability >= 9). Never under the interpreter,
    which has no grid-dependency intrinsics.
    """
    if device.type != "cuda" or interpreting():
        return False
    supported = capability(device)[0] >= 9
    return supported if enable_pdl is None else bool(enable_pdl) and supported


def persistent_enabled(fp8: bool) -> bool:
    """Whether prefill runs the persistent warp-specialized GEMMs (``experts/persistent.py``) where they apply, for
    fp8 block-scale weights (``fp8``) or 16-bit ones. ``MOEFUSE_PERSISTENT`` unset: fp8 only (on one H200 they beat
    the ``tl`` kernels from 2,048 tokens, where the 16-bit ones are 6-38% slower: docs/CHOICES.md); ``1``: both;
    ``0``: neither."""
    value = os.environ.get("MOEFUSE_PERSISTENT", "")
    return fp8 if value == "" else value != "0"


def checks_enabled(device: torch.device) -> bool:
    """Whether value checks that need a host sync (index ranges) run: always off CUDA, else ``MOEFUSE_CHECK=1``."""
    return device.type != "cuda" or os.environ.get("MOEFUSE_CHECK", "0") not in ("", "0")


@contextlib.contextmanager
def env_override(name: str, value: str) -> Iterator[None]:
    """Set environment variable ``name`` to ``value`` for the block (e.g. ``MOEFUSE_ENABLE_DEFERRED_FINALIZE``)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old
