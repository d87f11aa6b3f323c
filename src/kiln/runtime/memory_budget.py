"""Memory admission: one budget for the process, resident state, and reservations against it.

The budget is the detected memory (:func:`kiln.runtime.memory.memory_total_bytes`: the CUDA
device's, or RAM within a cgroup limit), lowered to ``limits.memory_budget_bytes`` when that is
set (a cap, never more than detected). Resident state is what serving holds for as long as the
server runs: the model's weights and the paged KV pool (plus a hybrid's linear-state slots).
A *reservation* is what admitted work adds beside it: a training job while it runs (its
estimate, :mod:`kiln.training.core.memory_estimate`) and each served adapter revision (its tensor
bytes, :mod:`kiln.adapters.footprint`). Admission compares a new estimate with what is left:

* ``budget - resident < need``: it can never fit, whatever is released:
  :class:`~kiln.errors.InsufficientMemory` (507, ``memory_budget_exceeded``);
* ``budget - resident - reserved < need``: it cannot fit *now* because other reservations hold
  memory: :class:`~kiln.errors.Conflict` (409, ``memory_reserved``).

Both errors name the numbers. Standard library only (the estimates are computed elsewhere).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from kiln.errors import Conflict, InsufficientMemory

MIB = 1024 * 1024


def mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


@dataclass(frozen=True)
class Reservation:
    """Memory held by admitted work: ``kind`` (training | adapter), an ``owner`` ID, and the parts it adds up."""

    kind: str
    owner: str
    bytes: int
    parts: dict[str, int] = field(default_factory=dict)

    def public(self) -> dict:
        return {"kind": self.kind, "owner": self.owner, "bytes": self.bytes, "parts": dict(self.parts)}


class MemoryBudget:
    """The process's memory budget and the reservations held against it (thread-safe)."""

    def __init__(self, detected_bytes: int, cap_bytes: int, resident: Callable[[], dict[str, int]]):
        self.detected_bytes = int(detected_bytes)
        self.cap_bytes = int(cap_bytes)  # limits.memory_budget_bytes; 0: none
        self.budget_bytes = min(self.detected_bytes, self.cap_bytes) if self.cap_bytes else self.detected_bytes
        self._resident = resident  # what serving holds: weights, kv_cache, ... (bytes)
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], Reservation] = {}
        self._pending: set[tuple[str, str]] = set()  # reserved for work not yet in place (an adapter loading)

    def resident(self) -> dict[str, int]:
        return {k: int(v) for k, v in self._resident().items()}

    def reserved_bytes(self, *, kinds: frozenset[str] | None = None) -> int:
        with self._lock:
            return sum(r.bytes for r in self._held.values() if kinds is None or r.kind in kinds)

    def check(self, kind: str, owner: str, parts: dict[str, int], *, what: str,
              ignore_kinds: frozenset[str] = frozenset(), ignore_owners: set[str] | frozenset[str] = frozenset()) -> None:
        """Raise 507 when ``parts`` can never fit, 409 when reservations (other than this owner's, those of
        ``ignore_kinds`` and ``ignore_owners``) hold the memory it needs now. ``what`` names the work."""
        with self._lock:
            self._check_locked(kind, owner, parts, ignore_kinds, ignore_owners, what)

    def _check_locked(self, kind: str, owner: str, parts: dict[str, int], ignore_kinds: frozenset[str],
                      ignore_owners: set[str] | frozenset[str], what: str) -> None:
        need = sum(parts.values())
        resident = sum(self.resident().values())
        room = self.budget_bytes - resident
        detail = ", ".join(f"{k} {mib(v)}" for k, v in parts.items() if v)
        if need > room:
            raise InsufficientMemory(
                f"{what} needs an estimated {need} bytes ({mib(need)}: {detail}), more than the "
                f"{max(room, 0)} bytes ({mib(max(room, 0))}) the memory budget of {self.budget_bytes} bytes "
                f"leaves beside {resident} bytes of resident weights and KV cache; it can never fit",
                code="memory_budget_exceeded",
                hint="raise limits.memory_budget_bytes (or give the server more memory), lower the batch size, "
                     "max_seq_len or LoRA rank, or shrink the KV pool (batching.kv_budget_bytes)")
        others = [r for key, r in self._held.items()
                  if key != (kind, owner) and r.kind not in ignore_kinds and r.owner not in ignore_owners]
        held = sum(r.bytes for r in others)
        if need > room - held:
            names = ", ".join(f"{r.kind} {r.owner} {r.bytes}" for r in others)
            raise Conflict(
                f"{what} needs an estimated {need} bytes ({mib(need)}: {detail}); {held} bytes are reserved by "
                f"other work ({names}), leaving {room - held} of the {room} bytes the budget of "
                f"{self.budget_bytes} bytes leaves beside {resident} bytes resident",
                code="memory_reserved",
                hint="retry when the reservations shown in GET /health under memory_budget are released "
                     "(a training job ends, an adapter is unloaded)")

    def reserve(self, kind: str, owner: str, parts: dict[str, int], *, what: str,
                ignore_kinds: frozenset[str] = frozenset(),
                ignore_owners: set[str] | frozenset[str] = frozenset(), pending: bool = False) -> Reservation:
        """Check and hold ``parts`` (bytes by category) for ``owner``; replaces that owner's earlier one.
        A ``pending`` reservation survives :meth:`keep_only` until :meth:`settle` (its work is being set up)."""
        with self._lock:
            self._check_locked(kind, owner, parts, ignore_kinds, ignore_owners, what)
            reservation = self._hold(kind, owner, parts)
            if pending:
                self._pending.add((kind, owner))
            return reservation

    def settle(self, reservation: Reservation) -> None:
        """The pending work is in place: from now on :meth:`keep_only` may drop the reservation."""
        with self._lock:
            self._pending.discard((reservation.kind, reservation.owner))

    def record(self, kind: str, owner: str, parts: dict[str, int]) -> Reservation:
        """Hold ``parts`` for ``owner`` without a check: memory already in use (an adapter a training job
        loaded itself). An existing reservation of that owner is kept."""
        with self._lock:
            held = self._held.get((kind, owner))
            return held if held is not None else self._hold(kind, owner, parts)

    def owners(self, kind: str) -> set[str]:
        with self._lock:
            return {owner for k, owner in self._held if k == kind}

    def _hold(self, kind: str, owner: str, parts: dict[str, int]) -> Reservation:
        reservation = Reservation(kind, owner, sum(parts.values()), dict(parts))
        self._held[(kind, owner)] = reservation
        return reservation

    def release(self, reservation: Reservation) -> None:
        """Drop ``reservation`` if it is still the one held for its owner (idempotent)."""
        with self._lock:
            key = (reservation.kind, reservation.owner)
            if self._held.get(key) is reservation:
                del self._held[key]
                self._pending.discard(key)

    def keep_only(self, kind: str, owners: set[str]) -> None:
        """Drop every settled ``kind`` reservation whose owner is not in ``owners`` (adapters no longer served)."""
        with self._lock:
            for key in [k for k in self._held if k[0] == kind and k[1] not in owners and k not in self._pending]:
                del self._held[key]

    def snapshot(self) -> dict:
        """GET /health's ``memory_budget``: the budget, what is resident, each reservation, what is left."""
        resident = self.resident()
        with self._lock:
            held = [r.public() for r in self._held.values()]
        reserved = sum(r["bytes"] for r in held)
        return {"budget_bytes": self.budget_bytes, "detected_bytes": self.detected_bytes,
                "cap_bytes": self.cap_bytes or None, "resident": resident, "reserved_bytes": reserved,
                "available_bytes": self.budget_bytes - sum(resident.values()) - reserved, "reservations": held}
