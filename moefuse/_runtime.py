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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True)
class GPU:
    """What the launch choices need to know of a GPU, read from the device once (:func:`gpu`).

    The tile tables are keyed by ``name`` and ``sms`` (``experts/configs.py``), the heuristics size grids by ``sms``
    and shared-memory buffers by ``smem``, and the Hopper-only kernels check ``capability``."""

    name: str  # torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int]  # compute capability, e.g. (9, 0)
    sms: int  # streaming multiprocessors
    smem: int  # shared memory one block may opt in to, bytes


# The target of launch choices made without a GPU (Triton's interpreter, shape planning on the CPU): an H100 SXM.
HOPPER = GPU("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448)


@functools.cache
def _gpu(index: int) -> GPU:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or HOPPER.smem
    return GPU(props.name, (props.major, props.minor), props.multi_processor_count, int(smem))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def gpu(device: torch.device) -> GPU:
    """The facts of CUDA ``device`` (read once per device: the driver query costs microseconds)."""
    return _gpu(_index(device))


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of CUDA ``device``."""
    return gpu(device).capability


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device``."""
    return gpu(device).sms


def pdl_enabled(enable_pdl: bool | None, device: torch.device) -> bool:
    """Whether to launch with programmatic dependent launch.

    ``None`` means: on where the GPU supports it (compute capability >= 9). Never under the interpreter,
    which has no grid-dependency intrinsics.
    """
    if device.type != "cuda" or interpreting():
        return False
    supported = capability(device)[0] >= 9
    return supported if enable_pdl is None else bool(enable_pdl) and supported


@dataclass
class Defaults:
    """The process defaults of the switches that ops, the layer and ``patch`` take as arguments (an argument left at
    None takes its default here). Read from the environment once, when moefuse is imported (:func:`read_environment`;
    docs/USAGE.md lists the variables); change them with :func:`moefuse.set_defaults`. A compiled graph
    (``torch.compile``) or a captured CUDA graph keeps what it saw when it was traced or captured."""

    batch_invariant: bool = False  # MOEFUSE_BATCH_INVARIANT=1: bitwise batch-invariant kernels (docs/USAGE.md)
    persistent: str = "auto"  # MOEFUSE_PERSISTENT: "auto" (unset: fp8 only), "all" (1), "none" (0)
    deferred_finalize: bool = True  # MOEFUSE_ENABLE_DEFERRED_FINALIZE=0: the layer combines without deferral
    check: bool = False  # MOEFUSE_CHECK=1: value checks that need a host sync, on CUDA too


PERSISTENT = ("auto", "all", "none")
_PERSISTENT_ENV = {"": "auto", "1": "all", "0": "none"}


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    value = environ.get(name, "").strip()
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {name} must be 0 or 1, got {value!r}")
    return value == "1"


def read_environment(environ: Mapping[str, str]) -> Defaults:
    """The defaults ``environ`` sets (``os.environ`` at import); a variable set to anything else is refused."""
    persistent = environ.get("MOEFUSE_PERSISTENT", "").strip()
    if persistent not in _PERSISTENT_ENV:
        raise ValueError(f"environment variable MOEFUSE_PERSISTENT must be unset, 0 or 1, got {persistent!r}")
    return Defaults(batch_invariant=_flag(environ, "MOEFUSE_BATCH_INVARIANT", False),
                    persistent=_PERSISTENT_ENV[persistent],
                    deferred_finalize=_flag(environ, "MOEFUSE_ENABLE_DEFERRED_FINALIZE", True),
                    check=_flag(environ, "MOEFUSE_CHECK", False))


DEFAULTS = read_environment(os.environ)


def set_defaults(**changes: object) -> None:
    """Change process defaults (:class:`Defaults`' fields) for the calls that follow, e.g.
    ``moefuse.set_defaults(batch_invariant=True)``."""
    for name, value in changes.items():
        if not hasattr(DEFAULTS, name):
            raise TypeError(f"set_defaults() got an unknown switch {name!r}; known: {sorted(vars(DEFAULTS))}")
        if name == "persistent":
            if value not in PERSISTENT:
                raise ValueError(f"persistent must be one of {PERSISTENT}, got {value!r}")
        elif not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        setattr(DEFAULTS, name, value)


@contextlib.contextmanager
def defaults(**changes: object) -> Iterator[None]:
    """:func:`set_defaults` for the block, restored after it (benchmarks and tests compare both ways)."""
    old = {name: getattr(DEFAULTS, name) for name in changes if hasattr(DEFAULTS, name)}
    set_defaults(**changes)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(DEFAULTS, name, value)


def optional_bool(name: str, value: object) -> bool | None:
    """A boolean switch's argument checked: None (the process default) or a bool; a ``TypeError`` naming it else."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be None or a bool, got {type(value).__name__}")
    return value


def persistent_arg(value: object) -> str | None:
    """A ``persistent`` argument checked: None (the process default) or one of :data:`PERSISTENT`."""
    if value is not None and value not in PERSISTENT:
        raise ValueError(f"persistent must be None or one of {PERSISTENT}, got {value!r}")
    return value  # type: ignore[return-value]


def batch_invariant(value: object) -> bool:
    """A ``batch_invariant`` argument resolved: the process default for None; refuses anything but a bool."""
    checked = optional_bool("batch_invariant", value)
    return DEFAULTS.batch_invariant if checked is None else checked


def laid_out_once(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if contiguous with a 16-byte-aligned start, else a contiguous copy. Triton specialises a kernel on
    its arguments' strides and alignment, and the layout it then picks decides the order of a ``tl.sum``: a
    batch-invariant launch reads its rows this one way, whatever view a caller passes."""
    strides, step = [], 1
    for size in reversed(t.shape):  # exactly the contiguous strides: is_contiguous() lets a size-1 dim's be any
        strides.append(step)
        step *= size
    if t.stride() == tuple(reversed(strides)) and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def persistent_enabled(fp8: bool, persistent: str | None = None) -> bool:
    """Whether prefill runs the persistent warp-specialized GEMMs (``experts/persistent.py``) where they apply, for
    fp8 block-scale weights (``fp8``) or 16-bit ones: ``persistent`` (None: the process default) "auto" runs the fp8
    ones only (the 16-bit ones measured 1.02-1.16x slower than the ``tl`` kernels: docs/CHOICES.md), "all" both,
    "none" neither."""
    value = DEFAULTS.persistent if persistent_arg(persistent) is None else persistent
    return value == "all" or (value == "auto" and fp8)


def checks_enabled(device: torch.device) -> bool:
    """Whether value checks that need a host sync (index ranges) run: always off CUDA, else where the process default
    ``check`` is on (``MOEFUSE_CHECK=1``)."""
    return device.type != "cuda" or DEFAULTS.check
