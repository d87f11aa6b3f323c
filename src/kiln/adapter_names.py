"""The one rule for adapter names: the store, the HTTP routes, training requests and the engines' live slots.

A contract module (standard library only) so the runtime can check names without importing the
adapter store's package; :mod:`kiln.adapters.manifest` re-exports it.
"""

from __future__ import annotations

import re
from typing import Any

MAX_ADAPTER_NAME_CHARS = 64
NAME_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_ADAPTER_NAME_CHARS - 1}}}")
# the same rule as JSON Schema keywords, for request models' ``json_schema_extra`` (published in /openapi.json)
NAME_SCHEMA: dict[str, Any] = {"pattern": f"^{NAME_RE.pattern}$", "maxLength": MAX_ADAPTER_NAME_CHARS}
REVISION_SCHEMA: dict[str, Any] = {"pattern": "^[0-9a-f]{64}$"}


def is_valid_name(name: object) -> bool:
    """Whether ``name`` is a valid adapter name: 1-64 of ``A-Z a-z 0-9 . _ -``, starting with a letter or digit."""
    return isinstance(name, str) and len(name) <= MAX_ADAPTER_NAME_CHARS and NAME_RE.fullmatch(name) is not None
