"""Run a coroutine to its first suspension now, on the caller's stack; a task only if it suspends.

The streaming path writes every engine step's output to each open response. A task per
response per step costs a wake-up, a scheduling round and a resumption of the response's
coroutine, for a write that almost always completes at once: an ASGI ``send`` of a body
message only suspends when the transport is paused for flow control (a slow reader).
:func:`start_eagerly` calls the coroutine directly and hands it to a task only in that
case, which is what Python 3.12's ``asyncio.eager_task_factory`` does for every task;
Kiln supports 3.11, so it is spelled out here for the one place that needs it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class _Resumed(Coroutine):
    """A coroutine already suspended on ``pending`` (the future it yielded), in the coroutine
    protocol a task drives: the first step hands the task that future to wait on, later steps
    go to the coroutine itself."""

    __slots__ = ("_coro", "_pending")

    def __init__(self, coro: Coroutine, pending: Any):
        self._coro, self._pending = coro, pending

    def send(self, value: Any) -> Any:
        pending, self._pending = self._pending, None
        if pending is not None:
            return pending
        return self._coro.send(value)

    def throw(self, *exc: Any) -> Any:
        self._pending = None
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._pending = None
        self._coro.close()

    def __await__(self):
        pending, self._pending = self._pending, None
        if pending is not None:
            yield pending
        return (yield from self._coro.__await__())


def start_eagerly(coro: Coroutine) -> asyncio.Task | None:
    """Step ``coro`` until it first suspends: ``None`` when it finished without suspending (its
    exception, if it raised one, propagates here), else a task that runs the rest of it."""
    try:
        pending = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_Resumed(coro, pending))
