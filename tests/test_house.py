"""The modules above the kernels ask the format objects and never name a format (issue 38): no string, name or
attribute that names one (``"fp8"``, ``MXFP4``, ``torch.float8_e4m3fn``, the fp8 cuBLAS module ...) appears in
their code. Docstrings are left out: they describe the values ``quant`` accepts."""

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
