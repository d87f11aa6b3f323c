"""Served adapter name -> (key, revision), with the rows holding each key: one table for both engines.

A key is one revision's slot in the engine (a PEFT adapter name in the built-in engine's
:class:`~kiln.runtime.adapter_slots.AdapterSlots`, a vLLM LoRA name in
:class:`~kiln.runtime.vllm_engine.LoraTable`). Requests ``acquire`` a name's current key and
``release`` it when their row ends; activating a new revision or deactivating a name *retires*
the key it served. A retired key may be deleted once no row holds it: :meth:`activate`,
:meth:`deactivate` and :meth:`release` say when that moment is, and the caller deletes the key
and then :meth:`forget`\\ s it. Pure bookkeeping, thread-safe; it loads and deletes nothing.
"""

from __future__ import annotations

import threading
from typing import Any

from kiln.errors import NotFound


class UnknownAdapter(NotFound):
    """No adapter of that name is being served."""

    code = "adapter_not_active"
    default_hint = "GET /v1/adapters shows which adapters are active"


class AdapterRefs:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: dict[str, tuple[str, str]] = {}  # name -> (key, revision)
        self._refs: dict[str, int] = {}  # key -> rows holding it
        self._retired: set[str] = set()  # keys no name maps to any more, not yet forgotten

    def current(self, name: str) -> str | None:
        """The key ``name`` serves now, or ``None``."""
        with self._lock:
            entry = self._names.get(name)
            return None if entry is None else entry[0]

    def acquire(self, name: str) -> tuple[str, str]:
        """Resolve a served name to ``(key, revision)`` and hold a reference on the key."""
        with self._lock:
            try:
                key, revision = self._names[name]
            except KeyError:
                raise UnknownAdapter(f"no active adapter named {name!r}") from None
            self._refs[key] = self._refs.get(key, 0) + 1
            return key, revision

    def hold(self, key: str, count: int) -> None:
        """``count`` references on ``key`` whatever serves it (a trainer's private adapter)."""
        with self._lock:
            self._refs[key] = self._refs.get(key, 0) + count

    def release(self, key: str) -> bool:
        """Drop one reference; ``True`` when that was the last one on a retired key (delete it now)."""
        with self._lock:
            self._refs[key] -= 1
            if self._refs[key] > 0:
                return False
            del self._refs[key]
            return key in self._retired

    def activate(self, name: str, key: str, revision: str) -> str | None:
        """Serve ``name`` from ``key``; the key it served before is retired, and returned when no row holds it."""
        with self._lock:
            old = self._names.get(name)
            self._names[name] = (key, revision)
            self._retired.discard(key)
            if old is None or old[0] == key:
                return None
            self._retired.add(old[0])
            return old[0] if self._refs.get(old[0], 0) == 0 else None

    def deactivate(self, name: str) -> str | None:
        """Stop serving ``name``; its key is retired, and returned when no row holds it."""
        with self._lock:
            entry = self._names.pop(name, None)
            if entry is None:
                raise UnknownAdapter(f"no active adapter named {name!r}")
            key = entry[0]
            self._retired.add(key)
            return key if self._refs.get(key, 0) == 0 else None

    def forget(self, key: str) -> None:
        """``key`` was deleted (or never needs to be): it is no longer retired."""
        with self._lock:
            self._retired.discard(key)

    def deletable(self, key: str) -> bool:
        """Whether ``key`` is still retired and unheld (not re-activated since it was found deletable)."""
        with self._lock:
            return key in self._retired and self._refs.get(key, 0) == 0

    def serves_key(self, key: str) -> bool:
        with self._lock:
            return any(k == key for k, _ in self._names.values())

    def active(self) -> dict[str, str]:
        """Served name -> revision, sorted by name."""
        with self._lock:
            return {name: rev for name, (_key, rev) in sorted(self._names.items())}

    def live_keys(self) -> set[str]:
        """Keys the engine must still hold: served ones and retired ones not yet forgotten."""
        with self._lock:
            return {k for k, _ in self._names.values()} | set(self._retired)

    def snapshot(self) -> dict[str, Any]:
        """Each served name's key and revision, rows holding each key, retired keys not yet forgotten."""
        with self._lock:
            return {
                "served": {name: {"key": key, "revision": rev} for name, (key, rev) in sorted(self._names.items())},
                "row_references": dict(sorted(self._refs.items())),
                "retired_keys": sorted(self._retired),
            }
