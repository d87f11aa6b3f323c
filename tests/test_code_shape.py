"""Size limits a reader can live with (issue 46): no module over 650 lines, no function over 80 lines.

A function's length is its body after the docstring: the code a reader reads. Its signature is not
counted, so a command whose options are a declarative table (Typer's ``Option(...)`` parameters) is
measured by what it does. Read from the source with ``ast``, never imported.

``ALLOWED`` names what is over a limit for now, with why; the test fails on anything else over a limit
and on an entry that is no longer over (take it off the list).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kiln

PACKAGE_ROOT = Path(kiln.__file__).parent
MAX_MODULE_LINES = 650
MAX_FUNCTION_LINES = 80

# "path relative to src/kiln" (a module) or "path::qualified.name" (a function) -> why it is over for now
ALLOWED: dict[str, str] = {}


def function_lengths(source: str) -> dict[str, int]:
    """Qualified name (``Class.method``, ``outer.inner``) -> lines of its body after the docstring."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                body = child.body
                if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                        and isinstance(body[0].value.value, str):
                    body = body[1:]
                assert child.end_lineno is not None
                out[name] = child.end_lineno - body[0].lineno + 1
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def over_limits(root: Path = PACKAGE_ROOT) -> dict[str, int]:
    """Every module over :data:`MAX_MODULE_LINES` and function over :data:`MAX_FUNCTION_LINES`, with its size."""
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        source = path.read_text(encoding="utf-8")
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            found[rel] = lines
        for name, length in function_lengths(source).items():
            if length > MAX_FUNCTION_LINES:
                found[f"{rel}::{name}"] = length
    return found


def test_no_module_or_function_over_the_limits():
    over = over_limits()
    assert {k: v for k, v in over.items() if k not in ALLOWED} == {}, "split it (or, with a reason, allow it)"


def test_every_allowed_entry_is_still_needed():
    over = over_limits()
    assert [k for k in ALLOWED if k not in over] == [], "no longer over a limit: remove it from ALLOWED"


def test_the_measure_can_fail(tmp_path):
    """The check itself: a long method and a long module are found; the docstring and signature are not counted."""
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    long_method = f'class C:\n    def run(self,\n            a=1):\n        """Doc.\n\n        More."""\n{body}\n'
    assert function_lengths(long_method) == {"C.run": MAX_FUNCTION_LINES + 1}
    fits = "def f():\n" + '    """' + "\n" * 200 + '    """\n' + "\n".join(f"    y{i} = {i}" for i in range(80)) + "\n"
    assert function_lengths(fits) == {"f": MAX_FUNCTION_LINES}
    (tmp_path / "big.py").write_text(long_method + "\n" * MAX_MODULE_LINES)
    assert over_limits(tmp_path) == {"big.py": MAX_MODULE_LINES + long_method.count("\n"),
                                     "big.py::C.run": MAX_FUNCTION_LINES + 1}
