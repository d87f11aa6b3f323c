"""Accelerator ownership: many shared owners (inference) or one exclusive owner (a training step).

Inference steps take shared ownership; each training step, adapter mutation or other
physical change takes exclusive ownership. The lock is writer-preferring: once an
exclusive owner waits, new shared owners queue behind it, so a training step gets the
device between two decode steps and serving resumes right after it. Ownership is held
per step, never per job, which is what keeps chat responsive during a training job.

The lock is not re-entrant across modes: a thread that holds shared ownership and
asks for exclusive ownership would wait on itself forever. :meth:`exclusive` refuses
that with :class:`OwnershipError` instead, and :meth:`holds_shared` lets code that may
run inside a shared section (dropping the last reference to a retired adapter) defer
its exclusive work until the section ends.

:class:`HoldPacer` bounds what one trainer's exclusive holds take from serving: while chats wait it
gives each hold a time budget (``training.max_hold_ms``: the trainer slices its steps to fit) and
leaves serving ``training.serving_share`` of the time between holds (docs/latency.md).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator


RECENT_HOLDS = 256  # busy holds HoldPacer.snapshot's percentiles are taken over
MIN_HOLD_MS = 2.0  # the shortest budget hold_cycles gives a hold (below it each hold's fixed cost dominates)


class OwnershipError(RuntimeError):
    """Exclusive ownership requested by a thread that holds shared ownership (a self-deadlock)."""


class AcceleratorOwnership:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._exclusive_waiting = 0
        self.exclusive_wait_s = 0.0  # cumulative, for metrics
        self.exclusive_held_s = 0.0
        self._local = threading.local()  # per thread: shared sections it holds

    def holds_shared(self) -> bool:
        """True when the calling thread is inside a :meth:`shared` section."""
        return getattr(self._local, "depth", 0) > 0

    def last_shared_wait_s(self) -> float:
        """How long the calling thread's latest :meth:`shared` waited for an exclusive owner (0.0: it did not)."""
        return getattr(self._local, "shared_wait_s", 0.0)

    @contextmanager
    def shared(self) -> Iterator[None]:
        waited = 0.0
        with self._cond:
            if self._exclusive or self._exclusive_waiting:
                t0 = time.perf_counter()
                while self._exclusive or self._exclusive_waiting:
                    self._cond.wait()
                waited = time.perf_counter() - t0
            self._shared += 1
        self._local.shared_wait_s = waited
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._cond:
                self._shared -= 1
                if self._shared == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        if self.holds_shared():
            raise OwnershipError("exclusive ownership requested while this thread holds shared ownership; "
                                 "defer the work until the shared section ends")
        t0 = time.perf_counter()
        with self._cond:
            self._exclusive_waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        t1 = time.perf_counter()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self.exclusive_wait_s += t1 - t0
                self.exclusive_held_s += time.perf_counter() - t1
                self._cond.notify_all()

    def snapshot(self) -> dict[str, float | int | bool]:
        with self._cond:
            return {
                "shared_owners": self._shared,
                "exclusive": self._exclusive,
                "exclusive_waiting": self._exclusive_waiting,
                "exclusive_wait_s": round(self.exclusive_wait_s, 6),
                "exclusive_held_s": round(self.exclusive_held_s, 6),
            }


