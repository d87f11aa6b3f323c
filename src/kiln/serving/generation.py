"""What both generation routes share: model resolution, limits, admission, submission, collection.

:mod:`kiln.serving.routes_chat` and :mod:`kiln.serving.routes_completions` (and the batch route)
validate a request against the configured limits here, resolve ``model`` to the base model or a
live adapter, submit rows to the engine as one admission and collect or stream their output;
the request's sampling parameters come from :mod:`kiln.serving.request_params`.

Every generation response carries ``x-kiln-adapter-revision``: the adapter revision the request
was admitted with, or ``base`` for the base model.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import logging
import secrets
from typing import Any, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive

from kiln.adapters.manifest import ADAPTER_REVISION_HEADER as ADAPTER_HEADER
from kiln.errors import ClientClosed, Internal, InvalidRequest, NotFound, Unavailable
from kiln.runtime.constrained import GrammarTooComplex
from kiln.runtime.engine import Submission, UnknownAdapter
from kiln.runtime.sampling import SamplingParams, TokenChoice
from kiln.runtime.submission import Admission, RowFault
from kiln.serving.default_adapter import BARE_BASE_SUFFIX, adapter_for_base
from kiln.serving.protocol import IGNORED_FIELDS_HEADER
from kiln.serving.sse import await_disconnect
from kiln.serving.state import KilnState

log = logging.getLogger(__name__)

BASE_REVISION = "base"
LARGE_PROMPT_CHARS = 20_000  # render/tokenize bigger prompts off the event loop


# -- the request ----------------------------------------------------------------------------


def resolve_model(state, model: str) -> str | None:
    """``None`` for the bare base model, else the adapter name; unknown -> 404. The base model's ID
    gets the server default adapter while it serves its pinned revision; ``<base>@base`` never does."""
    if model == state.model_id:
        return adapter_for_base(state)
    if model == state.model_id + BARE_BASE_SUFFIX:
        return None
    if model in state.engine.active_adapters():
        return model
    raise unknown_model(state, f"model {model!r} does not exist")


def unknown_model(state, message: str) -> NotFound:
    known = [state.model_id, state.model_id + BARE_BASE_SUFFIX, *state.engine.active_adapters()]
    return NotFound(message, code="model_not_found", param="model",
                    hint=f"use one of {known} (GET /v1/models lists them)")


def check_limits(state, req, logprobs: int | None, stop: tuple[str, ...]) -> None:
    lim = state.settings.limits
    if req.n > lim.max_n:
        raise InvalidRequest(f"n={req.n} exceeds limits.max_n={lim.max_n}", code="limit_exceeded", hint="lower n")
    if len(stop) > lim.max_stop_sequences:
        raise InvalidRequest(f"{len(stop)} stop sequences exceed limits.max_stop_sequences={lim.max_stop_sequences}", code="limit_exceeded", hint="send fewer stop sequences")
    if logprobs is not None and logprobs > lim.max_logprobs:
        raise InvalidRequest(f"{logprobs} logprobs exceed limits.max_logprobs={lim.max_logprobs}", code="limit_exceeded", hint="ask for fewer logprobs")


def check_rows(state, rows: int, what: str, param: str) -> None:
    """Refuse (400) a request of more rows than the engine's queue can ever take, which would otherwise get
    429 forever; ``what`` says how the rows were counted."""
    cap = state.engine.max_request_rows
    if rows > cap:
        raise InvalidRequest(f"{what} make {rows} rows; one request may queue at most {cap} "
                             "(batching.max_queued_rows), so it could never be admitted", code="limit_exceeded",
                             param=param, hint="send fewer prompts or a lower n per request, or raise "
                             "batching.max_queued_rows")


def max_tokens_for(state, requested: int | None, prompt_len: int, prompt_param: str | None = None) -> int:
    """The ``max_tokens`` a prompt of ``prompt_len`` tokens gets; ``prompt_param`` (``prompt[j]`` in a list of
    prompts) is named in a refusal of the prompt as the param, and in the message."""
    lim = state.settings.limits
    model_len = state.engine.config.max_model_len  # min(limits.max_model_len, the model's own limit)
    room = model_len - prompt_len
    which = f"{prompt_param} " if prompt_param else ""
    if room <= 0:
        raise InvalidRequest(f"the prompt {which}has {prompt_len} tokens; the model's limit is {model_len}",
                             code="context_length_exceeded", param=prompt_param, hint="shorten the prompt")
    if requested is None:
        return min(lim.default_max_tokens, room)
    if requested > lim.max_tokens_cap:
        raise InvalidRequest(f"max_tokens={requested} exceeds limits.max_tokens_cap={lim.max_tokens_cap}",
                             code="limit_exceeded", param="max_tokens", hint="lower max_tokens")
    if requested > room:
        raise InvalidRequest(f"prompt {which}({prompt_len} tokens) plus max_tokens ({requested}) exceeds the model's "
                             f"limit of {model_len} tokens", code="context_length_exceeded",
                             param=prompt_param or "max_tokens",
                             hint="shorten the prompt or lower max_tokens")
    return requested


def check_token_ids(state, ids, param: str) -> None:
    vocab = state.engine.vocab_size
    bad = state.engine.first_out_of_vocab(ids)
    if bad is not None:
        raise InvalidRequest(f"{param}: token id {bad} is outside the vocabulary (size {vocab})",
                             code="invalid_token_id", param=param, hint=f"token ids must be in [0, {vocab})")


def check_fits(state, text: str, param: str) -> None:
    """Refuse a prompt whose text alone proves it longer than the context, before tokenizing it."""
    limit = state.engine.config.max_model_len
    least = state.engine.too_long(text, limit)
    if least is not None:
        raise InvalidRequest(f"the prompt has at least {least} tokens ({len(text)} characters); the model's limit is "
                             f"{limit}", code="context_length_exceeded", param=param, hint="shorten the prompt")


_WARNED_IGNORED: set[str] = set()


def check_request(body) -> dict[str, str]:
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


def revision_header(sub: Submission | None, adapter: str | None, state) -> dict[str, str]:
    if adapter is None:
        return {ADAPTER_HEADER: BASE_REVISION}
    rev = sub.adapter_revision if sub is not None else state.engine.active_adapters().get(adapter)
    return {ADAPTER_HEADER: rev or BASE_REVISION}


# -- admission, submission and collection ---------------------------------------------------


_ADMISSION: contextvars.ContextVar[Admission | None] = contextvars.ContextVar("kiln_admission", default=None)


def admitted(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
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


def admission_over() -> None:
    """The current request reached the engine: its admission ends."""
    admission = _ADMISSION.get()
    if admission is not None:
        admission.end()


def submit(state: KilnState, prompt_ids: list[int], params: list[SamplingParams], adapter: str | None,
            stream: bool) -> Submission:
    try:
        sub = state.engine.submit(prompt_ids, params, adapter=adapter, loop=asyncio.get_running_loop(),
                                  incremental=stream)
    except UnknownAdapter as exc:  # unloaded between resolution and admission
        raise unknown_model(state, str(exc)) from exc
    admission_over()
    state.metrics.prompt_tokens.inc(len(prompt_ids))
    return sub


async def collect(receive: Receive, sub: Submission, timeout_s: float) -> list[tuple[str, list[TokenChoice], str]]:
    """Run a submission to the end; cancels it on disconnect or timeout."""
    texts: dict[int, list[str]] = {s.index: [] for s in sub.streams}
    toks: dict[int, list[TokenChoice]] = {s.index: [] for s in sub.streams}
    reasons: dict[int, str] = {}
    faults: list[RowFault] = []

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
                if c.fault is not None:
                    faults.append(c.fault)

    await until_done(receive, asyncio.ensure_future(drain()), sub.cancel, timeout_s, "the request",
                      "lower max_tokens or raise server.request_timeout_s")
    for fault in faults:  # the engine contained a failure to this request's rows: its typed error
        raise fault.error()
    _raise_on_engine_error(reasons.values())
    return [("".join(texts[i]), toks[i], reasons[i]) for i in sorted(texts)]


async def until_done(receive: Receive, work: asyncio.Future, cancel: Callable[[], None], timeout_s: float,
                      what: str, hint: str) -> Any:
    """``work``'s result; on a disconnect or after ``timeout_s`` cancel it (and the engine's rows) and raise."""
    watch = asyncio.ensure_future(await_disconnect(receive))
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


# -- response pieces ------------------------------------------------------------------------
# Responses are built as plain dicts in the field order of the models in kiln.serving.openai_responses
# (which document them in the OpenAPI schema): constructing and dumping pydantic models
# costs more event-loop time per request than the rest of the response path.


def _top_entry(token: str, logprob: float | None) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(tokens: list[TokenChoice], tt: Callable[[int], str]) -> dict:
    """``ChatLogprobs``."""
    return {"content": [
        {**_top_entry(tt(t.token_id), t.logprob), "top_logprobs": [_top_entry(tt(i), lp) for i, lp in t.top]}
        for t in tokens
    ]}


def completion_logprobs(tokens: list[TokenChoice], tt: Callable[[int], str], offset: int = 0) -> dict:
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


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


_ID_PREFIX = secrets.token_hex(8)  # per process; a counter makes each ID unique without a syscall


_ID_COUNTER = itertools.count()


def request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


class StreamChunks:
    """What a route's :class:`~kiln.serving.sse.StreamFormat` shares: the chunk's fields before
    ``choices`` (``base``) and, when the request asked for it, the final usage chunk."""

    first: Callable[[int], dict] | None = None

    def __init__(self, base: dict, prompt_tokens: int, include_usage: bool):
        self.base = base
        self.prompt_tokens = prompt_tokens
        self.usage: Callable[[int], dict] | None = self._usage if include_usage else None

    def _usage(self, completion_tokens: int) -> dict:
        return {**self.base, "choices": [], "usage": usage_json(self.prompt_tokens, completion_tokens)}


def include_usage(body: Any) -> bool:
    return body.stream_options is not None and bool(body.stream_options.include_usage)
