"""docs/troubleshooting.md names every error code the source can send, so the page cannot go stale.

Codes are collected from the source's syntax tree: ``code = "..."`` in an error class, ``code="..."``
in a call, the code argument of ``error_response``/``error_body``/``send_error`` and of the GRPO
reward's ``_refuse``, ``error=("code", ...)`` tuples (OpenEnv run failures) and the generic HTTP
codes of :mod:`kiln.serving.errors`. A code the page lists that no source sends is reported too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "kiln"
PAGE = ROOT / "docs" / "troubleshooting.md"
POSITIONAL = {"send_error": 2, "error_response": 1, "error_body": 1}
CLI_ONLY = {"distill/cli.py"}  # the distill CLI prints its refusals; it serves nothing


def _str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _name(func: ast.AST) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def source_codes() -> dict[str, set[str]]:
    """code -> the modules that send it."""
    out: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in CLI_ONLY:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found: list[str | None] = []
            if isinstance(node, ast.ClassDef):
                found += [_str(st.value) for st in node.body if isinstance(st, ast.Assign)
                          and any(isinstance(t, ast.Name) and t.id == "code" for t in st.targets)]
            elif isinstance(node, ast.Call):
                name = _name(node.func)
                keywords = {k.arg: k.value for k in node.keywords}
                found.append(_str(keywords.get("code")))
                if name in POSITIONAL and len(node.args) > POSITIONAL[name]:
                    found.append(_str(node.args[POSITIONAL[name]]))
                if name == "_refuse" and rel == "training/grpo/rewards.py" and len(node.args) > 1:
                    found.append(_str(node.args[1]))
                error = keywords.get("error")
                if isinstance(error, ast.Tuple) and error.elts:
                    found.append(_str(error.elts[0]))
            for code in found:
                if code is not None and re.fullmatch(r"[a-z][a-z0-9_]*", code):
                    out.setdefault(code, set()).add(rel)
    from kiln.serving.errors import _HTTP_CODES

    for code in [*_HTTP_CODES.values(), "http_error"]:
        out.setdefault(code, set()).add("serving/errors.py")
    return out


def page_codes() -> set[str]:
    """Codes the page documents: the first cell of a table row, in backticks."""
    return set(re.findall(r"^\|\s*`([a-z][a-z0-9_]*)`\s*\|", PAGE.read_text(), flags=re.M))


def test_every_error_code_has_a_troubleshooting_entry():
    codes = source_codes()
    assert len(codes) > 150  # the collector still finds the codes (a broken walk would pass vacuously)
    documented = page_codes()
    missing = {c: sorted(m) for c, m in codes.items() if c not in documented}
    assert not missing, f"add these codes to docs/troubleshooting.md (code -> cause -> fix): {missing}"
    stale = sorted(documented - set(codes))
    assert not stale, f"docs/troubleshooting.md lists codes no source sends: {stale}"


def test_operator_pages_are_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for page in ("docs/troubleshooting.md", "docs/security.md"):
        assert (ROOT / page).is_file() and f"({page})" in readme, page
