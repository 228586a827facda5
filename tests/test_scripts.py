"""The tools in ``scripts/``: each says what it does (a module docstring) and answers ``--help`` without a GPU, and
none edits ``sys.path`` or reaches into ``tests/`` (they import the installed ``moefuse``)."""
import re

import pytest
from scripts_loader import SCRIPTS, script, tools


@pytest.mark.parametrize("name", tools())
def test_help_and_docstring(name, capsys):
    module = script(name)
    assert module.__doc__ and module.__doc__.strip(), f"scripts/{name}.py has no docstring"
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


@pytest.mark.parametrize("name", tools())
def test_imports_only_the_installed_package(name):
    source = (SCRIPTS / f"{name}.py").read_text()
    assert "sys.path" not in source
    assert not re.search(r"^\s*(from|import) (tests|test_\w+|conftest|tolerances|scripts_loader)\b", source, re.M)
