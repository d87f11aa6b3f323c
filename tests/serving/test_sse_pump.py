"""The streaming response's write path: the engine's wake runs ``send`` in place, and a write that
flow control pauses finishes as a task while later output waits for it (kiln.serving.eager).

These drive ``SSEResponse`` with a real engine on the built-in model and an ASGI ``send`` that can
hold a write back, as uvicorn's does while the client reads slowly.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.loader import load_model
from kiln.runtime.sampling import SamplingParams
from kiln.serving.eager import start_eagerly
from kiln.serving.sse import SSEResponse

TOKENS = 48
FRAME = re.compile(rb"data: (\d+)\|(.*?)\|(\w*)\n\n", re.S)


# -- start_eagerly --------------------------------------------------------------------------------


def test_a_coroutine_that_never_suspends_runs_to_its_end_in_place():
    async def main():
        seen = []

        async def work():
            seen.append("ran")

        assert start_eagerly(work()) is None
        assert seen == ["ran"]  # before any loop iteration

    asyncio.run(main())


def test_an_exception_before_suspending_reaches_the_caller():
    async def main():
        async def work():
            raise ValueError("bad write")

        with pytest.raises(ValueError, match="bad write"):
            start_eagerly(work())

    asyncio.run(main())


def test_a_suspended_coroutine_finishes_as_a_task_with_its_result_and_order():
    async def main():
        gate = asyncio.Event()
        seen = []

        async def work():
            seen.append("before")
            await gate.wait()
            seen.append("after")
            await asyncio.sleep(0)
            return 7

        task = start_eagerly(work())
        assert task is not None and seen == ["before"]
        await asyncio.sleep(0.01)
        assert not task.done()
        gate.set()
        assert await task == 7
        assert seen == ["before", "after"]

    asyncio.run(main())


def test_cancelling_the_task_cancels_the_coroutine_where_it_waits():
    async def main():
        cleaned = []

        async def work():
            try:
                await asyncio.Event().wait()
            finally:
                cleaned.append(True)

        task = start_eagerly(work())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cleaned == [True]

    asyncio.run(main())


def test_a_resumed_coroutine_can_also_be_awaited_directly():
    from kiln.serving.eager import _Resumed

    async def main():
        gate = asyncio.get_running_loop().create_future()

        async def work():
            await gate
            return "done"

        coro = work()
        pending = coro.send(None)
        assert pending is gate
        asyncio.get_running_loop().call_later(0.01, gate.set_result, None)
        assert await _Resumed(coro, pending) == "done"

    asyncio.run(main())


def test_an_exception_after_suspending_is_the_tasks():
    async def main():
        async def work():
            await asyncio.sleep(0.001)
            raise KeyError("late")

        task = start_eagerly(work())
        with pytest.raises(KeyError):
            await task

    asyncio.run(main())


# -- SSEResponse over a real engine -----------------------------------------------------------


@pytest.fixture(scope="module")
def engine(builtin_model_dir):
    eng = Engine(load_model(builtin_model_dir), EngineConfig(max_running_rows=4, max_model_len=256)).start()
    yield eng
    eng.stop()


class HoldingSend:
    """An ASGI ``send`` that holds body write number ``hold_at`` (1-based) until released, never
    runs two writes at once, and records what it was sent."""

    def __init__(self, hold_at: int | None):
        self.hold_at, self.gate = hold_at, asyncio.Event()
        self.messages: list[dict] = []
        self.busy = False
        self.bodies = 0

    async def __call__(self, message: dict) -> None:
        assert not self.busy, "two writes ran at once"
        self.busy = True
        try:
            if message["type"] == "http.response.body":
                self.bodies += 1
                if self.bodies == self.hold_at:
                    await self.gate.wait()
            self.messages.append(message)
        finally:
            self.busy = False

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


async def _never_disconnect() -> dict:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def _frame(index: int, c, reason: str | None) -> bytes:
    return b"data: %d|%s|%s\n\n" % (index, c.text.encode(), (reason or "").encode())


def _prompt(engine) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": "Tell me about the river."}])


async def _stream(engine, send, timeout_s: float = 60.0, n: int = 1, first=None) -> None:
    params = [SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)] * n
    sub = engine.submit(_prompt(engine), params, loop=asyncio.get_running_loop())
    response = SSEResponse(sub, timeout_s, _frame, first, None, {})
    await response({"type": "http"}, _never_disconnect, send)


def _texts(body: bytes, n: int = 1) -> tuple[list[str], list[str]]:
    texts, reasons = [""] * n, [""] * n
    for index, text, reason in FRAME.findall(body):
        texts[int(index)] += text.decode()
        reasons[int(index)] += reason.decode()
    return texts, reasons


def test_every_token_arrives_once_and_in_order_when_a_write_is_held(engine):
    expected = engine.generate(_prompt(engine), SamplingParams(max_tokens=TOKENS, temperature=0,
                                                               ignore_eos=True))[0].text

    async def main():
        send = HoldingSend(hold_at=1)  # the first write; the engine keeps producing while it is held
        asyncio.get_running_loop().call_later(0.2, send.gate.set)
        await _stream(engine, send)
        return send

    send = asyncio.run(main())
    texts, reasons = _texts(send.body())
    assert texts == [expected]
    assert reasons == ["length"]
    assert send.body().endswith(b"data: [DONE]\n\n")
    assert send.messages[-1]["more_body"] is False
    assert all(m["more_body"] for m in send.messages[1:-1])
    # the output made while the first write was held went out together (one frame per choice joins
    # every token taken at once), not one write per step
    assert send.bodies < TOKENS


def test_two_choices_stream_with_held_writes(engine):
    async def main():
        send = HoldingSend(hold_at=1)
        asyncio.get_running_loop().call_later(0.1, send.gate.set)
        await _stream(engine, send, n=2)
        return send

    send = asyncio.run(main())
    texts, reasons = _texts(send.body(), 2)
    assert texts[0] == texts[1] and texts[0]  # greedy: both choices the same text
    assert reasons == ["length", "length"]


def test_a_deadline_while_a_write_is_held_ends_with_one_final_write(engine):
    async def main():
        send = HoldingSend(hold_at=2)  # never released: the write stays held past the deadline
        await _stream(engine, send, timeout_s=0.5)
        return send

    send = asyncio.run(main())
    body = send.body()
    assert b'"code":"request_timeout"' in body
    assert body.endswith(b"data: [DONE]\n\n")
    # the held write was cancelled before it wrote anything; the final write followed it alone
    assert send.messages[-1]["more_body"] is False
    assert sum(not m.get("more_body", True) for m in send.messages if m["type"] == "http.response.body") == 1
    _wait_idle(engine)  # the response cancelled its row


def _wait_idle(engine, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while engine.stats()["active_rows"] or engine.stats()["queued_rows"]:
        assert time.monotonic() < deadline, f"rows never ended: {engine.stats()}"
        time.sleep(0.01)


def test_the_role_chunk_goes_out_with_the_first_tokens_not_before(engine):
    """A client times its first token from the first event: the role chunk alone must not come first."""
    async def main():
        send = HoldingSend(hold_at=None)
        await _stream(engine, send, first=lambda i: {"role": "assistant", "index": i})
        return send

    send = asyncio.run(main())
    bodies = [m["body"] for m in send.messages if m["type"] == "http.response.body"]
    assert b'"role":"assistant"' in bodies[0]
    assert FRAME.search(bodies[0]), "the first write carried the role chunk without any token"
    assert _texts(send.body())[1] == ["length"]
