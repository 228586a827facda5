"""The tools of ``scripts/`` as modules, for their tests: each loaded from its file (``scripts/`` is not on the
import path, and nothing here changes ``sys.path``)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``scripts.<name>``, loaded once (registered in ``sys.modules`` under
    that name, which a dataclass in it looks its module up by)."""
    module_name = f"scripts.{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, SCRIPTS / f"{name}.py")
        assert spec is not None and spec.loader is not None, name
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


def tools() -> list[str]:
    """The names of the tools in ``scripts/``."""
    return sorted(path.stem for path in SCRIPTS.glob("*.py") if path.stem != "__init__")
