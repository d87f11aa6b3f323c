"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Route code validates against the configured limits, renders and tokenizes the
prompt, resolves ``model`` to the base model or a live adapter, submits rows to
the engine and turns the engine's per-choice output into JSON or SSE. A client
disconnect (or the request timeout) cancels the rows.

The two generation routes are normally reached through :mod:`kiln.serving.fast_path`
(``FAST_ROUTES``), which calls ``chat_response``/``completion_response`` without going
through FastAPI; the FastAPI routes call the same functions.

Every generation response carries ``x-kiln-adapter-revision``: the adapter
revision the request was admitted with, or ``base`` for the base model.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import json
import logging
import secrets
import time
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response
from starlette.types import Receive

from kiln.adapters.manifest import ADAPTER_REVISION_HEADER as ADAPTER_HEADER
from kiln.errors import ClientClosed, Internal, InvalidRequest, NotFound, Unavailable
from kiln.runtime.constrained import GrammarCompiler, GrammarTooComplex
from kiln.serving.default_adapter import BARE_BASE_SUFFIX, adapter_for_base
from kiln.runtime.engine import Submission, UnknownAdapter
from kiln.runtime.submission import Admission
from kiln.runtime.sampling import SamplingParams, TokenChoice
from kiln.runtime.scoring import PromptLogprobRow
from kiln.serving.eager import start_eagerly
from kiln.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    IGNORED_FIELDS_HEADER,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ModelPermission,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from kiln.serving.state import KilnState, get_state
from kiln.serving.reasoning import ReasoningParser, prompt_opens_span, reasoning_parser_for, with_thinking_budget
from kiln.serving.tool_parsers import ToolParser, tool_parser_for

router = APIRouter()
log = logging.getLogger(__name__)

BASE_REVISION = "base"
LARGE_PROMPT_CHARS = 20_000  # render/tokenize bigger prompts off the event loop
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# -- shared helpers -----------------------------------------------------------------------


def _state(request: Request) -> KilnState:
    return get_state(request)


def _resolve_model(state, model: str) -> str | None:
    """``None`` for the bare base model, else the adapter name; unknown -> 404. The base model's ID
    gets the server default adapter while it serves its pinned revision; ``<base>@base`` never does."""
    if model == state.model_id:
        return adapter_for_base(state)
    if model == state.model_id + BARE_BASE_SUFFIX:
        return None
    if model in state.engine.active_adapters():
        return model
    raise _unknown_model(state, f"model {model!r} does not exist")


def _unknown_model(state, message: str) -> NotFound:
    known = [state.model_id, state.model_id + BARE_BASE_SUFFIX, *state.engine.active_adapters()]
    return NotFound(message, code="model_not_found", param="model",
                    hint=f"use one of {known} (GET /v1/models lists them)")


def _check_limits(state, req, logprobs: int | None, stop: tuple[str, ...]) -> None:
    lim = state.settings.limits
    if req.n > lim.max_n:
        raise InvalidRequest(f"n={req.n} exceeds limits.max_n={lim.max_n}", code="limit_exceeded", hint="lower n")
    if len(stop) > lim.max_stop_sequences:
        raise InvalidRequest(f"{len(stop)} stop sequences exceed limits.max_stop_sequences={lim.max_stop_sequences}", code="limit_exceeded", hint="send fewer stop sequences")
    if logprobs is not None and logprobs > lim.max_logprobs:
        raise InvalidRequest(f"{logprobs} logprobs exceed limits.max_logprobs={lim.max_logprobs}", code="limit_exceeded", hint="ask for fewer logprobs")


def _max_tokens(state, requested: int | None, prompt_len: int) -> int:
    lim = state.settings.limits
    model_len = state.engine.config.max_model_len  # min(limits.max_model_len, the model's own limit)
    room = model_len - prompt_len
    if room <= 0:
        raise InvalidRequest(f"the prompt has {prompt_len} tokens; the model's limit is {model_len}",
                             code="context_length_exceeded", hint="shorten the prompt")
    if requested is None:
        return min(lim.default_max_tokens, room)
    if requested > lim.max_tokens_cap:
        raise InvalidRequest(f"max_tokens={requested} exceeds limits.max_tokens_cap={lim.max_tokens_cap}",
                             code="limit_exceeded", param="max_tokens", hint="lower max_tokens")
    if requested > room:
        raise InvalidRequest(f"prompt ({prompt_len} tokens) plus max_tokens ({requested}) exceeds the model's limit of "
                             f"{model_len} tokens", code="context_length_exceeded", param="max_tokens",
                             hint="shorten the prompt or lower max_tokens")
    return requested


def _token_ids(state, ids, param: str) -> None:
    vocab = state.engine.vocab_size
    bad = state.engine.tokens.first_out_of_vocab(ids)
    if bad is not None:
        raise InvalidRequest(f"{param}: token id {bad} is outside the vocabulary (size {vocab})",
                             code="invalid_token_id", param=param, hint=f"token ids must be in [0, {vocab})")


