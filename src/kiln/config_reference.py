"""The configuration reference, generated from :mod:`kiln.config` (no hand-written copy to drift).

``python -m kiln.config_reference`` rewrites ``docs/configuration.md`` (every key: type, default,
environment variable, what it does, from the settings models and their comments) and
``docs/kiln-config.schema.json`` (the JSON Schema of ``kiln.toml``); ``--check`` exits 1 when
either is out of date (a test runs it). Imports only :mod:`kiln.config` and the stdlib.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kiln.config import ENV_PREFIX, SECTIONS, TOP_LEVEL, Settings

DOCS = Path(__file__).resolve().parents[2] / "docs"
MARKDOWN = DOCS / "configuration.md"
SCHEMA = DOCS / "kiln-config.schema.json"
_FIELD = re.compile(r"^    (\w+): [^#]*?(?:#\s*(.*))?$")


def _comments(cls: type[BaseModel]) -> dict[str, str]:
    """Field name -> the comment on its line, or the comment lines right above it."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").strip())
            continue
        m = _FIELD.match(line)
        if m and m.group(1) in cls.model_fields:
            out[m.group(1)] = " ".join([*above, m.group(2) or ""]).strip()
        above = []
    return out


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    return text or str(annotation).replace("typing.", "")


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def render_markdown() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `kiln.config` by `python -m kiln.config_reference` (a test fails when this page",
        "is out of date). Precedence, lowest to highest: defaults < `kiln.toml` (`--config`,",
        "`$KILN_CONFIG`, `./kiln.toml`) < `KILN_<SECTION>_<FIELD>` environment < command-line flags.",
        "Unknown keys and invalid values stop start-up naming the key; `GET /v1/config` shows every",
        "effective value and its source. The JSON Schema of `kiln.toml` is",
        "[kiln-config.schema.json](kiln-config.schema.json).",
        "",
    ]
    defaults = Settings().model_dump(mode="json")
    for key in sorted(TOP_LEVEL):
        lines += [f"`{key}` ({_type(Settings.model_fields[key].annotation)}, default `{defaults[key]}`, "
                  f"env `{ENV_PREFIX}{key.upper()}`): Kiln's state directory (`$KILN_HOME`, else ~/.cache/kiln).", ""]
    for section, cls in SECTIONS.items():
        notes = _comments(cls)
        doc = cls.__doc__  # its own docstring only (inspect.getdoc would inherit pydantic's)
        lines += [f"## [{section}]", ""]
        if doc:
            lines += [inspect.cleandoc(doc), ""]
        lines += ["| key | type | default | environment | what it does |", "|---|---|---|---|---|"]
        for name, field in cls.model_fields.items():
            default = json.dumps(defaults[section][name])
            env = f"{ENV_PREFIX}{section.upper()}_{name.upper()}"
            lines.append(f"| `{section}.{name}` | {_cell(_type(field.annotation))} | `{_cell(default)}` | `{env}` | "
                         f"{_cell(notes.get(name, ''))} |")
        lines.append("")
    return "\n".join(lines)


def render_schema() -> str:
    schema = Settings.model_json_schema()
    schema["title"] = "kiln.toml"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    wanted = {MARKDOWN: render_markdown(), SCHEMA: render_schema()}
    if "--check" in argv:
        stale = [p.name for p, text in wanted.items() if not p.is_file() or p.read_text() != text]
        if stale:
            print(f"out of date: {', '.join(stale)} (run python -m kiln.config_reference)", file=sys.stderr)
            return 1
        return 0
    for path, text in wanted.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
