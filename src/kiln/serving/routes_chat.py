"""``POST /v1/chat/completions``: prepare the chat, submit it, answer in JSON or SSE.

:func:`chat_response` reads top to bottom: :func:`kiln.serving.prepare.prepare` checks the request,
renders the chat (:mod:`kiln.serving.render`) and builds its token budget, output parser
(:mod:`kiln.serving.output_parser`) and sampling parameters; :func:`kiln.serving.generation.submit`
hands the rows to the engine; the answer is a JSON response (each choice's text read by the output
parser) or an SSE stream (:class:`ChatChunks`, or :class:`ParsedChatChunks` when reasoning or tool
calls are parsed out of the text).

Normally reached through :mod:`kiln.serving.fast_path`, which calls :func:`chat_response`
without going through FastAPI; the FastAPI route calls the same function.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from kiln.runtime.sampling import TokenChoice
from kiln.serving.admission import admitted
from kiln.serving.fast_path import GenerationRoutes
from kiln.serving.generation import (
    StreamChunks,
    chat_logprobs,
    collect,
    include_usage,
    request_id,
    revision_header,
    submit,
    usage_json,
)
from kiln.serving.openai_responses import ChatCompletionResponse
from kiln.serving.output_parser import OutputParser
from kiln.serving.prepare import PreparedRequest, prepare
from kiln.serving.protocol import ChatCompletionRequest
from kiln.serving.render import precheck_chat
from kiln.serving.sse import DeltaFrame, SSEResponse, sse_frame
from kiln.serving.state import KilnState
from kiln.serving.tool_parsers import CallDelta

router = APIRouter()
routes = GenerationRoutes(router)


@routes.post("/v1/chat/completions", ChatCompletionRequest, name="chat_completions",
             response_model=ChatCompletionResponse, precheck=precheck_chat)
@admitted
async def chat_response(state: KilnState, body: ChatCompletionRequest, receive: Receive) -> Response:
    """The whole chat completion (JSON or SSE) for a validated request; ``receive`` reports a disconnect."""
    prepared = await prepare(state, body)
    sub = submit(state, prepared.prompts[0], prepared.rows(0), prepared.adapter, body.stream)
    headers = {**revision_header(sub, prepared.adapter, state), **prepared.headers}
    base = {"id": f"chatcmpl-{request_id()}", "object": "chat.completion", "created": int(time.time()),
            "model": body.model, "system_fingerprint": state.system_fingerprint}
    timeout = state.settings.server.request_timeout_s
    if body.stream:
        return SSEResponse.of(sub, timeout, _chunks(state, body, prepared, base), headers)
    results = await collect(receive, sub, timeout)
    return JSONResponse({**base, **_answer(state, prepared, results)}, headers=headers)  # ChatCompletionResponse


def _answer(state: KilnState, prepared: PreparedRequest,
            results: list[tuple[str, list[TokenChoice], str]]) -> dict[str, Any]:
    """``choices`` and ``usage`` of the JSON answer: each choice's text read by the request's output parser."""
    output = prepared.output
    assert output is not None  # every chat has one
    tt = state.engine.token_text
    choices = []
    for i, (text, toks, reason) in enumerate(results):
        message, reason = output.message(text, reason)
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(toks, tt) if prepared.logprobs is not None else None,
                        "finish_reason": reason})
    return {"choices": choices, "usage": usage_json(prepared.prompt_tokens, sum(len(t) for _, t, _ in results))}


def _chunks(state: KilnState, body: ChatCompletionRequest, prepared: PreparedRequest,
            base: dict[str, Any]) -> ChatChunks:
    """The stream's format: its chunks' fields before ``choices`` are the answer's, as a chunk."""
    base = {**base, "object": "chat.completion.chunk"}
    output, tt = prepared.output, state.engine.token_text
    if output is not None and output.parses:
        return ParsedChatChunks(base, prepared.prompt_tokens, include_usage(body), prepared.logprobs, tt,
                                output, body.n)
    return ChatChunks(base, prepared.prompt_tokens, include_usage(body), prepared.logprobs, tt)


