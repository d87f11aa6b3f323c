"""The served set: which adapters (name -> revision) a server was serving, and its default adapter,
kept across restarts.

``<adapter store>/.served.json`` (0600, written atomically after every change) holds the public
adapters the engine serves, each pinned to the revision it served. ``kiln serve`` loads them
again at start-up, before it answers requests, so clients that named an adapter keep getting
it after a restart instead of a 404. An entry that cannot be restored (deleted meanwhile, files
that no longer verify, another base model) is left out and reported in ``/health``
(``adapters_not_restored``), never guessed at. Stdlib only.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from kiln.adapters.manifest import is_valid_name
from kiln.canonical import atomic_write_bytes, canonical_json_bytes, is_lower_hex64

SERVED_SCHEMA = "kiln-served-adapters-v1"
SERVED_FILE = ".served.json"  # a leading dot: never an adapter name
MAX_SERVED = 1024  # entries read back; a larger file is refused whole
MAX_SERVED_BYTES = 256 << 10

log = logging.getLogger(__name__)


class ServedSet:
    """Reads and writes the served set of one adapter store."""

    def __init__(self, store_root: Path, *, public: Callable[[str], bool] = lambda name: True):
        self.path = Path(store_root) / SERVED_FILE
        self._public = public  # names worth restoring (not an eval's private load)
        self.default: tuple[str, str] | None = None  # the server default adapter (name, pinned revision)

    def save(self, active: Mapping[str, str]) -> None:
        entries = {n: r for n, r in sorted(active.items()) if self._public(n)}
        doc: dict = {"schema": SERVED_SCHEMA, "adapters": entries}
        if self.default is not None:
            doc["default"] = {"name": self.default[0], "revision": self.default[1]}
        atomic_write_bytes(self.path, canonical_json_bytes(doc) + b"\n", mode=0o600)

    def load(self) -> tuple[dict[str, str], tuple[str, str] | None]:
        """The saved set and default; ``({}, None)`` when there is none. A file that is not a valid set is
        logged and ignored."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return {}, None
        except OSError as exc:
            log.warning("served adapter set %s unreadable (%s); starting with none", self.path, exc.strerror)
            return {}, None
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_SERVED_BYTES + 1)
        try:
            doc = json.loads(raw) if len(raw) <= MAX_SERVED_BYTES else None
            entries = doc["adapters"] if isinstance(doc, dict) and doc.get("schema") == SERVED_SCHEMA else None
            if not isinstance(entries, dict) or len(entries) > MAX_SERVED or not all(
                    is_valid_name(n) and is_lower_hex64(r) for n, r in entries.items()):
                raise ValueError("not a kiln-served-adapters-v1 document")
            default = doc.get("default")
            if default is not None:
                if not (isinstance(default, dict) and set(default) == {"name", "revision"}
                        and is_valid_name(default["name"]) and is_lower_hex64(default["revision"])):
                    raise ValueError("its default is not {name, revision}")
                default = (default["name"], default["revision"])
        except (ValueError, KeyError) as exc:
            log.warning("served adapter set %s is invalid (%s); starting with none", self.path, exc)
            return {}, None
        return dict(entries), default

    def restore(self, store, activate: Callable[[Any], None]) -> tuple[list[dict[str, str]], tuple[str, str] | None]:
        """Activate (``activate(record)``: base, quarantine and canary checked there) every saved adapter at its
        saved revision, verified against its manifest; return the entries that could not be, with why, and the
        saved default. Call before ``engine`` gets this set's ``save`` as its change hook, so a partial restore
        never rewrites the file midway; then :meth:`save` the set actually served."""
        failed: list[dict[str, str]] = []
        entries, default = self.load()
        for name, revision in entries.items():
            try:
                record = store.verify(name, revision)
                activate(record)
            except Exception as exc:  # noqa: BLE001 - any refusal leaves this one out, reported, and goes on
                reason = getattr(exc, "message", None) or str(exc) or type(exc).__name__
                log.warning("adapter %s@%s was served before the restart but cannot be restored: %s",
                            name, revision[:12], reason)
                failed.append({"name": name, "revision": revision, "error": reason[:300]})
        return failed, default
