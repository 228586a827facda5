"""Renamed public names keep working for one minor version, with a ``DeprecationWarning`` that names the new name
and the version the old one goes in.

``deprecated_alias`` makes a function for the old name that warns on each call and forwards to the new one;
a method under an old name calls ``warn_deprecated`` and then the new function. Either looks the new name up by its
dotted name at the call (``resolve``), so an old name can point at something defined in a module that imports its
own (``MoELayer.from_hf`` in ``moefuse.layer`` -> ``moefuse.from_hf``, defined in ``moefuse.hf``, which imports
``moefuse.layer``) without an import that would close a circle.
"""
from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def deprecation_message(old: str, new: str, removed_in: str) -> str:
    return f"{old} is deprecated and will be removed in moefuse {removed_in}; use {new} instead"


def warn_deprecated(old: str, new: str, removed_in: str, stacklevel: int = 2) -> None:
    """Warn that ``old`` was renamed ``new`` and goes in version ``removed_in``. ``stacklevel`` as
    :func:`warnings.warn`'s, counted from the caller of this function (2: that caller's caller)."""
    warnings.warn(deprecation_message(old, new, removed_in), DeprecationWarning, stacklevel=stacklevel + 1)


def resolve(name: str) -> Any:
    """The object a dotted name (``"moefuse.from_hf"``, ``"moefuse.hf.from_hf"``) refers to: the longest prefix that
    is a module, imported, then attributes."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        module = ".".join(parts[:split])
        try:
            target = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name is None or not (module == error.name or module.startswith(error.name + ".")):
                raise  # the module exists but imports one that does not
            continue
        for attr in parts[split:]:
            target = getattr(target, attr)
        return target
    raise ModuleNotFoundError(f"no module in {name!r}")


def deprecated_alias(old: str, new: str, removed_in: str, *, method: bool = False) -> Callable[..., Any]:
    """A function for the old public name ``old``: each call warns (``DeprecationWarning``, pointing at the caller)
    that it is now ``new`` and goes in ``removed_in``, then returns ``new(*args, **kwargs)``, ``new`` looked up by
    its dotted name (:func:`resolve`) at the call.

    ``method``: the alias is a method (wrap it in ``classmethod`` or use it as a plain method): its first argument,
    the class or the instance, is dropped before forwarding.
    """

    def alias(*args: Any, **kwargs: Any) -> Any:
        warn_deprecated(old, new, removed_in)
        return resolve(new)(*(args[1:] if method else args), **kwargs)

    alias.__name__, alias.__qualname__ = old.rsplit(".", 1)[-1], old
    alias.__doc__ = f"Deprecated: {deprecation_message(old, new, removed_in)} (same arguments)."
    return alias


def moved_names(module: str, moved: dict[str, str], removed_in: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names that moved out of ``module``: ``moved`` maps each old name to its new dotted
    name; reading one warns (``DeprecationWarning``) and returns the new object (:func:`resolve`), any other name is
    an ``AttributeError`` as usual."""

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_deprecated(f"{module}.{name}", moved[name], removed_in)
        return resolve(moved[name])

    return __getattr__

