"""``POST /v1/chat/completions``: render the chat, submit it, answer in JSON or SSE.

Route code checks the messages and tools against the configured limits, renders the chat
template (big chats off the event loop) and tokenizes it, builds the sampling parameters
(:mod:`kiln.serving.request_params`), submits through :mod:`kiln.serving.generation` and
formats the output: a JSON response, or an SSE stream (:class:`ChatChunks`, or
:class:`ParsedChatChunks` when reasoning or tool calls are parsed out of the text).

Normally reached through :mod:`kiln.serving.fast_path`, which calls :func:`chat_response`
without going through FastAPI; the FastAPI route calls the same function.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from kiln.errors import InvalidRequest
from kiln.serving.fast_path import GenerationRoutes
from kiln.serving.generation import (
    LARGE_PROMPT_CHARS,
    StreamChunks,
    admitted,
    chat_logprobs,
    check_fits,
    check_limits,
    check_request,
    check_rows,
    collect,
    include_usage,
    max_tokens_for,
    request_id,
    resolve_model,
    revision_header,
    submit,
    usage_json,
)
from kiln.serving.openai_responses import ChatCompletionResponse
from kiln.serving.protocol import ChatCompletionRequest
from kiln.serving.reasoning import ReasoningParser, prompt_opens_span, with_thinking_budget
from kiln.serving.request_params import (
    check_tools,
    forces_call,
    reasoning_parser,
    sampling_params,
    thinking_budget,
    tool_parser,
    tools_on,
)
from kiln.serving.sse import DeltaFrame, SSEResponse, sse_frame
from kiln.serving.state import KilnState
from kiln.serving.tool_parsers import ToolParser

router = APIRouter()
routes = GenerationRoutes(router)


# -- the prompt -------------------------------------------------------------------------------


def check_messages(state, messages) -> None:
    lim = state.settings.limits
    if len(messages) > lim.max_messages:
        raise InvalidRequest(f"{len(messages)} messages exceed limits.max_messages="
                             f"{lim.max_messages}", code="limit_exceeded", param="messages",
                             hint="send fewer messages")


def _precheck_chat(state, data: Any) -> None:
    """The fast path's check of a chat body before validation: the message count (100,000 tiny
    messages once took 2 s of the event loop to validate and render before being refused)."""
    messages = data.get("messages") if isinstance(data, dict) else None
    if isinstance(messages, list):
        check_messages(state, messages)


def template_messages(messages) -> list[dict[str, Any]]:
    """Messages as chat templates take them: tool calls with their arguments as objects (as HF
    templates expect), tool results with their ``tool_call_id``."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def rendered_chars(wire_messages, messages: list[dict[str, Any]]) -> int:
    """Characters of every field the template renders (content, reasoning_content, tool-call names and
    arguments, tool_call_id): what decides whether rendering and tokenizing leave the event loop."""
    size = 0
    for wire, m in zip(wire_messages, messages):
        size += len(m["content"]) + len(m.get("reasoning_content") or "") + len(m.get("tool_call_id") or "")
        size += sum(len(c.function.name) + len(c.function.arguments) for c in wire.tool_calls or ())
    return size


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _template_tools(req) -> list[dict[str, Any]] | None:
    if not tools_on(req):
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


async def _render_chat(state, req: ChatCompletionRequest) -> list[int]:
    """The chat's prompt IDs: counts checked before rendering, the rendered text's size before
    tokenizing (a prompt certainly over the context is refused without being tokenized); big
    chats are rendered and tokenized off the event loop."""
    check_messages(state, req.messages)
    messages = template_messages(req.messages)
    size = rendered_chars(req.messages, messages)
    tools = _template_tools(req)
    engine = state.engine
    big = bool(tools) or bool(req.chat_template_kwargs) or size > LARGE_PROMPT_CHARS
    try:
        text = (await asyncio.to_thread(engine.render_chat, messages, tools, req.chat_template_kwargs) if big
                else engine.render_chat(messages))
    except Exception as exc:  # template errors (e.g. a role the template rejects) are the caller's input
        raise InvalidRequest(f"the chat template could not render these messages: {exc}", code="template_error",
                             hint="check message roles and order") from exc
    check_fits(state, text, "messages")
    return await asyncio.to_thread(engine.encode_text, text) if big else engine.encode_text(text)


# -- the route --------------------------------------------------------------------------------


@routes.post("/v1/chat/completions", ChatCompletionRequest, name="chat_completions",
             response_model=ChatCompletionResponse, precheck=_precheck_chat)
