"""A generation request's prompts as token IDs, checked against the model before and after tokenizing.

A chat is rendered with the model's chat template (:func:`chat_prompt`; its message count is checked
first, before the body is even validated, by :func:`precheck_chat`); a completion's prompts are text
or token IDs (:func:`completion_prompt`). A text prompt whose characters alone prove it longer than the
context is refused before it is tokenized (:func:`check_fits`); big prompts are rendered and tokenized
off the event loop; token-ID prompts are checked against the vocabulary. ``/tokenize`` renders a chat
with the same template (:func:`chat_text`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Sequence

from kiln.errors import InvalidRequest
from kiln.serving.protocol import ChatCompletionRequest
from kiln.serving.state import KilnState

LARGE_PROMPT_CHARS = 20_000  # render/tokenize bigger prompts off the event loop


# -- checks against the model -------------------------------------------------------------------


def check_fits(state: KilnState, text: str, param: str) -> None:
    """Refuse a prompt whose text alone proves it longer than the context, before tokenizing it."""
    limit = state.engine.config.max_model_len
    least = state.engine.too_long(text, limit)
    if least is not None:
        raise InvalidRequest(f"the prompt has at least {least} tokens ({len(text)} characters); the model's limit is "
                             f"{limit}", code="context_length_exceeded", param=param, hint="shorten the prompt")


# -- a chat ---------------------------------------------------------------------------------------


def check_messages(state: KilnState, messages: Sequence[Any]) -> None:
    lim = state.settings.limits
    if len(messages) > lim.max_messages:
        raise InvalidRequest(f"{len(messages)} messages exceed limits.max_messages="
                             f"{lim.max_messages}", code="limit_exceeded", param="messages",
                             hint="send fewer messages")


def precheck_chat(state: KilnState, data: Any) -> None:
    """The fast path's check of a chat body before validation: the message count (100,000 tiny
    messages once took 2 s of the event loop to validate and render before being refused)."""
    messages = data.get("messages") if isinstance(data, dict) else None
    if isinstance(messages, list):
        check_messages(state, messages)


def template_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
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


def rendered_chars(wire_messages: Sequence[Any], messages: list[dict[str, Any]]) -> int:
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


def _template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not req.tools_on() or req.tools is None:  # tools_on() implies tools
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


async def chat_prompt(state: KilnState, req: ChatCompletionRequest) -> list[int]:
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


async def chat_text(state: KilnState, messages_in: Sequence[Any], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat template's text, rendered off the event loop (``/tokenize``); template errors are the caller's
    input."""
    check_messages(state, messages_in)
    try:
        return await asyncio.to_thread(state.engine.render_chat, template_messages(messages_in), tools,
                                       template_kwargs, add_generation_prompt)
    except Exception as exc:
        raise InvalidRequest(f"the chat template could not render these messages: {exc}", code="template_error",
                             param="messages", hint="check message roles and order") from exc


# -- completion prompts -----------------------------------------------------------------------------


def prompt_list(body: Any) -> list[str | list[int]]:
    """The request's prompts: one string or token-ID list, or a list of either."""
    p = body.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]
    return list(p)


async def completion_prompt(state: KilnState, prompt: str | list[int], param: str) -> list[int]:
    """One prompt's token IDs (``param`` names it in a refusal); a long text prompt is checked, then
    tokenized off the event loop."""
    if isinstance(prompt, str) and len(prompt) > LARGE_PROMPT_CHARS:
        return await asyncio.to_thread(_prompt_ids, state, prompt, param)
    return _prompt_ids(state, prompt, param)


def _prompt_ids(state: KilnState, prompt: str | list[int], param: str) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("the prompt is empty", code="invalid_request", param=param,
                                 hint="send a non-empty prompt")
        check_fits(state, prompt, param)
        return state.engine.encode_text(prompt)
    vocab = state.engine.vocab_size
    bad = state.engine.first_out_of_vocab(prompt)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (size {vocab})", code="invalid_token_id",
                             param=param, hint=f"token ids must be in [0, {vocab})")
    return list(prompt)
