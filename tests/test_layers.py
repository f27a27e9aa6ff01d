"""The package's layering, as pyproject.toml's import-linter contracts state it (layers, no
cycles, private modules kept private, the pytest plugin without torch), and what import-linter
does not check: no private name is imported from another package of phasegraph."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "phasegraph"


def test_the_import_contracts_hold():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    assert lint_imports.exists(), f"{lint_imports} is missing: install the test extra (scripts/install.sh test)"
    proc = subprocess.run([str(lint_imports), "--no-cache"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _subpackage(module: str) -> str:
    """``phasegraph.runtime`` of ``phasegraph.runtime.models.loading``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_is_imported_from_another_package():
    """``from phasegraph.kernels.attention import _store_run`` inside phasegraph.kernels is the
    package's own business; from phasegraph.runtime it would tie the runtime to a private name."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("phasegraph.")):
                continue
            if _subpackage(node.module) == _subpackage(importer):
                continue
            names = [alias.name for alias in node.names if _private(alias.name)]
            if names:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {', '.join(names)}")
    assert not found, "private names imported across packages:\n" + "\n".join(found)
