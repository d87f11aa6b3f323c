"""The layers point one way: nothing below ``kiln.serving`` imports it.

Reads every module's source (imports at any depth, lazy ones inside functions
included) instead of importing it, so a lazy upward import cannot hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kiln

PACKAGE_ROOT = Path(kiln.__file__).parent
LOWER_LAYERS = ("training", "adapters", "runtime", "distill", "teachers", "cluster", "evals", "openenv")


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _modules_of(layer: str) -> list[Path]:
    return sorted((PACKAGE_ROOT / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", LOWER_LAYERS)
def test_lower_layers_never_import_serving(layer):
    files = _modules_of(layer)
    assert files, f"kiln.{layer} has no modules"
    offenders = {
        str(path.relative_to(PACKAGE_ROOT)): sorted(m for m in _imported_modules(path)
                                                    if m == "kiln.serving" or m.startswith("kiln.serving."))
        for path in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_scanner_sees_lazy_imports(tmp_path):
    """The check itself can fail: an import inside a function is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from kiln.serving.errors import error_body\n    import kiln.serving.app\n")
    assert {"kiln.serving.errors", "kiln.serving.app"} <= _imported_modules(probe)
