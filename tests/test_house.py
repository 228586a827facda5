"""House rules the package's layout keeps, checked on its source.

- The modules above the kernels ask the format objects and never name a format: no string, name or attribute
  that names one (``"fp8"``, ``MXFP4``, ``torch.float8_e4m3fn``, the fp8 cuBLAS module ...) appears in their code.
  Docstrings are left out: they describe the values ``quant`` accepts.
- Every weight format has its transformers refusal reasons (``moefuse.hf_formats.REASONS``).
- No module imports a private (underscore) name from another kernel family's module. The experts' kernel families
  are the format folders (``experts/fp8/``, ``experts/mxfp4/``) and each other module of ``experts/``
  (``persistent.py``, ``bf16.py`` ...); what several families use lives in a shared module (``experts/common.py``,
  ``experts/gluon_common.py``), whose private names any module may import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "moefuse"
ABOVE_THE_KERNELS = ("layer.py", "hf.py", "parallel.py", "warmup.py", "cli.py")
FORMAT_NAMES = {"fp8", "mxfp4", "BlockFP8", "MXFP4", "float8_e4m3fn", "float8_e8m0fnu", "uint8", "int8", "fp8_mlp",
                "mxfp4_ws", "mxfp4_w4a8"}


def format_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every format name in the code of ``source``, docstrings excepted."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            name = node.value
        elif isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.alias):
            name = node.asname or node.name
        else:
            continue
        if name in FORMAT_NAMES:
            found.append((getattr(node, "lineno", 0), name))
    return sorted(found)


def test_the_check_finds_a_format_name():
    assert format_names('"""doc: fp8"""\nx = quant == "fp8"\ny = torch.float8_e4m3fn\n') == [
        (2, "fp8"), (3, "float8_e4m3fn")]


@pytest.mark.parametrize("module", ABOVE_THE_KERNELS)
def test_no_format_names_above_the_kernels(module):
    assert format_names((PACKAGE / module).read_text()) == []


def test_every_format_has_its_transformers_reasons():
    from moefuse.formats import LAYER_FORMATS
    from moefuse.hf_formats import REASONS

    assert {type(fmt) for fmt in LAYER_FORMATS.values()} <= set(REASONS)


EXPERTS = "moefuse.experts"
SHARED = {f"{EXPERTS}.common", f"{EXPERTS}.gluon_common"}


def family(module: str) -> str | None:
    """The kernel family of a dotted module name: ``moefuse.experts.<name>``, a folder of ``experts/`` (for its
    modules and package) or a module of it; None for the shared modules and for modules outside ``experts/``."""
    parts = module.split(".")
    if module in SHARED or ".".join(parts[:2]) != EXPERTS or len(parts) < 3:
        return None
    return ".".join(parts[:3])


def private_imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str, str]]:
    """(line, module, name) of every private name that ``source`` (the module ``module``) imports from a module of
    another kernel family (:func:`family`), ``from x import _name`` and ``from . import _name`` alike."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            if not alias.name.startswith("_") or alias.name.startswith("__"):
                continue
            source_family = family(f"{target}.{alias.name}") if _is_module(f"{target}.{alias.name}") else family(target)
            if source_family is not None and source_family != family(module):
                found.append((node.lineno, target, alias.name))
    return found


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_the_check_finds_a_private_import_across_families():
    old_persistent = ("from .common import _round, gather_rows\n"  # shared: allowed
                      "from .mxfp4.w4a8 import _e4m3, _row_inverse\n"
                      "from .mxfp4.ws import _swiglu\n"
                      "from .gluon_common import swiglu\n")
    assert private_imports(old_persistent, "moefuse.experts.persistent") == [
        (2, "moefuse.experts.mxfp4.w4a8", "_e4m3"), (2, "moefuse.experts.mxfp4.w4a8", "_row_inverse"),
        (3, "moefuse.experts.mxfp4.ws", "_swiglu")]
    within = "from .ws import _program\nfrom ..common import _swiglu\nfrom ..fp8.quantize import _quantize\n"
    assert private_imports(within, "moefuse.experts.mxfp4.w4a8") == [(3, "moefuse.experts.fp8.quantize", "_quantize")]
    assert private_imports("from moefuse.experts.fp8 import _x\n", "moefuse.layer") == [
        (1, "moefuse.experts.fp8", "_x")]
    assert private_imports("from moefuse import _runtime\n", "moefuse.experts.bf16") == []


def test_no_private_imports_across_kernel_families():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        hits = private_imports(path.read_text(), module, is_package)
        if hits:
            found[module] = hits
    assert found == {}
