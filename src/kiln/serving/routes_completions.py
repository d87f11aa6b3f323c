"""``POST /v1/completions``: text completions and prompt scoring, in JSON or SSE.

Several prompts give ``n`` choices each, choice ``i`` of prompt ``p`` at index ``p * n + i``
(as OpenAI numbers them; :class:`MergedSubmission` reads their submissions as one). ``echo``
puts each prompt's text (and, with ``logprobs``, its tokens' logprobs, the first ``None``)
before the completion; ``prompt_logprobs`` scores the prompt (:mod:`kiln.serving.prompt_logprobs`).

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

from kiln.errors import InvalidRequest
from kiln.runtime.engine import Submission
from kiln.serving.fast_path import GenerationRoutes
from kiln.serving.generation import (
    LARGE_PROMPT_CHARS,
    StreamChunks,
    admitted,
    check_fits,
    check_limits,
    check_request,
    check_rows,
    collect,
    completion_logprobs,
    include_usage,
    max_tokens_for,
    request_id,
    resolve_model,
    revision_header,
    submit,
    usage_json,
)
from kiln.serving.prompt_logprobs import echo_logprobs, join_logprobs, prompt_logprobs_json, score, trim_rows
from kiln.serving.openai_responses import CompletionResponse
from kiln.serving.protocol import CompletionRequest
from kiln.serving.request_params import sampling_params
from kiln.serving.sse import DeltaFrame, SSEResponse
from kiln.serving.state import KilnState

router = APIRouter()
routes = GenerationRoutes(router)


# -- the prompts ----------------------------------------------------------------------------


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
        check_fits(state, prompt, param)
        return state.engine.encode_text(prompt)
    vocab = state.engine.vocab_size
    bad = state.engine.first_out_of_vocab(prompt)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (size {vocab})", code="invalid_token_id",
                             param=param, hint=f"token ids must be in [0, {vocab})")
    return list(prompt)


# -- the route --------------------------------------------------------------------------------


@routes.post("/v1/completions", CompletionRequest, name="completions", response_model=CompletionResponse)
@admitted
async def completion_response(state: KilnState, body: CompletionRequest, receive: Receive) -> Response:
    """The whole text completion or scoring (JSON or SSE) for a validated request."""
    adapter = resolve_model(state, body.model)
    extra_headers = check_request(body)
    check_limits(state, body, body.logprobs, body.stop_list())
    lim = state.settings.limits
    if body.prompt_logprobs is not None:
        if body.prompt_logprobs > lim.max_prompt_logprobs:
            raise InvalidRequest(f"prompt_logprobs={body.prompt_logprobs} exceeds "
                                 f"limits.max_prompt_logprobs={lim.max_prompt_logprobs}", code="limit_exceeded",
                                 hint="ask for fewer prompt logprobs")
        if body.stream:
            raise InvalidRequest("prompt_logprobs is not supported with stream=true", code="invalid_request",
                                 hint="send the scoring request with stream=false")
    raw_prompts = _prompt_list(body)
    many = len(raw_prompts) > 1
    check_rows(state, body.n * len(raw_prompts), f"{len(raw_prompts)} prompts x n={body.n}" if many
               else f"n={body.n}", "n")
    prompts, fits = [], []
    for j, p in enumerate(raw_prompts):  # a long text prompt is checked, then tokenized off the event loop
        param = f"prompt[{j}]" if many else "prompt"
        big = isinstance(p, str) and len(p) > LARGE_PROMPT_CHARS
        prompts.append(await asyncio.to_thread(_prompt_ids, state, p, param) if big else _prompt_ids(state, p, param))
        # each prompt is checked against the context as soon as it is tokenized: the first too long stops the rest
        fits.append(max_tokens_for(state, body.max_tokens, len(prompts[-1]), param if many else None))
    max_tokens = min(fits)
    rid = f"cmpl-{request_id()}"
    created = int(time.time())
    timeout = state.settings.server.request_timeout_s
    tt = state.engine.token_text
    n = body.n
    total_prompt = sum(len(p) for p in prompts)

    prompt_rows: list[list | None] = [None] * len(prompts)
    echo_texts = [p if isinstance(p, str) else state.engine.decode(ids) for p, ids in zip(raw_prompts, prompts)]
    echo_lps: list[dict | None] = [None] * len(prompts)
    score_k = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        score_k = max(score_k or 0, body.logprobs)
    if score_k is not None:
        for j, ids in enumerate(prompts):
            rows = await score(state, ids, score_k, adapter, receive, timeout)
            if body.prompt_logprobs is not None:
                prompt_rows[j] = prompt_logprobs_json(
                    rows if score_k == body.prompt_logprobs else trim_rows(rows, body.prompt_logprobs), tt)
            if body.echo and body.logprobs is not None:
                echo_lps[j] = echo_logprobs(ids, rows, body.logprobs, tt)

    headers = {**revision_header(None, adapter, state), **extra_headers}
    if max_tokens == 0:
        results = [("", [], "length")] * (n * len(prompts))
    else:
        params = await sampling_params(state, body, max_tokens, body.logprobs, n * len(prompts))
        subs: list[Submission] = []
        try:
            for j, ids in enumerate(prompts):
                subs.append(submit(state, ids, params[j * n:(j + 1) * n], adapter, body.stream))
        except BaseException:
            for s in subs:
                s.cancel()
            raise
        headers = {**revision_header(subs[0], adapter, state), **extra_headers}
        sub = subs[0] if len(subs) == 1 else MergedSubmission(subs, n)
        if body.stream:
            base = {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                    "system_fingerprint": state.system_fingerprint}
            fmt = CompletionChunks(base, total_prompt, include_usage(body), body.logprobs, tt, n,
                                   echo_texts if body.echo else None, echo_lps)
            return SSEResponse.of(sub, timeout, fmt, headers)
        results = await collect(receive, sub, timeout)

    choices = []
    for i, (text, toks, reason) in enumerate(results):
        p = i // n
        lp = completion_logprobs(toks, tt) if body.logprobs is not None else None
        if body.echo:
            text = echo_texts[p] + text
            lp = join_logprobs(echo_lps[p], lp)
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason,
                        "prompt_logprobs": prompt_rows[p]})
    return JSONResponse({  # CompletionResponse
        "id": rid, "object": "text_completion", "created": created, "model": body.model,
        # Scoring answers carry this server's kiln-teacher-v1 identity (kiln.teachers.kiln_identity).
        "system_fingerprint": (body.prompt_logprobs is not None and state.teachers is not None
                               and state.teachers.scoring_fingerprint(adapter)) or state.system_fingerprint,
        "choices": choices,
        "usage": usage_json(total_prompt, sum(len(t) for _, t, _ in results)),
    }, headers=headers)


# -- the stream -------------------------------------------------------------------------------


class CompletionChunks(StreamChunks):
    """A completion stream's chunks: with ``echo``, each choice's prompt (and its logprobs) first;
    text deltas pre-encoded while there are no logprobs and no finish reason; logprob text offsets
    counted per choice from the echoed prompt's end."""

    def __init__(self, base: dict, prompt_tokens: int, usage: bool, logprobs: int | None,
                 token_text: Callable[[int], str], n: int, echo_texts: list[str] | None,
                 echo_lps: list[dict | None]):
        super().__init__(base, prompt_tokens, usage)
        self.logprobs = logprobs
        self.token_text = token_text
        self.n = n
        self.echo_texts, self.echo_lps = echo_texts, echo_lps
        choices = n * len(echo_lps)
        self.offsets = [len(echo_texts[i // n]) for i in range(choices)] if echo_texts is not None else [0] * choices
        self.text = DeltaFrame(base, '"text":')
        self.first = self._echo if echo_texts is not None else None

    def _echo(self, i: int) -> dict:
        assert self.echo_texts is not None
        return {**self.base, "choices": [{"index": i, "text": self.echo_texts[i // self.n],
                                          "logprobs": self.echo_lps[i // self.n], "finish_reason": None}]}

    def chunk(self, i: int, c: Any, reason: str | None) -> dict | bytes:
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