def _controls(state, req, max_tokens: int) -> dict[str, Any]:
    """The sampling controls beyond temperature/top-p/top-k, checked against the vocabulary."""
    out: dict[str, Any] = {}
    if req.presence_penalty:
        out["presence_penalty"] = req.presence_penalty
    if req.frequency_penalty:
        out["frequency_penalty"] = req.frequency_penalty
    if req.repetition_penalty != 1.0:
        out["repetition_penalty"] = req.repetition_penalty
    if req.min_p:
        out["min_p"] = req.min_p
    if req.logit_bias:
        bias = tuple(sorted((int(k), float(v)) for k, v in req.logit_bias.items()))
        _token_ids(state, [t for t, _ in bias], "logit_bias")
        out["logit_bias"] = bias
    if req.min_tokens:
        if req.min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens={req.min_tokens} exceeds max_tokens={max_tokens}",
                                 code="invalid_request", param="min_tokens", hint="lower min_tokens")
        out["min_tokens"] = req.min_tokens
    if req.stop_token_ids:
        _token_ids(state, req.stop_token_ids, "stop_token_ids")
        out["stop_token_ids"] = frozenset(req.stop_token_ids)
    if req.bad_words:
        words: set[tuple[int, ...]] = set()
        for w in req.bad_words:  # as vLLM: the word as tokenized alone and after a space
            for variant in (w, " " + w.lstrip(" ")):
                ids = state.engine.encode_text(variant)
                if ids:
                    words.add(tuple(ids))
        out["bad_words"] = tuple(sorted(words))
    return out


def _grammar_compiler(state) -> GrammarCompiler:
    """One compiler per served model, built on first use (route-module cache in ``state.extras``)."""
    comp = state.extras.get("grammar_compiler")
    if comp is None:
        tokens = state.engine.tokens
        config = getattr(state.model.model, "config", None)
        vocab = max(int(getattr(config, "vocab_size", 0) or 0), tokens.vocab_size)
        lim = state.settings.limits
        comp = state.extras["grammar_compiler"] = GrammarCompiler(
            tokens.tokenizer, vocab, tokens.eos_ids, timeout_s=lim.grammar_compile_timeout_s,
            cache_bytes=lim.grammar_cache_mib << 20)
        comp.observer = state.metrics.grammar_compile  # /metrics kiln_grammar_compile_seconds{outcome}
    return comp


def _grammar(state, req) -> tuple[Callable[[], str], str] | None:
    """The request's structured-output grammar (``response_format`` or vLLM's ``guided_*``): a builder of
    its grammar text (run on the compile thread by :meth:`GrammarCompiler.compile`) and the field it came from."""
    rf = req.response_format
    forced = _forced_tools(req)
    asked = [name for name, v in (("response_format", rf if rf is not None and rf.type != "text" else None),
                                  ("guided_json", req.guided_json), ("guided_regex", req.guided_regex),
                                  ("guided_choice", req.guided_choice), ("tool_choice", forced)) if v is not None]
    if not asked:
        return None
    if len(asked) > 1:
        raise InvalidRequest(f"{' and '.join(asked)} both constrain the output; send one", code="invalid_request",
                             param=asked[1], hint="keep one of response_format, guided_json, guided_regex, "
                                                  "guided_choice")
    if req.min_tokens:
        raise InvalidRequest("min_tokens cannot be combined with a structured-output constraint (the grammar decides "
                             "where the output ends)", code="invalid_request", param="min_tokens",
                             hint="drop min_tokens")
    comp = _grammar_compiler(state)
    if asked[0] == "tool_choice":
        tools, parallel = forced
        parser = _tool_parser(state)
        return (lambda: comp.lark(parser.forcing_grammar(tools, parallel), "tool_choice")), "tool_choice"
    if asked[0] == "response_format":
        schema = rf.json_schema.schema_ if rf.type == "json_schema" else None
        return (lambda: comp.json_schema(schema, "response_format")), "response_format"
    if asked[0] == "guided_json":
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequest(f"guided_json is not JSON: {exc}", code="invalid_schema", param="guided_json",
                                     hint="send the schema as an object or as JSON text") from exc
        return (lambda: comp.json_schema(schema, "guided_json")), "guided_json"
    if asked[0] == "guided_regex":
        return (lambda: comp.regex(req.guided_regex, "guided_regex")), "guided_regex"
    return (lambda: comp.choice(req.guided_choice, "guided_choice")), "guided_choice"


def _tool_parser(state) -> ToolParser:
    """The tool-call parser ``serving.tool_call_parser`` selects (``auto``: by the chat template's family)."""
    parser = state.extras.get("tool_parser")
    if parser is None:
        tok = state.engine.tokens.tokenizer
        template = getattr(tok, "chat_template", None)
        parser = state.extras["tool_parser"] = tool_parser_for(state.settings.serving.tool_call_parser,
                                                               template if isinstance(template, str) else None, tok)
    return parser


def _reasoning_parser(state) -> ReasoningParser | None:
    """The reasoning parser ``serving.reasoning_parser`` selects (``auto``: by the chat template's family)."""
    if "reasoning_parser" not in state.extras:
        template = getattr(state.engine.tokens.tokenizer, "chat_template", None)
        state.extras["reasoning_parser"] = reasoning_parser_for(state.settings.serving.reasoning_parser,
                                                                template if isinstance(template, str) else None)
    return state.extras["reasoning_parser"]


