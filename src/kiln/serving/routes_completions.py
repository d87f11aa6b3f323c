"""``POST /v1/completions``: text completions and prompt scoring, in JSON or SSE.

Several prompts give ``n`` choices each, choice ``i`` of prompt ``p`` at index ``p * n + i``
(as OpenAI numbers them; :class:`MergedSubmission` reads their submissions as one). ``echo``
puts each prompt's text (and, with ``logprobs``, its tokens' logprobs, the first ``None``)
before the completion; ``prompt_logprobs`` scores the prompt (:mod:`kiln.serving.prompt_logprobs`).
:func:`completion_response` reads: prepare (:func:`kiln.serving.prepare.prepare`) -> score the prompts
when asked -> submit -> respond (JSON, or SSE with :class:`CompletionChunks`).

Normally reached through :mod:`kiln.serving.fast_path`, which calls :func:`completion_response`
without going through FastAPI; the FastAPI route (and the batch route) call the same function.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from kiln.runtime.engine import Submission
from kiln.runtime.sampling import TokenChoice
from kiln.serving.admission import admitted
from kiln.serving.fast_path import GenerationRoutes
from kiln.serving.generation import (
    StreamChunks,
    collect,
    completion_logprobs,
    include_usage,
    request_id,
    revision_header,
    submit,
    usage_json,
)
from kiln.serving.openai_responses import CompletionResponse
from kiln.serving.prepare import PreparedRequest, prepare, prompt_texts
from kiln.serving.prompt_logprobs import echo_logprobs, join_logprobs, prompt_logprobs_json, score, trim_rows
from kiln.serving.protocol import CompletionRequest
from kiln.serving.sse import DeltaFrame, SSEResponse
from kiln.serving.state import KilnState

router = APIRouter()
routes = GenerationRoutes(router)

Results = list[tuple[str, list[TokenChoice], str]]


@routes.post("/v1/completions", CompletionRequest, name="completions", response_model=CompletionResponse)
@admitted
async def completion_response(state: KilnState, body: CompletionRequest, receive: Receive) -> Response:
    """The whole text completion or scoring (JSON or SSE) for a validated request."""
    prepared = await prepare(state, body)
    base = {"id": f"cmpl-{request_id()}", "object": "text_completion", "created": int(time.time()),
            "model": body.model}
    timeout = state.settings.server.request_timeout_s
    echo_texts = prompt_texts(state, prepared.texts, prepared.prompts) if body.echo else None
    scored = await _scored(state, body, prepared, receive, timeout)
    if prepared.max_tokens == 0:
        headers = {**revision_header(None, prepared.adapter, state), **prepared.headers}
        results: Results = [("", [], "length")] * (prepared.n * len(prepared.prompts))
    else:
        sub = _submit(state, prepared, body.stream)
        headers = {**revision_header(sub, prepared.adapter, state), **prepared.headers}
        if body.stream:
            fmt = CompletionChunks({**base, "system_fingerprint": state.system_fingerprint}, prepared.prompt_tokens,
                                   include_usage(body), body.logprobs, state.engine.token_text, prepared.n,
                                   echo_texts, scored[1])
            return SSEResponse.of(sub, timeout, fmt, headers)
        results = await collect(receive, sub, timeout)
    return JSONResponse({**base, **_answer(state, body, prepared, results, echo_texts, scored)},
                        headers=headers)  # CompletionResponse


async def _scored(state: KilnState, body: CompletionRequest, prepared: PreparedRequest, receive: Receive,
                  timeout: float) -> tuple[list[list[Any] | None], list[dict[str, Any] | None]]:
    """Each prompt's ``prompt_logprobs`` rows and its echo logprobs, when asked (one scoring per prompt,
    with the larger of the two ``k``)."""
    count = len(prepared.prompts)
    prompt_rows: list[list[Any] | None] = [None] * count
    echo_lps: list[dict[str, Any] | None] = [None] * count
    score_k = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        score_k = max(score_k or 0, body.logprobs)
    if score_k is None:
        return prompt_rows, echo_lps
    tt = state.engine.token_text
    for j, ids in enumerate(prepared.prompts):
        rows = await score(state, ids, score_k, prepared.adapter, receive, timeout)
        if body.prompt_logprobs is not None:
            prompt_rows[j] = prompt_logprobs_json(
                rows if score_k == body.prompt_logprobs else trim_rows(rows, body.prompt_logprobs), tt)
        if body.echo and body.logprobs is not None:
            echo_lps[j] = echo_logprobs(ids, rows, body.logprobs, tt)
    return prompt_rows, echo_lps


def _submit(state: KilnState, prepared: PreparedRequest, stream: bool) -> Submission | MergedSubmission:
    """Every prompt's ``n`` rows, submitted prompt by prompt; a failed submission cancels the ones before it."""
    subs: list[Submission] = []
    try:
        for j, ids in enumerate(prepared.prompts):
            subs.append(submit(state, ids, prepared.rows(j), prepared.adapter, stream))
    except BaseException:
        for s in subs:
            s.cancel()
        raise
    return subs[0] if len(subs) == 1 else MergedSubmission(subs, prepared.n)


