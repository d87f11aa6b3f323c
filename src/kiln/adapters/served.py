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

import logging
from pathlib import Path
from typing import Any, Callable, Mapping

from kiln.adapters.manifest import is_valid_name
from kiln.canonical import (
    atomic_write_bytes,
    canonical_json_bytes,
    is_lower_hex64,
    read_regular_file,
    strict_json_loads,
)

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
        self.load_problem: str | None = None  # why the saved file was ignored at the last load (for /health)
        self.save_problem: str | None = None  # why the last save failed (cleared by one that succeeds)

    def save(self, active: Mapping[str, str]) -> None:
        entries = {n: r for n, r in sorted(active.items()) if self._public(n)}
        doc: dict = {"schema": SERVED_SCHEMA, "adapters": entries}
        if self.default is not None:
            doc["default"] = {"name": self.default[0], "revision": self.default[1]}
        try:
            atomic_write_bytes(self.path, canonical_json_bytes(doc) + b"\n", mode=0o600)
            self.save_problem = None
        except OSError as exc:  # a directory in its place: serving goes on, the set is not kept
            self.save_problem = f"{SERVED_FILE} cannot be written ({exc.strerror or exc}); the served set is not kept"
            log.warning("served adapter set %s cannot be written: %s", self.path, exc)

    @property
    def problem(self) -> str | None:
        """What ``/health`` reports as ``served_set_error``: why the saved set was ignored, why it cannot be
        written, or None."""
        return "; ".join(p for p in (self.load_problem, self.save_problem) if p) or None

    def load(self) -> tuple[dict[str, str], tuple[str, str] | None]:
        """The saved set and default; ``({}, None)`` when there is none. A file that is not a valid set (a
        directory or FIFO in its place, too large, too deep, not the schema) is logged and ignored, and why is
        kept in :attr:`problem` for ``/health``."""
        self.load_problem = None
        try:
            raw = read_regular_file(self.path, MAX_SERVED_BYTES)
        except FileNotFoundError:
            return {}, None
        except OSError as exc:  # NotRegularFileError, FileTooLargeError, EACCES ...
            return self._ignore(f"unreadable: {exc.strerror or exc}")
        try:
            doc = strict_json_loads(raw)
            entries = doc["adapters"] if isinstance(doc, dict) and doc.get("schema") == SERVED_SCHEMA else None
            if not isinstance(entries, dict) or len(entries) > MAX_SERVED or not all(
                    is_valid_name(n) and is_lower_hex64(r) for n, r in entries.items()):
                raise ValueError(f"not a {SERVED_SCHEMA} document")
            default = doc.get("default")
            if default is not None:
                if not (isinstance(default, dict) and set(default) == {"name", "revision"}
                        and is_valid_name(default["name"]) and is_lower_hex64(default["revision"])):
                    raise ValueError("its default is not {name, revision}")
                default = (default["name"], default["revision"])
        except (ValueError, KeyError) as exc:  # CanonicalJSONError (a ValueError) covers too-deep JSON
            return self._ignore(f"invalid: {str(exc)[:200]}")
        return dict(entries), default

    def _ignore(self, why: str) -> tuple[dict[str, str], None]:
        self.load_problem = f"{SERVED_FILE} {why}; no adapters were restored from it"
        log.warning("served adapter set %s %s; starting with none", self.path, why)
        return {}, None

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
