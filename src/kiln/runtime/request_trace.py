"""Per-request phase timings, measured where the phases happen (standard library only).

The engine thread stamps each generated row (:class:`kiln.runtime.scheduler.Row`): when it was
submitted, first admitted, when its first token was sampled, how long its cycles waited for
accelerator ownership, and when it ended. :func:`row_phases` turns those stamps into the fixed
phase set of ``kiln_request_phase_seconds{phase}`` (docs/latency.md):

* ``queue_wait``: submission -> first admission to the running set (a running-row slot, the
  token budget or KV memory was not free);
* ``lock_wait``: the time the row's cycles waited for shared accelerator ownership while a
  training step or an adapter change held it exclusively (summed over the row's life);
* ``prefill``: first admission -> first sampled token (prompt chunks, prefix-cache reuse, the
  cycles shared with other rows; lock waits in that span included);
* ``decode``: first token -> the row's end (every later token);
* ``adapter_transition``: one adapter load or unload (exclusive ownership wait, weight swap and
  canary), observed per transition, not per row.

A request being recorded by the recent-request log (``server.debug_requests``) carries a
:class:`RequestTrace` in the :data:`CURRENT` context variable; :meth:`Engine.submit` attaches it to
the request's rows and the engine thread adds each row's phases and token counts to it.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

PHASES = ("queue_wait", "lock_wait", "prefill", "decode", "adapter_transition")  # fixed label set


class RequestTrace:
    """What the engine learns about one HTTP request's rows (written on the engine thread)."""

    def __init__(self, keep_text: bool = False):
        self.keep_text = keep_text
        self._lock = threading.Lock()
        self.adapter: str | None = None
        self.adapter_revision: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.rows = 0
        self.finish_reasons: list[str] = []
        self.phases: dict[str, float] = {}  # per phase: the longest row's seconds (rows run side by side)
        self.prompt_ids: list[int] | None = None  # only when keep_text
        self.completion_ids: list[list[int]] = []

    def submitted(self, adapter: str | None, revision: str | None, prompt_ids: list[int], rows: int) -> None:
        with self._lock:
            self.adapter, self.adapter_revision = adapter, revision
            self.prompt_tokens += len(prompt_ids)
            self.rows += rows
            if self.keep_text:
                self.prompt_ids = list(prompt_ids)

    def row_ended(self, phases: dict[str, float], completion_tokens: int, reason: str, generated: list[int]) -> None:
        with self._lock:
            self.completion_tokens += completion_tokens
            self.finish_reasons.append(reason)
            for name, seconds in phases.items():
                self.phases[name] = max(self.phases.get(name, 0.0), seconds)
            if self.keep_text:
                self.completion_ids.append(list(generated))


CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("kiln_request_trace", default=None)


def row_phases(row: Any, end: float) -> dict[str, float]:
    """The phases of a row that ended at ``end`` (perf_counter); a phase it never reached is absent."""
    out: dict[str, float] = {}
    admitted = row.t_admit
    if admitted:
        out["queue_wait"] = max(0.0, admitted - row.t_submit)
        first = row.t_first
        if first:
            out["prefill"] = max(0.0, first - admitted)
            out["decode"] = max(0.0, end - first)
        else:
            out["prefill"] = max(0.0, end - admitted)
    out["lock_wait"] = row.lock_wait
    return out


class Observer:
    """Metrics hooks the engine calls from its thread (no-ops by default)."""

    def first_token(self, ttft_s: float) -> None: ...

    def inter_token(self, itl_s: float) -> None: ...

    def tokens_generated(self, count: int) -> None: ...

    def queue_wait(self, wait_s: float) -> None:
        """A row was admitted after waiting ``wait_s`` in the queue (for a running-row slot or KV memory)."""

    def request_phases(self, phases: dict[str, float]) -> None:
        """A generated row ended: its seconds per phase (:func:`row_phases`)."""

    def adapter_transition(self, action: str, seconds: float) -> None:
        """An adapter ``load`` or ``unload`` took ``seconds`` (ownership wait, swap and canary)."""