class HoldPacer:
    """Paces one trainer's exclusive holds while serving has work (``busy()``: rows running or queued).

    * :meth:`budget_s` is how long the next hold may take: ``max_hold_ms`` while serving is busy, None
      when it is idle (or the bound is 0: off), so an idle server trains in whole steps. With
      ``hold_cycles`` > 0 the budget follows the serving load: that many of serving's recent cycles
      (``cycle_s()``, the engine's average generation cycle), at least ``min_hold_ms``, at most
      ``max_hold_ms``; so a hold stalls a stream about as long as ``hold_cycles`` of its own steps.
    * :meth:`hold` takes exclusive ownership; while serving is busy it first leaves serving
      ``serving_share`` of the time: after a hold of ``d`` seconds it waits
      ``d * share / (1 - share)`` (at most ``max_gap_s``) before it asks again. Without that gap a
      trainer that asks again at once, being writer-preferred, would keep serving out.

    ``clock`` and ``sleep`` are injectable for tests; the counters feed ``snapshot()`` (/metrics).
    """

    def __init__(self, ownership: AcceleratorOwnership, busy: Callable[[], bool], *, serving_share: float = 0.5,
                 max_hold_ms: float = 50.0, max_gap_s: float = 1.0, hold_cycles: float = 0.0,
                 min_hold_ms: float = MIN_HOLD_MS, cycle_s: Callable[[], float | None] = lambda: None,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        if not 0.0 <= serving_share < 1.0:
            raise ValueError(f"serving_share must be in [0, 1), got {serving_share}")
        if max_hold_ms < 0 or hold_cycles < 0 or min_hold_ms < 0:
            raise ValueError(f"max_hold_ms, hold_cycles and min_hold_ms must be >= 0, got {max_hold_ms}, "
                             f"{hold_cycles}, {min_hold_ms}")
        self.ownership, self.busy, self.cycle_s = ownership, busy, cycle_s
        self.serving_share, self.max_hold_s, self.max_gap_s = serving_share, max_hold_ms / 1000.0, max_gap_s
        self.hold_cycles, self.min_hold_s = hold_cycles, min_hold_ms / 1000.0
        self.last_budget_s: float | None = None  # the budget the latest busy hold was given
        self._clock, self._sleep = clock, sleep
        self.last_hold_s = 0.0
        self.holds = 0  # exclusive holds taken
        self.busy_holds = 0  # of them, taken while serving was busy
        self.yields = 0  # gaps left to serving
        self.yielded_s = 0.0
        self.longest_busy_hold_s = 0.0  # the longest hold taken while serving was busy
        self._recent_busy: deque[float] = deque(maxlen=RECENT_HOLDS)  # the latest busy holds' seconds

    def budget_s(self) -> float | None:
        """Seconds the next hold may take (the trainer slices its work to fit); None: no bound now."""
        if self.max_hold_s <= 0 or not self.busy():
            return None
        budget = self.max_hold_s
        cycle = self.cycle_s() if self.hold_cycles > 0 else None
        if cycle is not None and cycle > 0:
            budget = min(budget, max(self.min_hold_s, self.hold_cycles * cycle))
        self.last_budget_s = budget
        return budget

    def gap_s(self) -> float:
        """How long serving gets before the next hold, after the last one (0 when serving is idle)."""
        if not self.serving_share or not self.last_hold_s or not self.busy():
            return 0.0
        return min(self.max_gap_s, self.last_hold_s * self.serving_share / (1.0 - self.serving_share))

    @contextmanager
    def hold(self) -> Iterator[None]:
        gap = self.gap_s()
        if gap > 0:
            self._sleep(gap)
            self.yields += 1
            self.yielded_s += gap
        with self.ownership.exclusive():
            busy = self.busy()
            t0 = self._clock()
            try:
                yield
            finally:
                self.last_hold_s = self._clock() - t0
                self.holds += 1
                if busy:
                    self.busy_holds += 1
                    self.longest_busy_hold_s = max(self.longest_busy_hold_s, self.last_hold_s)
                    self._recent_busy.append(self.last_hold_s)

    def snapshot(self) -> dict[str, float | int | None]:
        recent = sorted(self._recent_busy)
        p = (lambda q: round(recent[min(len(recent) - 1, q * len(recent) // 100)], 6)) if recent else (lambda q: 0.0)
        budget = None if self.last_budget_s is None else round(self.last_budget_s * 1000, 3)
        return {"serving_share": self.serving_share, "max_hold_ms": round(self.max_hold_s * 1000, 3),
                "hold_cycles": self.hold_cycles, "last_budget_ms": budget,
                "holds": self.holds, "busy_holds": self.busy_holds, "yields": self.yields,
                "yielded_s": round(self.yielded_s, 6), "longest_busy_hold_s": round(self.longest_busy_hold_s, 6),
                "recent_busy_hold_p50_s": p(50), "recent_busy_hold_p99_s": p(99)}
