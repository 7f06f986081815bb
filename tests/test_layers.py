"""The layer rule of the package: imports point down, and no layer imports the package root.

The rule is the import-linter contract in pyproject.toml (``[tool.importlinter]``); these tests
run it on the installed package, and run it again on a copy with one upward import added, to
show that it catches a violation.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")
pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "uccl_ep_megatron"


def _installed_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.origin is not None, f"{PACKAGE} is not installed"
    return Path(spec.origin).parent


def _lint(pythonpath: Path | None, cwd: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with this repo's contract, importing the package from ``pythonpath``."""
    code = (
        "import sys\n"
        + (f"sys.path.insert(0, {str(pythonpath)!r})\n" if pythonpath else "")
        + "from importlinter.cli import lint_imports_command\n"
        + f"sys.argv = ['lint-imports', '--config', {str(ROOT / 'pyproject.toml')!r}]\n"
        + "sys.argv.append('--no-cache')\n"
        + "lint_imports_command()\n"
    )
    return subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300
    )


_ROOT_IMPORTERS = """
import json, sys
import grimp
graph = grimp.build_graph("uccl_ep_megatron", cache_dir=None)
layered = {"api", "backends", "proxy", "core", "telemetry", "training", "cluster", "bench",
           "cli", "token_dispatcher"}
print(json.dumps(sorted(
    m for m in graph.modules
    if m.count(".") >= 1 and m.split(".")[1] in layered
    and graph.direct_import_exists(importer=m, imported="uccl_ep_megatron")
)))
"""


def _root_importers(pythonpath: Path | None, cwd: Path) -> set[str]:
    """Modules of the layers that import the package root, by grimp (in a fresh process)."""
    code = f"import sys; sys.path.insert(0, {str(pythonpath)!r})\n" if pythonpath else ""
    r = subprocess.run(
        [sys.executable, "-P", "-c", code + _ROOT_IMPORTERS],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout))


def _violating_copy(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the installed package's Python files with ``line`` added to ``module``."""
    dst = tmp_path / "site" / PACKAGE
    shutil.copytree(_installed_dir(), dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    path = dst.parent / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + "\n" + line + "\n")
    return dst.parent


def test_installed_package_keeps_the_layers(tmp_path):
    r = _lint(None, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 1 kept, 0 broken" in r.stdout, r.stdout


def test_contract_breaks_on_an_upward_import(tmp_path):
    site = _violating_copy(tmp_path, f"{PACKAGE}.core.errors", "import uccl_ep_megatron.cli.app")
    r = _lint(site, tmp_path)
    assert r.returncode != 0, r.stdout
    assert "BROKEN" in r.stdout and "uccl_ep_megatron.core.errors" in r.stdout, r.stdout


def test_no_layer_imports_the_package_root(tmp_path):
    found = _root_importers(None, tmp_path)
    assert not found, f"imports of the package root below it: {found}; use core._c.load()"


def test_root_import_check_catches_a_new_one(tmp_path):
    line = "from uccl_ep_megatron import Buffer"
    site = _violating_copy(tmp_path, f"{PACKAGE}.telemetry.report", line)
    found = _root_importers(site, tmp_path)
    assert f"{PACKAGE}.telemetry.report" in found
