"""Argument checks shared by the public ops. Each raises ``TypeError`` or ``ValueError`` naming the argument."""

from __future__ import annotations

from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(
    name: str,
    value: object,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``value`` is a tensor with an allowed dtype, rank, shape (None = any size) and device."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if value.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(f"{name} must have dtype in ({allowed}), got {str(value.dtype).removeprefix('torch.')}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, value.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name} has size {got} in dim {axis}, expected {want} (shape {tuple(value.shape)})")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device}, expected {device} like the other inputs")
    return value


def check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """Check that ``value`` is a Python int (bool excluded) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value
