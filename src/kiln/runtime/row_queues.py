"""The scheduler's rows by stage: waiting (in admission order), prefilling, decoding; and the two
counts other threads read (``queued``: waiting or arriving, ``active``: admitted and not yet cleaned up).

:class:`RowQueues` moves rows between stages: admission (blocks and a state slot from the
:class:`~kiln.runtime.kv_ledger.BlockLedger`, an admission number, the queue-wait observation),
prefill done -> decoding, preemption back to the head of the queue, and removal. Only the engine
thread moves rows; the counts change under the scheduler's condition (``lock``) so that
``stats()`` and submission read them consistently.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Iterable

from kiln.runtime.kv_ledger import BlockLedger
from kiln.runtime.request_trace import Observer
from kiln.runtime.rows import Row, ScoreRow

AnyRow = Row | ScoreRow


class RowQueues:
    """Waiting, prefilling and decoding rows (see the module docstring)."""

    def __init__(self, ledger: BlockLedger, observer: Observer, lock: threading.Condition):
        self.ledger = ledger
        self.observer = observer
        self._lock = lock
        self.waiting: collections.deque[AnyRow] = collections.deque()
        self.prefilling: list[AnyRow] = []
        self.decoding: list[Row] = []
        self.queued = 0  # rows submitted and not yet admitted (changed under ``lock``)
        self.active = 0  # rows admitted and not yet cleaned up (changed under ``lock``)
        self.preemptions = 0
        self._seq = 0

    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def arrive(self, rows: Iterable[AnyRow]) -> None:
        """Rows taken from the scheduler's inbox join the back of the queue (already counted as queued)."""
        self.waiting.extend(rows)

    def admit(self, row: AnyRow) -> bool:
        """Start ``row`` (its cached prefix blocks attached) if the pool can hold its prompt; else ``False``."""
        if not self.ledger.reserve(row, self.running() > 0):
            return False
        if not row.seq:
            self._seq += 1
            row.seq = self._seq
        now = time.perf_counter()
        self.observer.queue_wait(now - row.t_wait)
        if isinstance(row, ScoreRow):
            row.rows = [None] * (row.prefilled + 1)
        elif not row.t_admit:
            row.t_admit = now
        self.waiting.remove(row)
        self.prefilling.append(row)
        with self._lock:
            self.queued -= 1
            self.active += 1
        return True

    def to_decoding(self, row: Row) -> None:
        self.prefilling.remove(row)
        self.decoding.append(row)

    def rotate(self, partial: list[AnyRow]) -> None:
        """Partly prefilled rows go to the back, so the next cycle starts with someone else."""
        if partial:
            self.prefilling = [r for r in self.prefilling if r not in partial] + partial

    def release(self, row: AnyRow) -> None:
        """``row`` stops running: out of its stage, its blocks and state slot given back."""
        if row in self.prefilling:
            self.prefilling.remove(row)
        elif isinstance(row, Row) and row in self.decoding:
            self.decoding.remove(row)
        self.ledger.release(row)

    def preempt(self, row: AnyRow) -> None:
        """Back to the head of the queue (in admission order), its blocks released; recomputed later."""
        self.release(row)
        self.ledger.forget_prefix(row)
        row.prefilled = row.pos = 0
        if isinstance(row, ScoreRow):
            row.rows = [None]
        else:
            row.tokens = row.prompt + row.generated
        row.t_wait = time.perf_counter()
        at = next((i for i, w in enumerate(self.waiting) if w.seq == 0 or w.seq > row.seq), len(self.waiting))
        self.waiting.insert(at, row)
        self.preemptions += 1
        with self._lock:
            self.queued += 1
            self.active -= 1

    def drop_waiting(self, row: AnyRow) -> None:
        """A waiting row leaves without running (cancelled, engine stopped)."""
        if row in self.waiting:
            self.waiting.remove(row)
        with self._lock:
            self.queued -= 1

    def ended(self) -> None:
        """An admitted row's cleanup is done: it stops counting as active."""
        with self._lock:
            self.active -= 1
