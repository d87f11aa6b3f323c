"""What both generation routes share after :func:`kiln.serving.prepare.prepare`: submission, collection
and the pieces of the response.

:mod:`kiln.serving.routes_chat` and :mod:`kiln.serving.routes_completions` (and the batch route)
submit a :class:`~kiln.serving.prepare.PreparedRequest`'s rows to the engine (which ends the
request's admission, :mod:`kiln.serving.admission`), then collect their output here or stream it
(:mod:`kiln.serving.sse`), and build the response from the pieces below.

Every generation response carries ``x-kiln-adapter-revision``: the adapter revision the request
was admitted with, or ``base`` for the base model.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from typing import Any, Callable, Collection, Protocol, Sequence

from starlette.types import Receive

from kiln.adapters.manifest import ADAPTER_REVISION_HEADER as ADAPTER_HEADER
from kiln.errors import ClientClosed, Internal, Unavailable
from kiln.runtime.constrained import GrammarTooComplex
from kiln.runtime.engine import Submission, UnknownAdapter
from kiln.runtime.sampling import SamplingParams, TokenChoice
from kiln.runtime.submission import RowFault
from kiln.serving.admission import admission_over
from kiln.serving.prepare import unknown_model
from kiln.serving.sse import await_disconnect
from kiln.serving.state import KilnState

BASE_REVISION = "base"


class _Indexed(Protocol):
    @property
    def index(self) -> int: ...


class Output(Protocol):
    """What :func:`collect` and the response read of a submission (one, or several read as one)."""

    @property
    def streams(self) -> Sequence[_Indexed]: ...
    @property
    def adapter_revision(self) -> str | None: ...
    def cancel(self) -> None: ...
    async def next_chunks(self) -> list[tuple[int, Any]]: ...


# -- submission and collection ------------------------------------------------------------


def revision_header(sub: Output | None, adapter: str | None, state: KilnState) -> dict[str, str]:
    if adapter is None:
        return {ADAPTER_HEADER: BASE_REVISION}
    rev = sub.adapter_revision if sub is not None else state.engine.active_adapters().get(adapter)
    return {ADAPTER_HEADER: rev or BASE_REVISION}


def submit(state: KilnState, prompt_ids: list[int], params: list[SamplingParams], adapter: str | None,
            stream: bool) -> Submission:
    try:
        sub: Submission = state.engine.submit(prompt_ids, params, adapter=adapter, loop=asyncio.get_running_loop(),
                                  incremental=stream)
    except UnknownAdapter as exc:  # unloaded between resolution and admission
        raise unknown_model(state, str(exc)) from exc
    admission_over()
    state.metrics.prompt_tokens.inc(len(prompt_ids))
    return sub


async def collect(receive: Receive, sub: Output, timeout_s: float) -> list[tuple[str, list[TokenChoice], str]]:
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


async def until_done(receive: Receive, work: asyncio.Future[Any], cancel: Callable[[], None], timeout_s: float,
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


def _raise_on_engine_error(reasons: Collection[str]) -> None:
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


def _top_entry(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(tokens: list[TokenChoice], tt: Callable[[int], str]) -> dict[str, Any]:
    """``ChatLogprobs``."""
    return {"content": [
        {**_top_entry(tt(t.token_id), t.logprob), "top_logprobs": [_top_entry(tt(i), lp) for i, lp in t.top]}
        for t in tokens
    ]}


def completion_logprobs(tokens: list[TokenChoice], tt: Callable[[int], str], offset: int = 0) -> dict[str, Any]:
    """``CompletionLogprobs``."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        s = tt(t.token_id)
        out["tokens"].append(s)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({tt(i): lp for i, lp in t.top})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


_ID_PREFIX = secrets.token_hex(8)  # per process; a counter makes each ID unique without a syscall


_ID_COUNTER = itertools.count()


def request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


class StreamChunks:
    """What a route's :class:`~kiln.serving.sse.StreamFormat` shares: the chunk's fields before
    ``choices`` (``base``) and, when the request asked for it, the final usage chunk."""

    first: Callable[[int], dict[str, Any]] | None = None

    def __init__(self, base: dict[str, Any], prompt_tokens: int, include_usage: bool):
        self.base = base
        self.prompt_tokens = prompt_tokens
        self.usage: Callable[[int], dict[str, Any]] | None = self._usage if include_usage else None

    def _usage(self, completion_tokens: int) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage_json(self.prompt_tokens, completion_tokens)}


def include_usage(body: Any) -> bool:
    return body.stream_options is not None and bool(body.stream_options.include_usage)