# -- the stream -------------------------------------------------------------------------------


class ChatChunks(StreamChunks):
    """A chat stream's chunks: the role chunk first, then content deltas (pre-encoded while there are
    no logprobs and no finish reason), the finish reason in the choice's last chunk."""

    def __init__(self, base: dict[str, Any], prompt_tokens: int, usage: bool, logprobs: int | None,
                 token_text: Callable[[int], str]):
        super().__init__(base, prompt_tokens, usage)
        self.logprobs = logprobs
        self.token_text = token_text
        self.content = DeltaFrame(base, '"delta":{"content":')
        self.first = self._role

    def _role(self, i: int) -> dict[str, Any]:
        return {**self.base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}

    def chunk(self, i: int, c: Any, reason: str | None) -> dict[str, Any] | bytes:
        if self.logprobs is None and reason is None:
            return self.content(i, c.text)
        lp = chat_logprobs(c.tokens, self.token_text) if self.logprobs is not None else None
        delta = {"content": c.text} if c.text or reason is None else {}
        return {**self.base, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}]}


class ParsedChatChunks(ChatChunks):
    """Chunks for choices whose text the request's :class:`~kiln.serving.output_parser.OutputParser` reads
    (one :class:`~kiln.serving.output_parser.OutputStream` per choice): with a reasoning parser,
    ``delta.reasoning_content`` while the reasoning span lasts (also when the prompt left it open), then
    the rest as content; with a tool parser, the content is read for calls: content deltas as the text
    arrives (a possible ``<tool_call>`` opening held back), ``delta.tool_calls`` as OpenAI sends
    them (a call's first piece with index, id, type and name, then its arguments in fragments as
    they are generated; one event per call per engine step), ``finish_reason: "tool_calls"`` when
    the choice called a tool."""

    def __init__(self, base: dict[str, Any], prompt_tokens: int, usage: bool, logprobs: int | None,
                 token_text: Callable[[int], str], output: OutputParser, n: int):
        super().__init__(base, prompt_tokens, usage, logprobs, token_text)
        self.streams = [output.stream() for _ in range(n)]
        self.reasoning = DeltaFrame(base, '"delta":{"reasoning_content":')

    def _event(self, i: int, delta: dict[str, Any], lp: dict[str, Any] | None = None,
               reason: str | None = None) -> bytes:
        return sse_frame({**self.base, "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                                    "finish_reason": reason}]})

    def chunk(self, i: int, c: Any, reason: str | None) -> bytes:
        stream = self.streams[i]
        thought, text, deltas = stream.feed(c.text, reason is not None)
        if reason is None and self.logprobs is None and not deltas and not (thought and text):
            if thought:  # the per-token path while reasoning, then while answering: pre-encoded frames
                return self.reasoning(i, thought)
            return self.content(i, text) if text else b""
        lp = chat_logprobs(c.tokens, self.token_text) if self.logprobs is not None else None
        frames = []
        if thought:
            frames.append(self._event(i, {"reasoning_content": thought}, lp))
            lp = None
        if text or lp is not None:
            frames.append(self._event(i, {"content": text} if text else {}, lp))
        frames.extend(self._event(i, {"tool_calls": [w]}) for w in _merged_calls(deltas))
        if reason is not None:
            frames.append(self._event(i, {}, None, "tool_calls" if stream.called and reason == "stop" else reason))
        return b"".join(frames)


def _merged_calls(deltas: list[CallDelta]) -> list[dict[str, Any]]:
    """Tool-call deltas in OpenAI's wire shape, a call's pieces from one step merged into one."""
    merged: list[dict[str, Any]] = []
    for d in deltas:
        if merged and merged[-1]["index"] == d.index and d.id is None:
            merged[-1]["function"]["arguments"] += d.arguments
            continue
        wire: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments}}
        if d.id is not None:
            wire = {"index": d.index, "id": d.id, "type": "function",
                    "function": {"name": d.name, "arguments": d.arguments}}
        merged.append(wire)
    return merged
