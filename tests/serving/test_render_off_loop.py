"""Issue 45 item 4: whether a chat is rendered and tokenized off the event loop counts every field the
template renders, not ``content`` alone. About 1 MB of ``reasoning_content`` (or of tool-call arguments) on
an assistant turn with a short ``content`` used to be rendered and tokenized on the loop, stalling every
stream (gaps up to 1.1 s). The real request model and the real ``render.chat_prompt``; the engine records which
thread rendered and tokenized."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from kiln.serving.protocol import ChatCompletionRequest
from kiln.serving.render import LARGE_PROMPT_CHARS, chat_prompt


class _RecordingEngine:
    def __init__(self) -> None:
        self.config = SimpleNamespace(max_model_len=10**9)
        self.threads: list[str] = []

    def render_chat(self, messages, tools=None, template_kwargs=None):
        self.threads.append(threading.current_thread().name)
        return "x"

    def encode_text(self, text):
        self.threads.append(threading.current_thread().name)
        return [1]

    def too_long(self, text, limit):
        return None


def _render(assistant: dict) -> list[str]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", **assistant},
                                       {"role": "user", "content": "go on"}]}
    req = ChatCompletionRequest.model_validate(body)
    engine = _RecordingEngine()
    state = SimpleNamespace(engine=engine, settings=SimpleNamespace(limits=SimpleNamespace(max_messages=64)))

    async def run() -> None:
        await chat_prompt(state, req)

    asyncio.run(run())
    return engine.threads


BIG = "y" * (LARGE_PROMPT_CHARS * 40)  # 800 kB: under the 1,000,000-character field limit


@pytest.mark.parametrize("assistant", [
    {"content": "ok", "reasoning_content": BIG},
    {"content": "", "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": "f", "arguments": '{"a": "' + BIG + '"}'}}]},
], ids=["reasoning_content", "tool_call_arguments"])
def test_a_large_rendered_field_other_than_content_leaves_the_loop(assistant):
    threads = _render(assistant)
    assert len(threads) == 2 and threading.main_thread().name not in threads, threads


def test_a_small_chat_stays_on_the_loop():
    threads = _render({"content": "ok", "reasoning_content": "short"})
    assert threads == [threading.main_thread().name] * 2