@admitted
async def chat_response(state: KilnState, body: ChatCompletionRequest, receive: Receive) -> Response:
    """The whole chat completion (JSON or SSE) for a validated request; ``receive`` reports a disconnect."""
    adapter = resolve_model(state, body.model)
    extra_headers = check_request(body)
    top = body.top_logprobs if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs=true", code="invalid_request", hint="set logprobs to true")
    logprobs = (top or 0) if body.logprobs else None
    check_limits(state, body, logprobs, body.stop_list())
    check_rows(state, body.n, f"n={body.n}", "n")
    check_tools(body)
    parser = tool_parser(state) if tools_on(body) else None
    forced = forces_call(body)
    reasoner = reasoning_parser(state)
    prompt = await _render_chat(state, body)
    engine = state.engine
    opened = reasoner is not None and prompt_opens_span(reasoner, engine, prompt)
    max_tokens = max_tokens_for(state, body.max_completion_tokens or body.max_tokens, len(prompt))
    params = with_thinking_budget(await sampling_params(state, body, max_tokens, logprobs), reasoner, opened,
                                  thinking_budget(state, body, reasoner), engine)
    sub = submit(state, prompt, params, adapter, body.stream)
    headers = {**revision_header(sub, adapter, state), **extra_headers}
    rid = f"chatcmpl-{request_id()}"
    created = int(time.time())
    timeout = state.settings.server.request_timeout_s
    tt = engine.token_text
    if body.stream:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                "system_fingerprint": state.system_fingerprint}
        if parser is not None or reasoner is not None:
            fmt: ChatChunks = ParsedChatChunks(base, len(prompt), include_usage(body), logprobs, tt,
                                               parser, reasoner, opened, body.n, forced)
        else:
            fmt = ChatChunks(base, len(prompt), include_usage(body), logprobs, tt)
        return SSEResponse.of(sub, timeout, fmt, headers)

    results = await collect(receive, sub, timeout)
    choices = []
    for i, (text, toks, reason) in enumerate(results):
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoner is not None:
            thought, text = reasoner.split(text, opened)
            message = {"role": "assistant", "content": text, "reasoning_content": thought}
        if parser is not None and forced:  # the grammar wrote only calls: a cut one keeps what it wrote
            _, calls = parser.parse_as_streamed(text or "")
            message = {**message, "content": None, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls] or None}
            reason = "tool_calls" if reason == "stop" else reason
        elif parser is not None:
            content, calls = parser.parse(text or "")
            if calls:
                message = {**message, "content": content, "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]}
                reason = "tool_calls" if reason == "stop" else reason
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(toks, tt) if logprobs is not None else None,
                        "finish_reason": reason})
    return JSONResponse({  # ChatCompletionResponse
        "id": rid, "object": "chat.completion", "created": created, "model": body.model,
        "system_fingerprint": state.system_fingerprint,
        "choices": choices,
        "usage": usage_json(len(prompt), sum(len(t) for _, t, _ in results)),
    }, headers=headers)


# -- the stream -------------------------------------------------------------------------------


class ChatChunks(StreamChunks):
    """A chat stream's chunks: the role chunk first, then content deltas (pre-encoded while there are
    no logprobs and no finish reason), the finish reason in the choice's last chunk."""

    def __init__(self, base: dict, prompt_tokens: int, usage: bool, logprobs: int | None,
                 token_text: Callable[[int], str]):
        super().__init__(base, prompt_tokens, usage)
        self.logprobs = logprobs
        self.token_text = token_text
        self.content = DeltaFrame(base, '"delta":{"content":')

    def first(self, i: int) -> dict:
        return {**self.base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}

    def chunk(self, i: int, c: Any, reason: str | None) -> dict | bytes:
        if self.logprobs is None and reason is None:
            return self.content(i, c.text)
        lp = chat_logprobs(c.tokens, self.token_text) if self.logprobs is not None else None
        delta = {"content": c.text} if c.text or reason is None else {}
        return {**self.base, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}]}


class ParsedChatChunks(ChatChunks):
    """Chunks for choices whose text is parsed for reasoning and/or tool calls: with ``reasoner``,
    ``delta.reasoning_content`` while the reasoning span lasts (``opened``: the prompt left it open), then
    the rest as content; with ``parser``, the content is read for calls: content deltas as the text
    arrives (a possible ``<tool_call>`` opening held back), ``delta.tool_calls`` as OpenAI sends
    them (a call's first piece with index, id, type and name, then its arguments in fragments as
    they are generated; one event per call per engine step), ``finish_reason: "tool_calls"`` when
    the choice called a tool."""

    def __init__(self, base: dict, prompt_tokens: int, usage: bool, logprobs: int | None,
                 token_text: Callable[[int], str], parser: ToolParser | None, reasoner: ReasoningParser | None,
                 opened: bool, n: int, forced: bool = False):
        super().__init__(base, prompt_tokens, usage, logprobs, token_text)
        self.forced = forced  # the grammar forces calls: the text between them is layout, never content
        self.states = [parser.stream() for _ in range(n)] if parser is not None else None
        self.splits = [reasoner.stream(opened) for _ in range(n)] if reasoner is not None else None
        self.reasoning = DeltaFrame(base, '"delta":{"reasoning_content":')

    def _event(self, i: int, delta: dict, lp: dict | None = None, reason: str | None = None) -> bytes:
        return sse_frame({**self.base, "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                                    "finish_reason": reason}]})

    def chunk(self, i: int, c: Any, reason: str | None) -> bytes:
        states, splits = self.states, self.splits
        thought, text = "", c.text
        if splits is not None:
            thought, text = splits[i].feed(text)
            if reason is not None:
                more_thought, tail = splits[i].finish()
                thought, text = thought + more_thought, text + tail
        deltas: list = []
        if states is not None:
            text, deltas = states[i].feed(text)
            if reason is not None:
                tail, more = states[i].finish()
                text, deltas = text + tail, deltas + more
            if self.forced:
                text = ""
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
            called = states is not None and states[i].calls
            frames.append(self._event(i, {}, None, "tool_calls" if called and reason == "stop" else reason))
        return b"".join(frames)


def _merged_calls(deltas: list) -> list[dict[str, Any]]:
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
