"""Keep the server's absolute paths out of responses.

A response that names a file (a job's result, an error about a stored adapter or
a dataset) shows it relative to a named root instead: ``$KILN_ADAPTERS/name/...``,
``$KILN_DATA/...``, ``$KILN_HOME/...``, ``$KILN_MODEL/...``. The filesystem layout
(user names, mount points) is nobody's business over HTTP; an operator who wants
the real paths sets ``server.expose_paths = true``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kiln.config import Settings


class PathRedactor:
    def __init__(self, roots: dict[str, Path | str | None], *, enabled: bool = True):
        pairs: dict[str, str] = {}
        for label, root in roots.items():
            if root is None:
                continue
            for form in {os.path.abspath(root), os.path.realpath(root)}:
                pairs.setdefault(form.rstrip(os.sep) or os.sep, label)
        # Longest prefix first: $KILN_ADAPTERS wins over the $KILN_HOME that contains it.
        ordered = sorted(pairs, key=len, reverse=True)
        self._labels = pairs
        # A root matches only as a whole path component ("/a/home" not inside "/a/homework").
        self._pattern = re.compile("(?:" + "|".join(re.escape(p) for p in ordered) + r")(?![^/\s'\"`,:;)\]}])") if ordered else None
        self.enabled = enabled

    @classmethod
    def from_settings(cls, settings: Settings, model_dir: Path | str | None) -> "PathRedactor":
        return cls({"$KILN_ADAPTERS": settings.adapters_path, "$KILN_DATA": settings.data_path,
                    "$KILN_HOME": settings.home_path, "$KILN_MODEL": model_dir},
                   enabled=not settings.server.expose_paths)

    def text(self, value: str) -> str:
        if not self.enabled or self._pattern is None or os.sep not in value:
            return value
        return self._pattern.sub(lambda m: self._labels[m.group(0)], value)

    def __call__(self, obj: Any) -> Any:
        """``obj`` (JSON-like) with every string's known roots replaced."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {k: self(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self(v) for v in obj]
        return obj
