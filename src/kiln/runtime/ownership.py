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
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator


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
