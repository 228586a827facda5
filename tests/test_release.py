"""Release checks on the wheel built from this checkout: it carries every file the package opens and the LICENSE,
its metadata has the package's one version, and installed into a fresh virtual environment, without the checkout
on the path, ``moefuse`` and ``moefuse bench --help`` run from it.

The build reads a copy of what it needs (pyproject.toml, README.md, LICENSE, moefuse/), so it writes no ``build/``
or ``*.egg-info`` into the checkout. It runs offline (``--no-build-isolation``: this environment's setuptools) with
a ``torch`` that fails on import first on the path: reading the version must not import the package. The fresh
environment gets this one's packages (torch, triton, pip, ...) through a ``.pth`` naming a folder of links to them,
all but moefuse's own (the editable install's finder, its metadata); its pip installs the wheel.
"""

from __future__ import annotations

import ast
import email.parser
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import moefuse

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "moefuse"
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE")  # besides moefuse/: what the build reads
TIMEOUT = 300  # seconds for any one command; together they take about 15 s on two CPU cores


def _run(cmd: list[str | Path], **kwargs) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=TIMEOUT, **kwargs)
    assert result.returncode == 0, f"{cmd} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(PACKAGE, src / "moefuse", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    no_torch = tmp_path_factory.mktemp("no_torch")
    (no_torch / "torch").mkdir()
    (no_torch / "torch" / "__init__.py").write_text("raise ImportError('the build imported torch')\n")
    out = tmp_path_factory.mktemp("wheel")
    env = {**os.environ, "PYTHONPATH": str(no_torch), "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    result = _run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-v", "-w", out],
                  cwd=src, env=env)
    log = result.stdout + result.stderr
    assert "SetuptoolsDeprecationWarning" not in log and "SetuptoolsWarning" not in log, log
    (built,) = out.glob("moefuse-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(archive.read(name).decode())


def _package_data_files() -> set[str]:
    """The package's non-Python files (git's tracked and untracked-but-not-ignored ones where git works, so that
    editor and build leftovers do not count), as paths in the wheel."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "moefuse"],
                                cwd=REPO, capture_output=True, text=True, timeout=60, check=True).stdout.split()
        paths = [REPO / p for p in listed if (REPO / p).is_file()]  # a deleted tracked file is still listed
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return {p.relative_to(REPO).as_posix() for p in paths if p.suffix not in (".py", ".pyc")}


def _files_the_code_names() -> set[str]:
    """Package files whose name appears in a string in the package's code (``"anchors_h200.json"``, ...)."""
    strings = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    text = "\n".join(strings)
    return {f for f in _package_data_files() if Path(f).name in text}


def test_wheel_carries_the_files_the_package_opens(wheel_files: set[str]):
    from moefuse.bench.report import ANCHOR_FILES
    from moefuse.experts.configs import TABLES

    opened = {p.resolve().relative_to(REPO).as_posix() for p in (*ANCHOR_FILES.values(), *TABLES.values())}
    named = _files_the_code_names()
    assert {"moefuse/bench/anchors_h200.json", "moefuse/bench/anchors_h100.json",
            "moefuse/configs/experts_h200.json"} <= opened | named
    assert not (opened | named) - wheel_files
    # and every other non-Python file of the package (py.typed, future data files)
    assert "moefuse/py.typed" in wheel_files
    assert not _package_data_files() - wheel_files


def test_wheel_license_and_version(wheel: Path, wheel_files: set[str]):
    meta = _metadata(wheel)
    assert meta["Version"] == moefuse.__version__  # pyproject reads moefuse/__init__.py's
    assert wheel.name.startswith(f"moefuse-{moefuse.__version__}-")
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    license_path = f"moefuse-{moefuse.__version__}.dist-info/licenses/LICENSE"
    assert license_path in wheel_files
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(license_path) == (REPO / "LICENSE").read_bytes()
    assert "Apache License" in (REPO / "LICENSE").read_text()
    # numpy: a plain runtime dependency; its upper bound only in the test extra (Triton's interpreter)
    numpy = [r for r in meta.get_all("Requires-Dist") or [] if r.startswith("numpy")]
    assert [r for r in numpy if "extra" not in r] == ["numpy>=1.26"]
    assert any("<2.4" in r and 'extra == "test"' in r for r in numpy)
    assert f"## [{moefuse.__version__}]" in (REPO / "CHANGELOG.md").read_text()


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fresh")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = root / "deps"
    deps.mkdir()
    outer = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    for directory in outer:
        for entry in directory.iterdir():
            skip = entry.name.startswith(("moefuse", "__editable__")) or entry.suffix == ".pth"
            if not skip and not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    (site / "outer_deps.pth").write_text(f"{deps}\n")
    # this environment's pip, run by the fresh interpreter: it installs there (scripts included)
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", wheel],
         env=_fresh_env(venv))
    return venv


def _fresh_env(venv: Path) -> dict[str, str]:
    """The environment a user's shell would give: no PYTHONPATH, no TRITON_INTERPRET (conftest sets it), the fresh
    environment's scripts first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "TRITON_INTERPRET")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    return env


CHECK_INSTALLED = """
import importlib.metadata, json, sys
import moefuse
from moefuse.bench.report import anchors
from moefuse.experts.configs import TABLES, load_table
tables = anchors("NVIDIA H200")
print(json.dumps({"file": moefuse.__file__, "version": moefuse.__version__, "prefix": sys.prefix,
                  "metadata": importlib.metadata.version("moefuse"),
                  "anchor_rows": sum(len(t["rows"]) for t in tables.values() if isinstance(t, dict) and "rows" in t),
                  "table_entries": sum(len(load_table(p)["entries"]) for p in TABLES.values())}))
"""


def test_installed_wheel_runs_without_the_checkout(fresh_venv: Path, tmp_path: Path):
    import json

    env, python = _fresh_env(fresh_venv), fresh_venv / "bin" / "python"
    info = json.loads(_run([python, "-c", CHECK_INSTALLED], cwd=tmp_path, env=env).stdout.splitlines()[-1])
    assert Path(info["file"]).resolve().is_relative_to(fresh_venv.resolve()), info  # not the checkout
    assert Path(info["prefix"]).resolve() == fresh_venv.resolve()
    assert info["version"] == info["metadata"] == moefuse.__version__
    assert info["anchor_rows"] > 0 and info["table_entries"] > 0  # the json files load from the install

    moefuse_script = fresh_venv / "bin" / "moefuse"
    bench = _run([moefuse_script, "bench", "--help"], cwd=tmp_path, env=env)
    assert "--quick" in bench.stdout and "--results-dir" in bench.stdout
    # The README's first command: on the CPU a scaled-down DeepSeek-V3 layer checked against float64.
    # (On a GPU machine too: the full-size layer there is test_cli's, which takes turns for the card's memory.)
    cpu = {**env, "CUDA_VISIBLE_DEVICES": ""}
    layer = _run([moefuse_script, "--tokens", "4", "--no-timing"], cwd=tmp_path, env=cpu)
    assert "layer vs float64 reference" in layer.stdout and "| NO " not in layer.stdout, layer.stdout
    assert layer.stdout.count("| yes |") == 3, layer.stdout
