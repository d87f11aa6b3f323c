"""The consumer side of the engine: what a caller holds while its rows run.

:class:`Submission` is one request's rows (``n`` choices); each choice is a
:class:`RowStream` written by the engine thread and read by one consumer, async
(an event loop, woken once per engine step) or sync (a thread). :class:`Completion`
is a finished choice for blocking callers. The engine errors a caller can see
are defined here too, so a consumer needs nothing from the scheduler.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from kiln.errors import Internal, InvalidRequest, RateLimited, Unavailable
from kiln.runtime.request_trace import Observer as Observer  # re-exported: the engines take one
from kiln.runtime.sampling import TokenChoice

if TYPE_CHECKING:
    from kiln.runtime.scheduler import Scheduler


class EngineError(Internal):
    """The engine failed while running a request."""

    code = "engine_error"
    default_hint = "see the server log; GET /health"


class EngineRowFailed(Internal):
    """The forward of this request's row failed; the engine contained it (other requests ran on)."""

    code = "engine_row_failed"
    default_hint = "the engine contained the failure to this request's rows; see the server log and GET /health"


class EngineOutOfMemory(Unavailable):
    """This request's row ran out of device memory even alone; the engine contained it."""

    code = "engine_out_of_memory"
    default_hint = "retry later or with a shorter prompt / lower max_tokens; other requests were unaffected"


@dataclass(frozen=True)
class RowFault:
    """Why the engine ended one row with finish reason ``error`` (:mod:`kiln.runtime.cycle_faults`):
    the failure class (``forward_error`` | ``out_of_memory``) and what was raised."""

    fault_class: str
    message: str

    def error(self) -> EngineError | EngineRowFailed | EngineOutOfMemory:
        """The typed error a caller of this row gets."""
        if self.fault_class == "out_of_memory":
            return EngineOutOfMemory(f"the engine ran out of memory running this request alone ({self.message})",
                                     retry_after=1.0)
        return EngineRowFailed(f"the engine's forward failed for this request ({self.fault_class}: {self.message})")


class EngineOverloaded(RateLimited):
    """The waiting queue is full; retry later."""

    code = "overloaded"
    default_hint = "retry after a short wait"


class EngineNotRunning(Unavailable):
    """The engine is stopped or failed; restart the server."""

    code = "engine_unavailable"
    default_hint = "check GET /health; restart the server"


class PromptTooLong(InvalidRequest):
    """Prompt plus requested tokens exceed the model length limit."""

    code = "context_length_exceeded"
    default_hint = "shorten the prompt or lower max_tokens"


class Admission:
    """A request between arrival and submission (parsing, rendering, tokenizing); see
    :meth:`kiln.runtime.engine.Engine.admission`. :meth:`end` is idempotent."""

    __slots__ = ("_end",)

    def __init__(self, start: Callable[[], None] | None = None, end: Callable[[], None] | None = None):
        if start is not None:
            start()
        self._end = end

    def end(self) -> None:
        end, self._end = self._end, None
        if end is not None:
            end()


@dataclass
class StreamChunk:
    """What a consumer gets from one drain: new text, the tokens behind it, and the end (if reached)."""

    text: str = ""
    tokens: list[TokenChoice] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort | error
    fault: RowFault | None = None  # with finish reason error: the engine contained a failure to this row


class RowStream:
    """One generated sequence (one choice), written by the engine thread, read by one consumer."""

    def __init__(self, index: int, loop: asyncio.AbstractEventLoop | None, event: asyncio.Event | None = None,
                 incremental: bool = True):
        self.index = index
        self.loop = loop
        self.incremental = incremental  # False: the consumer is woken only when the row ends
        self._lock = threading.Lock()
        self._text: list[str] = []
        self._tokens: list[TokenChoice] = []
        self._finish: str | None = None
        self._fault: RowFault | None = None
        self._delivered_finish = False
        # one event may be shared by all streams of a submission, so a consumer can wait on any of them
        self._aevent = event if event is not None else (asyncio.Event() if loop is not None else None)
        self._tevent = threading.Event()
        self._on_output: Callable[[], None] | None = None  # set by a consumer that is called instead of woken
        self.prompt_tokens = 0
        self.completion_tokens = 0

    # engine thread
    def _push(self, text: str, choice: TokenChoice | None) -> None:
        with self._lock:
            if text:
                self._text.append(text)
            if choice is not None:
                self._tokens.append(choice)

    def _close(self, reason: str, fault: RowFault | None = None) -> None:
        with self._lock:
            self._finish = reason
            self._fault = fault

    def _wake(self) -> None:  # on the consumer's loop (async) or any thread (sync)
        if self._on_output is not None:
            self._on_output()
            return
        if self._aevent is not None:
            self._aevent.set()
        self._tevent.set()

    # consumer
    def _take(self) -> StreamChunk | None:
        with self._lock:
            if not self._text and not self._tokens and (self._finish is None or self._delivered_finish):
                return None
            chunk = StreamChunk("".join(self._text), self._tokens, self._finish,
                                self._fault if self._finish is not None else None)
            self._text, self._tokens = [], []
            if self._finish is not None:
                self._delivered_finish = True
            return chunk

    @property
    def finished(self) -> bool:
        return self._delivered_finish

    async def next_chunk(self) -> StreamChunk:
        """Wait for new output (async consumers; the stream must be bound to this loop)."""
        assert self._aevent is not None
        while True:
            self._aevent.clear()
            chunk = self._take()
            if chunk is not None:
                return chunk
            await self._aevent.wait()

    def next_chunk_sync(self, timeout: float | None = None) -> StreamChunk | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._tevent.clear()
            chunk = self._take()
            if chunk is not None:
                return chunk
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self._tevent.wait(left)


@dataclass
class Submission:
    streams: list[RowStream]
    adapter: str | None
    adapter_revision: str | None
    prompt_tokens: int
    _rows: list[Any] = field(default_factory=list, repr=False)
    _scheduler: "Scheduler | None" = field(default=None, repr=False)

    def cancel(self) -> None:
        """Abort every unfinished row of this submission (idempotent, any thread)."""
        if self._scheduler is not None:
            self._scheduler.cancel(self._rows)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    def take(self) -> list[tuple[int, StreamChunk]]:
        """The output so far that no call has taken yet: ``(choice index, chunk)`` pairs, maybe none."""
        return [(s.index, c) for s in self.streams if (c := s._take()) is not None]

    def on_output(self, callback: Callable[[], None] | None) -> None:
        """Have the engine call ``callback`` (on the streams' event loop, after each step that gave
        any choice output) instead of waking :meth:`next_chunks`; ``None`` goes back to waking.
        The callback takes the output itself (:meth:`take`) and must not raise."""
        for s in self.streams:
            s._on_output = callback

    async def next_chunks(self) -> list[tuple[int, StreamChunk]]:
        """Wait until any choice has new output; ``(choice index, chunk)`` pairs, ``[]`` once all ended."""
        event = self.streams[0]._aevent
        assert event is not None, "submit(..., loop=...) binds the streams to an event loop"
        while not self.finished:
            event.clear()
            out = self.take()
            if out:
                return out
            await event.wait()
        return []


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    tokens: list[TokenChoice]
    adapter_revision: str | None = None  # the adapter revision that produced it (None: the base model)



def _wake_all(streams: list[RowStream]) -> None:
    for s in streams:
        s._wake()
