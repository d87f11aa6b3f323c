"""Failure classes of the engine cycle, their containment, and the fault-injection hook that proves it.

A cycle is schedule -> execute -> update (:mod:`kiln.runtime.scheduler`). Execute only reads rows and
writes this cycle's KV slots (positions no row has claimed yet), so when a forward raises, every row is
exactly as it was before the cycle: its state is *settled*, and the failure can be contained to the
rows of that cycle. The classes:

``forward_error``
    The forward raised (a kernel, an adapter, a bad input). The cycle's rows run again one by one;
    a row whose forward still fails alone ends with finish reason ``error`` and a typed
    :class:`~kiln.runtime.submission.EngineRowFailed`; the others go on as if nothing happened.
``out_of_memory``
    The forward ran out of memory (``torch.OutOfMemoryError``, a CPU allocator failure). The cycle is
    shrunk: its rows run in halves, recursively, and a lone prompt chunk is cut in half (its rest runs
    in later cycles), with the pool's workspace and the CUDA cache freed between tries; a row that
    runs out of memory alone on one token ends with :class:`~kiln.runtime.submission.EngineOutOfMemory`
    (503, retry later). The cap lasts: the scheduler then lowers the per-cycle token budget to half the
    failed cycle's tokens for a while (``CyclePlanner.lower_after_oom``), so the next cycles are not planned
    at the size that just ran out of memory.
``unknown_state``
    Anything after which the engine cannot tell which writes completed: a failure in the update step
    (rows half advanced), a device error that poisons the context (``CUDA error``, a device-side
    assert), any failure of a hybrid model's forward (its linear state is updated in place during
    the forward, so a retry would run the recurrence twice), or a failure outside a cycle. The
    engine *latches*: every row ends with ``error``, new work is refused, and ``/health`` reports
    ``restart_required: {"class": "unknown_state", "reason": ...}`` until a restart.

``KILN_ENGINE_FAULT`` (tests and drills only, as ``KILN_FAULT_POINT`` is for publication) injects a
failure: ``forward_raises:<marker>`` (the forward raises when a row's prompt text contains
``<marker>``), ``forward_oom:<marker>`` (an out-of-memory error instead), ``update_raises:<marker>``
(the update step raises, which latches).

Contained failures are counted by class in the engine's stats (``cycle_faults``; ``/health``'s
``engine_faults``) and on ``/metrics`` as ``kiln_engine_faults_total{class}``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from kiln.config import ConfigError
from kiln.runtime.cycle_plan import CyclePlan
from kiln.runtime.rows import Row, ScoreRow
from kiln.runtime.submission import RowFault

log = logging.getLogger("kiln.engine")

FORWARD_ERROR = "forward_error"
OUT_OF_MEMORY = "out_of_memory"
UNKNOWN_STATE = "unknown_state"

FAULT_ENV = "KILN_ENGINE_FAULT"
FAULT_KINDS = ("forward_raises", "forward_oom", "update_raises")
REASON_MAX_CHARS = 500

_OOM_TEXT = ("out of memory", "can't allocate memory", "not enough memory")
_DEVICE_LOST_TEXT = ("cuda error", "device-side assert", "illegal memory access", "cublas_status", "hip error")


@dataclass(frozen=True)
class RestartRequired:
    """Why the engine latched: the failure class and what was raised (``/health``'s ``restart_required``)."""

    fault_class: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"class": self.fault_class, "reason": self.reason}


class CycleLatched(Exception):
    """Raised out of a cycle whose completion state is unknown: the engine must stop serving."""

    def __init__(self, restart: RestartRequired):
        super().__init__(restart.reason)
        self.restart = restart


class InjectedFault(RuntimeError):
    """A failure injected by ``KILN_ENGINE_FAULT``."""


class InjectedOutOfMemory(InjectedFault):
    """An out-of-memory failure injected by ``KILN_ENGINE_FAULT=forward_oom:<marker>``."""