def _answer(state: KilnState, body: CompletionRequest, prepared: PreparedRequest, results: Results,
            echo_texts: list[str] | None, scored: tuple[list[list[Any] | None], list[dict[str, Any] | None]]
            ) -> dict[str, Any]:
    """The JSON answer after its ``id``, ``object``, ``created`` and ``model``."""
    tt = state.engine.token_text
    prompt_rows, echo_lps = scored
    choices = []
    for i, (text, toks, reason) in enumerate(results):
        p = i // prepared.n
        lp = completion_logprobs(toks, tt) if body.logprobs is not None else None
        if echo_texts is not None:
            text = echo_texts[p] + text
            lp = join_logprobs(echo_lps[p], lp)
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason,
                        "prompt_logprobs": prompt_rows[p]})
    return {
        # Scoring answers carry this server's kiln-teacher-v1 identity (kiln.teachers.kiln_identity).
        "system_fingerprint": (body.prompt_logprobs is not None and state.teachers is not None
                               and state.teachers.scoring_fingerprint(prepared.adapter)) or state.system_fingerprint,
        "choices": choices,
        "usage": usage_json(prepared.prompt_tokens, sum(len(t) for _, t, _ in results)),
    }


# -- the stream -------------------------------------------------------------------------------


class CompletionChunks(StreamChunks):
    """A completion stream's chunks: with ``echo``, each choice's prompt (and its logprobs) first;
    text deltas pre-encoded while there are no logprobs and no finish reason; logprob text offsets
    counted per choice from the echoed prompt's end."""

    def __init__(self, base: dict[str, Any], prompt_tokens: int, usage: bool, logprobs: int | None,
                 token_text: Callable[[int], str], n: int, echo_texts: list[str] | None,
                 echo_lps: list[dict[str, Any] | None]):
        super().__init__(base, prompt_tokens, usage)
        self.logprobs = logprobs
        self.token_text = token_text
        self.n = n
        self.echo_texts, self.echo_lps = echo_texts, echo_lps
        choices = n * len(echo_lps)
        self.offsets = [len(echo_texts[i // n]) for i in range(choices)] if echo_texts is not None else [0] * choices
        self.text = DeltaFrame(base, '"text":')
        self.first = self._echo if echo_texts is not None else None

    def _echo(self, i: int) -> dict[str, Any]:
        assert self.echo_texts is not None
        return {**self.base, "choices": [{"index": i, "text": self.echo_texts[i // self.n],
                                          "logprobs": self.echo_lps[i // self.n], "finish_reason": None}]}

    def chunk(self, i: int, c: Any, reason: str | None) -> dict[str, Any] | bytes:
        if self.logprobs is None and reason is None:
            return self.text(i, c.text)
        lp = None
        if self.logprobs is not None:
            lp = completion_logprobs(c.tokens, self.token_text, self.offsets[i])
        self.offsets[i] += len(c.text)
        return {**self.base, "choices": [{"index": i, "text": c.text, "logprobs": lp, "finish_reason": reason}]}


class _StreamRef:
    def __init__(self, index: int):
        self.index = index


class MergedSubmission:
    """Several submissions (one per prompt) read as one: choice ``i`` of prompt ``p`` is index ``p * n + i``."""

    def __init__(self, subs: list[Submission], n: int):
        self._subs, self._n = subs, n
        self.streams = [_StreamRef(p * n + s.index) for p, sub in enumerate(subs) for s in sub.streams]
        self.adapter_revision = subs[0].adapter_revision  # the revision the response names: the first prompt's

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
            events = [_event(sub) for sub in self._subs if not sub.finished]
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


def _event(sub: Submission) -> asyncio.Event:
    event = sub.streams[0]._aevent
    assert event is not None, "submit(..., loop=...) binds the streams to an event loop"
    return event