def _thinking_budget(state, req, reasoner: ReasoningParser | None) -> int | None:
    """The request's ``thinking_token_budget`` (omitted: the server default; ``None``: unlimited)."""
    if "thinking_token_budget" not in req.model_fields_set:
        return state.settings.serving.thinking_token_budget if reasoner is not None else None
    if req.thinking_token_budget is not None and reasoner is None:
        raise InvalidRequest("thinking_token_budget needs a reasoning parser, and this server has none for its "
                             "chat template", code="invalid_request", param="thinking_token_budget",
                             hint="drop thinking_token_budget, or start the server with --reasoning-parser")
    return req.thinking_token_budget


def _tools_on(req) -> bool:
    return bool(getattr(req, "tools", None)) and req.tool_choice != "none"


def _forced_tools(req) -> tuple[list[dict[str, Any]], bool] | None:
    """``(tools, parallel)`` a ``required`` or named ``tool_choice`` forces, else ``None``."""
    choice = getattr(req, "tool_choice", None)
    if choice is None or choice in ("none", "auto"):
        return None
    tools = [{"name": t.function.name, "parameters": t.function.parameters} for t in req.tools or ()]
    if choice == "required":
        return tools, req.parallel_tool_calls is not False
    named = [t for t in tools if t["name"] == choice.function.name]
    if not named:
        raise InvalidRequest(f"tool_choice names {choice.function.name!r}, which is not in tools",
                             code="invalid_request", param="tool_choice",
                             hint=f"name one of {[t['name'] for t in tools]}")
    return named, False


def _check_tools(req) -> None:
    if req.tool_choice is not None and req.tool_choice != "none" and not req.tools:
        raise InvalidRequest("tool_choice needs tools", code="invalid_request", param="tool_choice",
                             hint="send the tools the model may call, or drop tool_choice")
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise InvalidRequest("two tools share a name", code="invalid_request", param="tools",
                             hint="give every function a distinct name")


async def _params(state, req, max_tokens: int, logprobs: int | None,
                  count: int | None = None) -> list[SamplingParams]:
    """``count`` rows (default ``n``); each gets its own grammar state when the output is constrained
    (the grammar compiled off the event loop, under the compiler's limits and deadline)."""
    top_k = 0 if req.top_k in (-1, 0) else req.top_k
    extra = _controls(state, req, max_tokens)
    asked = _grammar(state, req)
    compiled = None if asked is None else await _grammar_compiler(state).compile(*asked)
    return [
        SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=top_k,
            seed=None if req.seed is None else (req.seed + i) % (2**63), stop=req.stop_list(),
            logprobs=logprobs, ignore_eos=req.ignore_eos, **extra,
            constraint=compiled.row() if compiled is not None else None,
        )
        for i in range(req.n if count is None else count)
    ]


_ADMISSION: contextvars.ContextVar[Admission | None] = contextvars.ContextVar("kiln_admission", default=None)


def _admitted(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Run a generation handler as an engine admission (``Engine.admission``) until its first
    submission, or its end: an engine waking from idle waits for requests still being parsed
    and rendered, so a burst shares one first prefill. The handler first yields once, so the
    requests the loop read together all open their admissions before the first one submits."""

    @functools.wraps(handler)
    async def run(state: KilnState, body: Any, receive: Receive) -> Response:
        admission = state.engine.admission()
        token = _ADMISSION.set(admission)
        try:
            await asyncio.sleep(0)
            return await handler(state, body, receive)
        finally:
            admission.end()
            _ADMISSION.reset(token)

    return run


def _admission_over() -> None:
    """The current request reached the engine: its admission ends."""
    admission = _ADMISSION.get()
    if admission is not None:
        admission.end()


def _submit(state: KilnState, prompt_ids: list[int], params: list[SamplingParams], adapter: str | None,
            stream: bool) -> Submission:
    try:
        sub = state.engine.submit(prompt_ids, params, adapter=adapter, loop=asyncio.get_running_loop(),
                                  incremental=stream)
    except UnknownAdapter as exc:  # unloaded between resolution and admission
        raise _unknown_model(state, str(exc)) from exc
    _admission_over()
    state.metrics.prompt_tokens.inc(len(prompt_ids))
    return sub


_WARNED_IGNORED: set[str] = set()


def _check_request(body) -> dict[str, str]:
    """Refusals shared by both generation routes, and the header naming ignored OpenAI fields
    (each field is logged once per process at warning level)."""
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed with stream=true", code="invalid_request",
                             param="stream_options", hint="drop stream_options or set stream to true")
    ignored = body.ignored_fields()
    if not ignored:
        return {}
    new = [f for f in ignored if f not in _WARNED_IGNORED]
    if new:
        _WARNED_IGNORED.update(new)
        log.warning("accepted and ignored OpenAI request fields %s (they change nothing on a self-hosted model; "
                    "responses name them in %s)", new, IGNORED_FIELDS_HEADER)
    return {IGNORED_FIELDS_HEADER: ",".join(ignored)}


def _revision_header(sub: Submission | None, adapter: str | None, state) -> dict[str, str]:
    if adapter is None:
        return {ADAPTER_HEADER: BASE_REVISION}
    rev = sub.adapter_revision if sub is not None else state.engine.active_adapters().get(adapter)
    return {ADAPTER_HEADER: rev or BASE_REVISION}


async def _await_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _collect(receive: Receive, sub: Submission, timeout_s: float) -> list[tuple[str, list[TokenChoice], str]]:
    """Run a submission to the end; cancels it on disconnect or timeout."""
    texts: dict[int, list[str]] = {s.index: [] for s in sub.streams}
    toks: dict[int, list[TokenChoice]] = {s.index: [] for s in sub.streams}
    reasons: dict[int, str] = {}

    async def drain() -> None:
        while True:
            chunks = await sub.next_chunks()
            if not chunks:
                return
            for i, c in chunks:
                texts[i].append(c.text)
                toks[i].extend(c.tokens)
                if c.finish_reason is not None:
                    reasons[i] = c.finish_reason

    await _until_done(receive, asyncio.ensure_future(drain()), sub.cancel, timeout_s, "the request",
                      "lower max_tokens or raise server.request_timeout_s")
    _raise_on_engine_error(reasons.values())
    return [("".join(texts[i]), toks[i], reasons[i]) for i in sorted(texts)]


async def _until_done(receive: Receive, work: asyncio.Future, cancel: Callable[[], None], timeout_s: float,
                      what: str, hint: str) -> Any:
    """``work``'s result; on a disconnect or after ``timeout_s`` cancel it (and the engine's rows) and raise."""
    watch = asyncio.ensure_future(_await_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work, watch}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work not in done:
        work.cancel()
        cancel()
        if watch in done:
            raise ClientClosed("the client disconnected", code="client_closed")
        raise Unavailable(f"{what} did not finish within {timeout_s} s", code="request_timeout", hint=hint)
    return work.result()


def _raise_on_engine_error(reasons) -> None:
    if "grammar_error" in reasons:
        raise GrammarTooComplex("the grammar engine gave up during generation (a resource limit of the grammar); "
                                "no valid output could be completed", None)
    if "error" in reasons:
        raise Internal("the engine failed while generating", code="engine_error", hint="see the server log; GET /health")
    if "abort" in reasons:
        raise Unavailable("generation was aborted (the server is shutting down)", code="engine_unavailable", hint="retry against a running server")


def _token_text(state) -> Callable[[int], str]:
    """Token id -> its text (logprob entries name tokens by text), from the engine's tokenization."""
    return state.engine.token_text