def describe(exc: BaseException) -> str:
    """``Type: first line of the message``, bounded."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:REASON_MAX_CHARS]


def classify(exc: BaseException) -> str:
    """The failure class of an exception raised by a forward (see the module docstring)."""
    text = str(exc).lower()
    if type(exc).__name__ == "AcceleratorError" or any(t in text for t in _DEVICE_LOST_TEXT):
        return UNKNOWN_STATE
    oom: tuple[type[BaseException], ...] = (MemoryError, InjectedOutOfMemory)
    if hasattr(torch, "OutOfMemoryError"):
        oom += (torch.OutOfMemoryError,)
    if isinstance(exc, oom):
        return OUT_OF_MEMORY
    if isinstance(exc, RuntimeError) and any(t in text for t in _OOM_TEXT):
        return OUT_OF_MEMORY
    return FORWARD_ERROR


class FaultHook:
    """``KILN_ENGINE_FAULT``: raise in a cycle step when a row's prompt text holds the marker."""

    def __init__(self, kind: str, marker: str, text_of: Callable[[list[int]], str]):
        self.kind = kind
        self.marker = marker
        self._text_of = text_of

    @classmethod
    def from_env(cls, text_of: Callable[[list[int]], str]) -> FaultHook | None:
        """The hook ``KILN_ENGINE_FAULT`` asks for (None when unset); a malformed value is a ConfigError."""
        spec = os.environ.get(FAULT_ENV, "")
        if not spec:
            return None
        kind, sep, marker = spec.partition(":")
        if kind not in FAULT_KINDS or not sep or not marker:
            raise ConfigError(f"{FAULT_ENV}={spec!r}: expected <kind>:<marker> with kind one of "
                              f"{', '.join(FAULT_KINDS)}")
        log.warning("%s=%s: the engine will fail on purpose for rows whose prompt holds %r", FAULT_ENV, kind, marker)
        return cls(kind, marker, text_of)

    def _hit(self, rows: Iterable[Row | ScoreRow]) -> bool:
        return any(self.marker in self._text_of(r.prompt) for r in rows)

    def before_forward(self, rows: Iterable[Row | ScoreRow]) -> None:
        if self.kind == "forward_raises" and self._hit(rows):
            raise InjectedFault(f"injected forward failure ({FAULT_ENV}={self.kind}:{self.marker})")
        if self.kind == "forward_oom" and self._hit(rows):
            raise InjectedOutOfMemory(f"out of memory (injected: {FAULT_ENV}={self.kind}:{self.marker})")

    def before_update(self, rows: Iterable[Row | ScoreRow]) -> None:
        if self.kind == "update_raises" and self._hit(rows):
            raise InjectedFault(f"injected update failure ({FAULT_ENV}={self.kind}:{self.marker})")


@dataclass
class Containment:
    """How a failed cycle is run again (see :func:`contain`); the callables are the scheduler's."""

    execute: Callable[[CyclePlan], Any]  # the plan's forwards -> a ForwardOutput (reads rows only)
    apply: Callable[[CyclePlan, Any], None]  # the update step for a plan that ran
    fail: Callable[[Row | ScoreRow, RowFault], None]  # ends one row with finish reason error
    relieve: Callable[[], None]  # frees what memory can be freed between out-of-memory tries
    unsettled: str | None = None  # why no failure can be contained (a hybrid's in-place linear state)


def contain(plan: CyclePlan, exc: Exception, how: Containment) -> dict[str, int]:
    """Run the rows of ``plan``, whose forward raised ``exc``, in smaller plans: one per row after a
    ``forward_error``, halves (recursively, down to half a prompt chunk) after ``out_of_memory``. A row that fails alone is ended
    with its :class:`RowFault`; the others are updated as usual. Returns the count of each class seen.
    Raises :class:`CycleLatched` for ``unknown_state`` (or any failure when ``how.unsettled``)."""
    seen: dict[str, int] = {}
    pending = [plan]
    failure: Exception | None = exc
    while pending:
        sub = pending.pop(0)
        if failure is None:
            try:
                out = how.execute(sub)
            except Exception as again:  # noqa: BLE001  (a forward may raise anything; classified below)
                failure = again
            else:
                how.apply(sub, out)  # a failure here escapes: rows half updated are unknown state
                continue
        cls = classify(failure)
        seen[cls] = seen.get(cls, 0) + 1
        if cls == UNKNOWN_STATE or how.unsettled is not None:
            why = f"{how.unsettled}: " if how.unsettled is not None and cls != UNKNOWN_STATE else ""
            raise CycleLatched(RestartRequired(UNKNOWN_STATE, f"{why}{describe(failure)}"[:REASON_MAX_CHARS])) \
                from failure
        log.warning("engine cycle of %d rows failed (%s: %s); %s", len(sub.rows), cls, describe(failure),
                    "running it again in halves" if cls == OUT_OF_MEMORY else "running its rows one by one")
        if cls == OUT_OF_MEMORY:
            how.relieve()
        smaller = sub.shrunk() if cls == OUT_OF_MEMORY else None
        if len(sub.items()) > 1:
            pending[:0] = sub.split(halves=cls == OUT_OF_MEMORY)
        elif smaller is not None:  # one prompt chunk: half of it now, the rest in later cycles
            pending.insert(0, smaller)
        else:
            row = sub.rows[0]
            log.error("ending one row after its forward failed alone (%s: %s)", cls, describe(failure))
            how.fail(row, RowFault(cls, describe(failure)))
        failure = None
    return seen
