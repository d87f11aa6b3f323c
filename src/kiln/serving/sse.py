"""Server-sent events for the generation routes: frame encoding and the eagerly pumped response.

:class:`SSEResponse` writes one submission's events straight to ASGI ``send``; the
routes hand it a :class:`StreamFormat` that turns each engine chunk into a frame
(:mod:`kiln.serving.routes_chat`, :mod:`kiln.serving.routes_completions`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Protocol

from fastapi.responses import StreamingResponse
from starlette.types import Receive

from kiln.serving.eager import start_eagerly

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_FRAME = b"data: [DONE]\n\n"


def compact_json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse_frame(obj: Any) -> bytes:
    return b"data: " + compact_json(obj).encode() + b"\n\n"


class DeltaFrame:
    """Pre-encoded SSE frame around one choice's text delta: the per-token hot path
    formats only the index and the text instead of re-encoding the whole chunk.

    ``base`` is the chunk's fields before ``choices``; ``key`` the delta's opening
    (``'"delta":{"content":'`` for chat, ``'"text":'`` for completions)."""

    def __init__(self, base: dict, key: str):
        self._head = compact_json(base)[:-1] + ',"choices":[{"index":'
        self._key = key
        self._tail = ("}" if key.startswith('"delta"') else "") + ',"logprobs":null,"finish_reason":null}]}\n\n'

    def __call__(self, index: int, text: str) -> bytes:
        return f"data: {self._head}{index},{self._key}{compact_json(text)}{self._tail}".encode()


class StreamFormat(Protocol):
    """How one route's stream looks: ``chunk`` per engine chunk (a dict to encode, or frames already
    encoded), ``first`` per choice before its first tokens (or ``None``), ``usage`` at the end (or ``None``)."""

    def chunk(self, index: int, c: Any, reason: str | None) -> dict | bytes: ...

    first: Callable[[int], dict] | None
    usage: Callable[[int], dict] | None


async def await_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(receive: Receive, sub: Any) -> None:
    await await_disconnect(receive)
    sub.cancel()


async def _no_body():  # placeholder body iterator: SSEResponse writes its own body
    yield b""


_NO_BODY = _no_body()


class SSEResponse(StreamingResponse):
    """SSE events for one submission, ending with ``data: [DONE]``, written straight to ASGI ``send``.

    The per-token path is short on purpose (on a small model it costs as much as the
    forward): the engine calls :meth:`_pump` on the loop after each step that gave this
    submission output (``Submission.on_output``), and the pump writes all of the step's
    new frames as one body message, running ``send`` in place (:func:`start_eagerly`: a
    task only when flow control pauses the write), so a token costs no task wake-up. One
    deadline timer covers the whole request; the last content, the usage chunk and
    ``[DONE]`` go out in the final write. A disconnect (seen by a watcher on ``receive``)
    or the deadline cancels the rows.
    """

    def __init__(self, sub: Any, timeout_s: float,
                 make_chunk: Callable[[int, Any, str | None], dict | bytes],
                 first: Callable[[int], dict] | None, usage_chunk: Callable[[int], dict] | None,
                 headers: dict[str, str]):
        super().__init__(_NO_BODY, media_type="text/event-stream", headers=headers)
        self._sub, self._timeout = sub, timeout_s
        self._make_chunk, self._first, self._usage = make_chunk, first, usage_chunk
        self._parts: list[bytes] = []
        self._completion_tokens = 0
        self._send: Any = None
        self._ended: asyncio.Future | None = None  # done when every choice ended, or a write failed
        self._writing: asyncio.Task | None = None  # a body write that flow control paused

    @classmethod
    def of(cls, sub: Any, timeout_s: float, fmt: StreamFormat, headers: dict[str, str]) -> SSEResponse:
        """The response for ``sub`` in a route's :class:`StreamFormat`, with the SSE headers."""
        return cls(sub, timeout_s, fmt.chunk, fmt.first, fmt.usage, {**SSE_HEADERS, **headers})

    async def __call__(self, scope, receive, send) -> None:
        sub = self._sub
        watch = asyncio.ensure_future(cancel_on_disconnect(receive, sub))
        self._send, self._ended = send, asyncio.get_running_loop().create_future()
        parts = self._parts
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if self._first is not None:  # the role chunk goes out with the first tokens, as vLLM sends it, so a
                # client's time to first chunk is the time to the first token
                parts.extend(sse_frame(self._first(s.index)) for s in sub.streams)
            try:
                async with asyncio.timeout(self._timeout):
                    sub.on_output(self._pump)
                    self._pump()  # output of the steps before this response started
                    await self._ended  # the pump ends it only with no write in flight
            except TimeoutError:
                parts.append(sse_frame({"error": {"code": "request_timeout",
                                                  "message": f"no completion within {self._timeout} s",
                                                  "hint": "lower max_tokens or raise server.request_timeout_s"}}))
            finally:
                sub.on_output(None)
                if self._writing is not None and not self._writing.done():
                    self._writing.cancel()  # still waiting on flow control, so nothing of it was written
                    await asyncio.wait([self._writing])  # ended before the final write starts
            if self._usage is not None:
                parts.append(sse_frame(self._usage(self._completion_tokens)))
            parts.append(DONE_FRAME)
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": False})
        finally:
            watch.cancel()
            sub.cancel()

    def _pump(self) -> None:
        """Take the submission's new output and write it (on the loop; never raises)."""
        ended = self._ended
        if ended is None or ended.done() or (self._writing is not None and not self._writing.done()):
            return  # a paused write is in flight: its end pumps again
        self._writing = None
        sub, parts = self._sub, self._parts
        try:
            chunks = sub.take()
            for index, c in chunks:
                self._completion_tokens += len(c.tokens)
                reason = c.finish_reason
                if reason == "grammar_error":  # the grammar engine gave up: say so, and end the choice as an error
                    parts.append(sse_frame({"error": {"code": "grammar_too_complex", "param": None, "message":
                                                      "the grammar engine gave up during generation (a resource "
                                                      "limit of the grammar); this choice is incomplete"}}))
                    reason = "error"
                if c.fault is not None:  # the engine contained a failure to this choice: say which, typed
                    err = c.fault.error()
                    parts.append(sse_frame({"error": {"code": err.code, "param": None, "message": err.message,
                                                      "hint": err.hint}}))
                if c.text or c.tokens or reason is not None:
                    frame = self._make_chunk(index, c, reason)
                    parts.append(frame if isinstance(frame, bytes) else sse_frame(frame))
            if sub.finished:  # the final write carries what is left
                ended.set_result(None)
                return
            if not chunks:  # nothing new (the role chunks wait for the first tokens)
                return
            body = b"".join(parts)
            parts.clear()
            self._writing = start_eagerly(self._send({"type": "http.response.body", "body": body,
                                                      "more_body": True}))
            if self._writing is not None:
                self._writing.add_done_callback(self._written)
        except BaseException as exc:  # a failed write or chunk: the response ends with it
            if not ended.done():
                ended.set_exception(exc)

    def _written(self, task: asyncio.Task) -> None:  # a paused write ended; _pump started it, after _ended
        ended = self._ended
        assert ended is not None
        if task.cancelled():
            ended.cancel()
        elif (exc := task.exception()) is not None:
            if not ended.done():
                ended.set_exception(exc)
        else:
            self._pump()