# Responses are built as plain dicts in the field order of the models in kiln.serving.protocol
# (which document them in the OpenAPI schema): constructing and dumping pydantic models
# costs more event-loop time per request than the rest of the response path.


def _top_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _chat_logprobs(tokens: list[TokenChoice], tt: Callable[[int], str]) -> dict:
    """``ChatLogprobs``."""
    return {"content": [
        {**_top_entry(tt(t.token_id), t.logprob), "top_logprobs": [_top_entry(tt(i), lp) for i, lp in t.top]}
        for t in tokens
    ]}


def _completion_logprobs(tokens: list[TokenChoice], tt: Callable[[int], str], offset: int = 0) -> dict:
    """``CompletionLogprobs``."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        s = tt(t.token_id)
        out["tokens"].append(s)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({tt(i): lp for i, lp in t.top})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


_ID_PREFIX = secrets.token_hex(8)  # per process; a counter makes each ID unique without a syscall
_ID_COUNTER = itertools.count()


def _request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


def _sse(obj: Any) -> bytes:
    return b"data: " + _json(obj).encode() + b"\n\n"


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class _DeltaFrame:
    """Pre-encoded SSE frame around one choice's text delta: the per-token hot path
    formats only the index and the text instead of re-encoding the whole chunk."""

    def __init__(self, base: dict, key: str):
        head = _json({**base, "choices": [{"index": 0}]})
        self._head = head[: head.rindex('{"index":0}')] + '{"index":'
        self._key = key  # '"delta":{"content":' for chat, '"text":' for completions
        self._tail = ("}" if key.startswith('"delta"') else "") + ',"logprobs":null,"finish_reason":null}]}\n\n'

    def __call__(self, index: int, text: str) -> bytes:
        return f"data: {self._head}{index},{self._key}{_json(text)}{self._tail}".encode()


class _SSEResponse(StreamingResponse):
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

    def __init__(self, sub: Submission, timeout_s: float,
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

    async def __call__(self, scope, receive, send) -> None:
        sub = self._sub
        watch = asyncio.ensure_future(_cancel_on_disconnect(receive, sub))
        self._send, self._ended = send, asyncio.get_running_loop().create_future()
        parts = self._parts
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if self._first is not None:  # the role chunk goes out with the first tokens, as vLLM sends it, so a
                # client's time to first chunk is the time to the first token
                parts.extend(_sse(self._first(s.index)) for s in sub.streams)
            try:
                async with asyncio.timeout(self._timeout):
                    sub.on_output(self._pump)
                    self._pump()  # output of the steps before this response started
                    await self._ended  # the pump ends it only with no write in flight
            except TimeoutError:
                parts.append(_sse({"error": {"code": "request_timeout",
                                             "message": f"no completion within {self._timeout} s",
                                             "hint": "lower max_tokens or raise server.request_timeout_s"}}))
            finally:
                sub.on_output(None)
                if self._writing is not None and not self._writing.done():
                    self._writing.cancel()  # still waiting on flow control, so nothing of it was written
                    await asyncio.wait([self._writing])  # ended before the final write starts
            if self._usage is not None:
                parts.append(_sse(self._usage(self._completion_tokens)))
            parts.append(b"data: [DONE]\n\n")
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
                    parts.append(_sse({"error": {"code": "grammar_too_complex", "param": None, "message":
                                                 "the grammar engine gave up during generation (a resource limit "
                                                 "of the grammar); this choice is incomplete"}}))
                    reason = "error"
                if c.text or c.tokens or reason is not None:
                    frame = self._make_chunk(index, c, reason)
                    parts.append(frame if isinstance(frame, bytes) else _sse(frame))
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
        elif task.exception() is not None:
            if not ended.done():
                ended.set_exception(task.exception())
        else:
            self._pump()


async def _no_body():  # placeholder body iterator: _SSEResponse writes its own body
    yield b""


_NO_BODY = _no_body()


async def _cancel_on_disconnect(receive: Receive, sub: Submission) -> None:
    await _await_disconnect(receive)
    sub.cancel()


# -- endpoints -------------------------------------------------------------------------------


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    created = int(state.started_at)
    limit = state.engine.config.max_model_len
    def perm(model_id: str) -> list[ModelPermission]:
        return [ModelPermission(id=f"modelperm-{model_id}", created=created)]

    family = getattr(state.model, "family", None)
    cards = [ModelCard(id=state.model_id, created=created, root=state.model_id, max_model_len=limit,
                       base_model_sha256=state.model.base_model_sha256, permission=perm(state.model_id),
                       model_family=family.as_dict() if family is not None else None)]
    for name, rev in state.engine.active_adapters().items():
        cards.append(ModelCard(id=name, created=created, root=name, parent=state.model_id, max_model_len=limit,
                               base_model_sha256=state.model.base_model_sha256, revision=rev, permission=perm(name)))
    return ModelList(data=cards)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request) -> TokenizeResponse:
    """vLLM's ``/tokenize``: a prompt's (or rendered chat's) token IDs, as generation would see them."""
    state = _state(request)
    if body.model is not None:
        _resolve_model(state, body.model)
    tok = state.engine.tokens.tokenizer
    if isinstance(body, TokenizeChatRequest):
        text = await _render_chat_text(state, body.messages, body.add_generation_prompt,
                                       [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                                       body.chat_template_kwargs)
    else:
        text = body.prompt
    ids = await asyncio.to_thread(lambda: list(tok(text, add_special_tokens=body.add_special_tokens)["input_ids"]))
    strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.engine.config.max_model_len, tokens=ids,
                            token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """vLLM's ``/detokenize``: token IDs back to text."""
    state = _state(request)
    if body.model is not None:
        _resolve_model(state, body.model)
    _token_ids(state, body.tokens, "tokens")
    return DetokenizeResponse(prompt=await asyncio.to_thread(state.engine.tokens.decode, list(body.tokens)))


async def _render_chat_text(state, messages_in, add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat template's text (``/tokenize``); template errors are the caller's input."""
    _check_messages(state, messages_in)
    messages = _template_messages(messages_in)
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    try:
        return await asyncio.to_thread(state.engine.tokens.tokenizer.apply_chat_template, messages, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, **extra)
    except Exception as exc:
        raise InvalidRequest(f"the chat template could not render these messages: {exc}", code="template_error",
                             param="messages", hint="check message roles and order") from exc


def _check_messages(state, messages) -> None:
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
        _check_messages(state, messages)


def _template_messages(messages) -> list[dict[str, Any]]:
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


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _template_tools(req) -> list[dict[str, Any]] | None:
    if not _tools_on(req):
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


async def _render_chat(state, req: ChatCompletionRequest) -> list[int]:
    """The chat's prompt IDs: counts checked before rendering, the rendered text's size before
    tokenizing (a prompt certainly over the context is refused without being tokenized); big
    chats are rendered and tokenized off the event loop."""
    _check_messages(state, req.messages)
    messages = _template_messages(req.messages)
    size = sum(len(m["content"]) for m in messages)
    tools = _template_tools(req)
    tokens = state.engine.tokens
    big = bool(tools) or bool(req.chat_template_kwargs) or size > LARGE_PROMPT_CHARS
    try:
        text = (await asyncio.to_thread(tokens.render_chat, messages, tools, req.chat_template_kwargs) if big
                else tokens.render_chat(messages))
    except Exception as exc:  # template errors (e.g. a role the template rejects) are the caller's input
        raise InvalidRequest(f"the chat template could not render these messages: {exc}", code="template_error", hint="check message roles and order") from exc
    _check_fits(state, text, "messages")
    return await asyncio.to_thread(tokens.encode_text, text) if big else tokens.encode_text(text)


def _check_fits(state, text: str, param: str) -> None:
    """Refuse a prompt whose text alone proves it longer than the context, before tokenizing it."""
    limit = state.engine.config.max_model_len
    least = state.engine.tokens.too_long(text, limit)
    if least is not None:
        raise InvalidRequest(f"the prompt has at least {least} tokens ({len(text)} characters); the model's limit is "
                             f"{limit}", code="context_length_exceeded", param=param, hint="shorten the prompt")


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await chat_response(_state(request), body, request.receive)


@_admitted
async def chat_response(state: KilnState, body: ChatCompletionRequest, receive: Receive) -> Response:
    """The whole chat completion (JSON or SSE) for a validated request; ``receive`` reports a disconnect."""
    adapter = _resolve_model(state, body.model)
    extra_headers = _check_request(body)
    top = body.top_logprobs if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs=true", code="invalid_request", hint="set logprobs to true")
    logprobs = (top or 0) if body.logprobs else None
    _check_limits(state, body, logprobs, body.stop_list())
    _check_tools(body)
    parser = _tool_parser(state) if _tools_on(body) else None
    reasoner = _reasoning_parser(state)
    prompt = await _render_chat(state, body)
    opened = reasoner is not None and prompt_opens_span(reasoner, state.engine.tokens, prompt)
    max_tokens = _max_tokens(state, body.max_completion_tokens or body.max_tokens, len(prompt))
    params = with_thinking_budget(await _params(state, body, max_tokens, logprobs), reasoner, opened,
                                  _thinking_budget(state, body, reasoner), state.engine.tokens)
    sub = _submit(state, prompt, params, adapter, body.stream)
    headers = {**_revision_header(sub, adapter, state), **extra_headers}
    rid = f"chatcmpl-{_request_id()}"
    created = int(time.time())
    timeout = state.settings.server.request_timeout_s
    tt = _token_text(state)
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
            "system_fingerprint": state.system_fingerprint}

    if body.stream:
        def first(i: int) -> dict:
            return {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]}

        fast = _DeltaFrame(base, '"delta":{"content":')

        def chunk(i: int, c, reason: str | None) -> dict | bytes:
            if logprobs is None and reason is None:
                return fast(i, c.text)
            lp = _chat_logprobs(c.tokens, tt) if logprobs is not None else None
            delta = {"content": c.text} if c.text or reason is None else {}
            return {**base, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}]}

        if parser is not None or reasoner is not None:
            chunk = _parsed_chunks(parser, reasoner, opened, base, logprobs, tt, body.n)

        usage = None
        if body.stream_options is not None and body.stream_options.include_usage:
            def usage(done: int) -> dict:
                return {**base, "choices": [], "usage": _usage(len(prompt), done)}
        return _SSEResponse(sub, timeout, chunk, first, usage, {**SSE_HEADERS, **headers})

    results = await _collect(receive, sub, timeout)
    choices = []
    for i, (text, toks, reason) in enumerate(results):
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoner is not None:
            thought, text = reasoner.split(text, opened)
            message = {"role": "assistant", "content": text, "reasoning_content": thought}
        if parser is not None:
            content, calls = parser.parse(text or "")
            if calls:
                message = {**message, "content": content, "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]}
                reason = "tool_calls" if reason == "stop" else reason
        choices.append({"index": i, "message": message,
                        "logprobs": _chat_logprobs(toks, tt) if logprobs is not None else None,
                        "finish_reason": reason})
    return JSONResponse({  # ChatCompletionResponse
        "id": rid, "object": "chat.completion", "created": created, "model": body.model,
        "system_fingerprint": state.system_fingerprint,
        "choices": choices,
        "usage": _usage(len(prompt), sum(len(t) for _, t, _ in results)),
    }, headers=headers)


def _parsed_chunks(parser: ToolParser | None, reasoner: ReasoningParser | None, opened: bool, base: dict,
                   logprobs: int | None, tt: Callable[[int], str], n: int) -> Callable[[int, Any, str | None], bytes]:
    """Stream chunks for choices whose text is parsed for reasoning and/or tool calls: with ``reasoner``,
    ``delta.reasoning_content`` while the reasoning span lasts (``opened``: the prompt left it open), then
    the rest as content; with ``parser``, the content is read for calls: content deltas as the text
    arrives (a possible ``<tool_call>`` opening held back), ``delta.tool_calls`` as OpenAI sends
    them (a call's first piece with index, id, type and name, then its arguments in fragments as
    they are generated; one event per call per engine step), ``finish_reason: "tool_calls"`` when
    the choice called a tool."""
    states = [parser.stream() for _ in range(n)] if parser is not None else None
    splits = [reasoner.stream(opened) for _ in range(n)] if reasoner is not None else None
    fast_content = _DeltaFrame(base, '"delta":{"content":')
    fast_reasoning = _DeltaFrame(base, '"delta":{"reasoning_content":')

    def event(i: int, delta: dict, lp: dict | None = None, reason: str | None = None) -> bytes:
        return _sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}]})

    def chunk(i: int, c, reason: str | None) -> bytes:
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
        if reason is None and logprobs is None and not deltas and not (thought and text):
            if thought:  # the per-token path while reasoning, then while answering: pre-encoded frames
                return fast_reasoning(i, thought)
            return fast_content(i, text) if text else b""
        lp = _chat_logprobs(c.tokens, tt) if logprobs is not None else None
        frames = []
        if thought:
            frames.append(event(i, {"reasoning_content": thought}, lp))
            lp = None
        if text or lp is not None:
            frames.append(event(i, {"content": text} if text else {}, lp))
        merged: list[dict] = []
        for d in deltas:  # a call's pieces from one step go out as one event
            if merged and merged[-1]["index"] == d.index and d.id is None:
                merged[-1]["function"]["arguments"] += d.arguments
                continue
            wire: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments}}
            if d.id is not None:
                wire = {"index": d.index, "id": d.id, "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}}
            merged.append(wire)
        frames.extend(event(i, {"tool_calls": [w]}) for w in merged)
        if reason is not None:
            called = states is not None and states[i].calls
            frames.append(event(i, {}, None, "tool_calls" if called and reason == "stop" else reason))
        return b"".join(frames)

    return chunk


def _prompt_list(body: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one string or token-ID list, or a list of either."""
    p = body.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]
    return list(p)


def _prompt_ids(state, prompt: str | list[int], param: str = "prompt") -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("the prompt is empty", code="invalid_request", param=param,
                                 hint="send a non-empty prompt")
        _check_fits(state, prompt, param)
        return state.engine.encode_text(prompt)
    vocab = state.engine.vocab_size
    bad = state.engine.tokens.first_out_of_vocab(prompt)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (size {vocab})", code="invalid_token_id",
                             param=param, hint=f"token ids must be in [0, {vocab})")
    return list(prompt)


def _prompt_logprobs_json(rows: list[PromptLogprobRow | None], tt: Callable[[int], str]) -> list[dict[str, dict] | None]:
    """One ``{token id: PromptLogprob}`` per prompt position (``None`` first)."""
    return [
        None if row is None else {
            str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": tt(e.token_id)} for e in row
        }
        for row in rows
    ]


def _echo_logprobs(prompt: list[int], rows: list[PromptLogprobRow | None], k: int, tt: Callable[[int], str]) -> dict:
    """``CompletionLogprobs`` of the prompt itself (``echo`` with ``logprobs``): the first token has none."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for tid, row in zip(prompt, rows):
        s = tt(tid)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if row is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(row[0].logprob)  # the actual token comes first
        out["top_logprobs"].append({tt(e.token_id): e.logprob for e in _top_entries(row, k)})
    return out


def _join_logprobs(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    shift = sum(len(t) for t in a["tokens"])
    return {"tokens": a["tokens"] + b["tokens"], "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
            "top_logprobs": a["top_logprobs"] + b["top_logprobs"],
            "text_offset": a["text_offset"] + [o + shift for o in b["text_offset"]]}


async def _score(state, prompt: list[int], k: int, adapter: str | None, receive: Receive,
                 timeout: float) -> list[PromptLogprobRow | None]:
    try:
        fut = state.engine.score_prompt(prompt, k, adapter=adapter)
    except UnknownAdapter as exc:  # unloaded between resolution and admission
        raise _unknown_model(state, str(exc)) from exc
    _admission_over()
    return await _until_done(receive, asyncio.wrap_future(fut), fut.cancel, timeout, "scoring",
                             "score a shorter prompt or raise server.request_timeout_s")


class _StreamRef:
    def __init__(self, index: int):
        self.index = index


class _Merged:
    """Several submissions (one per prompt) read as one: choice ``i`` of prompt ``p`` is index ``p * n + i``."""

    def __init__(self, subs: list[Submission], n: int):
        self._subs, self._n = subs, n
        self.streams = [_StreamRef(p * n + s.index) for p, sub in enumerate(subs) for s in sub.streams]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self._subs)

    def cancel(self) -> None:
        for s in self._subs:
            s.cancel()

    def take(self) -> list[tuple[int, Any]]:
        return [(p * self._n + i, c) for p, sub in enumerate(self._subs) for i, c in sub.take()]

    def on_output(self, callback: Callable[[], None] | None) -> None:
        for s in self._subs:
            s.on_output(callback)

    async def next_chunks(self) -> list[tuple[int, Any]]:
        while not self.finished:
            events = [sub.streams[0]._aevent for sub in self._subs if not sub.finished]
            for e in events:
                e.clear()
            out = self.take()
            if out:
                return out
            waits = [asyncio.ensure_future(e.wait()) for e in events]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return []


@router.post("/v1/completions", response_model=CompletionResponse)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await completion_response(_state(request), body, request.receive)


@_admitted
async def completion_response(state: KilnState, body: CompletionRequest, receive: Receive) -> Response:
    """The whole text completion or scoring (JSON or SSE) for a validated request.

    Several prompts give ``n`` choices each, choice ``i`` of prompt ``p`` at index ``p * n + i``
    (as OpenAI numbers them). ``echo`` puts each prompt's text (and, with ``logprobs``, its
    tokens' logprobs, the first ``None``) before the completion."""
    adapter = _resolve_model(state, body.model)
    extra_headers = _check_request(body)
    _check_limits(state, body, body.logprobs, body.stop_list())
    lim = state.settings.limits
    if body.prompt_logprobs is not None:
        if body.prompt_logprobs > lim.max_prompt_logprobs:
            raise InvalidRequest(f"prompt_logprobs={body.prompt_logprobs} exceeds "
                           f"limits.max_prompt_logprobs={lim.max_prompt_logprobs}", code="limit_exceeded", hint="ask for fewer prompt logprobs")
        if body.stream:
            raise InvalidRequest("prompt_logprobs is not supported with stream=true", code="invalid_request", hint="send the scoring request with stream=false")
    raw_prompts = _prompt_list(body)
    many = len(raw_prompts) > 1
    prompts = []
    for j, p in enumerate(raw_prompts):  # a long text prompt is checked, then tokenized off the event loop
        param = f"prompt[{j}]" if many else "prompt"
        big = isinstance(p, str) and len(p) > LARGE_PROMPT_CHARS
        prompts.append(await asyncio.to_thread(_prompt_ids, state, p, param) if big else _prompt_ids(state, p, param))
    max_tokens = min(_max_tokens(state, body.max_tokens, len(p)) for p in prompts)
    rid = f"cmpl-{_request_id()}"
    created = int(time.time())
    timeout = state.settings.server.request_timeout_s
    tt = _token_text(state)
    n = body.n
    total_prompt = sum(len(p) for p in prompts)

    prompt_rows: list[list | None] = [None] * len(prompts)
    echo_texts = [p if isinstance(p, str) else state.engine.tokens.decode(ids) for p, ids in zip(raw_prompts, prompts)]
    echo_lps: list[dict | None] = [None] * len(prompts)
    score_k = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        score_k = max(score_k or 0, body.logprobs)
    if score_k is not None:
        for j, ids in enumerate(prompts):
            rows = await _score(state, ids, score_k, adapter, receive, timeout)
            if body.prompt_logprobs is not None:
                prompt_rows[j] = _prompt_logprobs_json(
                    rows if score_k == body.prompt_logprobs else _trim_rows(rows, body.prompt_logprobs), tt)
            if body.echo and body.logprobs is not None:
                echo_lps[j] = _echo_logprobs(ids, rows, body.logprobs, tt)

    headers = {**_revision_header(None, adapter, state), **extra_headers}
    if max_tokens == 0:
        results = [("", [], "length")] * (n * len(prompts))
    else:
        params = await _params(state, body, max_tokens, body.logprobs, n * len(prompts))
        subs: list[Submission] = []
        try:
            for j, ids in enumerate(prompts):
                subs.append(_submit(state, ids, params[j * n:(j + 1) * n], adapter, body.stream))
        except BaseException:
            for s in subs:
                s.cancel()
            raise
        headers = {**_revision_header(subs[0], adapter, state), **extra_headers}
        sub = subs[0] if len(subs) == 1 else _Merged(subs, n)
        if body.stream:
            base = {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                    "system_fingerprint": state.system_fingerprint}
            offsets = [len(echo_texts[i // n]) if body.echo else 0 for i in range(n * len(prompts))]
            fast = _DeltaFrame(base, '"text":')

            def chunk(i: int, c, reason: str | None) -> dict | bytes:
                if body.logprobs is None and reason is None:
                    return fast(i, c.text)
                lp = None
                if body.logprobs is not None:
                    lp = _completion_logprobs(c.tokens, tt, offsets[i])
                offsets[i] += len(c.text)
                return {**base, "choices": [{"index": i, "text": c.text, "logprobs": lp, "finish_reason": reason}]}

            first = None
            if body.echo:
                def first(i: int) -> dict:
                    return {**base, "choices": [{"index": i, "text": echo_texts[i // n], "logprobs": echo_lps[i // n],
                                                 "finish_reason": None}]}

            usage = None
            if body.stream_options is not None and body.stream_options.include_usage:
                def usage(done: int) -> dict:
                    return {**base, "choices": [], "usage": _usage(total_prompt, done)}
            return _SSEResponse(sub, timeout, chunk, first, usage, {**SSE_HEADERS, **headers})
        results = await _collect(receive, sub, timeout)

    choices = []
    for i, (text, toks, reason) in enumerate(results):
        p = i // n
        lp = _completion_logprobs(toks, tt) if body.logprobs is not None else None
        if body.echo:
            text = echo_texts[p] + text
            lp = _join_logprobs(echo_lps[p], lp)
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason,
                        "prompt_logprobs": prompt_rows[p]})
    return JSONResponse({  # CompletionResponse
        "id": rid, "object": "text_completion", "created": created, "model": body.model,
        # Scoring answers carry this server's kiln-teacher-v1 identity (kiln.teachers.kiln_identity).
        "system_fingerprint": (body.prompt_logprobs is not None and state.teachers is not None
                               and state.teachers.scoring_fingerprint(adapter)) or state.system_fingerprint,
        "choices": choices,
        "usage": _usage(total_prompt, sum(len(t) for _, t, _ in results)),
    }, headers=headers)


def _top_entries(row: PromptLogprobRow, k: int) -> list:
    """The ``k`` best entries of a scored row (ranks are 1-based positions among the top)."""
    return sorted(row, key=lambda e: e.rank)[:k]


def _trim_rows(rows: list[PromptLogprobRow | None], k: int) -> list[PromptLogprobRow | None]:
    """Rows scored with more top entries than ``k``, cut back to the actual token plus the top ``k``
    (the layout of :func:`kiln.runtime.scoring.chunk_rows`)."""
    out: list[PromptLogprobRow | None] = []
    for row in rows:
        if row is None:
            out.append(None)
            continue
        entries = {row[0].token_id: row[0]}
        entries.update((e.token_id, e) for e in _top_entries(row, k))
        out.append(list(entries.values()))
    return out


# The generation routes, served by kiln.serving.fast_path ahead of FastAPI's routing (the
# FastAPI routes above stay for the OpenAPI schema and for requests the fast path hands on).
FAST_ROUTES: dict[str, tuple] = {  # path -> (request model, handler, precheck or None): kiln.serving.fast_path
    "/v1/chat/completions": (ChatCompletionRequest, chat_response, _precheck_chat),
    "/v1/completions": (CompletionRequest, completion_response, None),
}
