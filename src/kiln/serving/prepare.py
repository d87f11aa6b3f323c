"""One prepared value per generation request: :func:`prepare` turns a validated chat or completion
request into a frozen :class:`PreparedRequest`, everything the engine and the response need.

In order, each check before the work it bounds: the model is resolved to the base model or a live
adapter (404 for an unknown one), the request's limits are checked (``n``, stop sequences, logprobs,
the rows the engine's queue can ever admit, a chat's tools), the prompts are rendered and tokenized
(:mod:`kiln.serving.render`), each prompt's token budget is checked against the context
(``max_tokens``), a chat's :class:`~kiln.serving.output_parser.OutputParser` is built (its tool-call
and reasoning parsers, and whether the prompt left a reasoning span open), and the sampling parameters
are built (:mod:`kiln.serving.request_params`, which compiles a grammar off the event loop). Every refusal
comes before the request reaches the engine; a completion's prompt scoring and the submission follow in
its route.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from kiln.errors import InvalidRequest, NotFound
from kiln.runtime.sampling import SamplingParams
from kiln.serving.default_adapter import BARE_BASE_SUFFIX, adapter_for_base
from kiln.serving.output_parser import OutputParser
from kiln.serving.protocol import IGNORED_FIELDS_HEADER, ChatCompletionRequest, CompletionRequest
from kiln.serving.render import chat_prompt, completion_prompt, prompt_list
from kiln.serving.request_params import sampling_params
from kiln.serving.scope_routing import route as route_scope
from kiln.serving.scope_routing import route_texts
from kiln.serving.state import KilnState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedRequest:
    """A generation request ready to submit: ``params`` holds ``n`` rows per prompt, prompt by prompt
    (none when ``max_tokens`` is 0: the request only scores or echoes its prompts)."""

    adapter: str | None  # the live adapter that serves it; None: the bare base model
    prompts: tuple[list[int], ...]  # token IDs, one list per prompt
    texts: tuple[str | None, ...]  # each prompt as sent when it was text (for echo), else None
    params: tuple[SamplingParams, ...]
    n: int
    max_tokens: int  # the same for every prompt: the least that fits all of them
    logprobs: int | None  # top logprobs per generated token; None: no logprobs
    headers: dict[str, str]  # response headers of the request itself (the ignored OpenAI fields)
    output: OutputParser | None = None  # a chat's reader of its answers; None for completions

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def rows(self, j: int) -> list[SamplingParams]:
        """Prompt ``j``'s ``n`` rows."""
        return list(self.params[j * self.n:(j + 1) * self.n])


async def prepare(state: KilnState, body: ChatCompletionRequest | CompletionRequest) -> PreparedRequest:
    """``body`` checked, rendered, budgeted and parametrized (see the module's docstring)."""
    if isinstance(body, ChatCompletionRequest):
        return await _prepare_chat(state, body)
    return await _prepare_completion(state, body)


async def _prepare_chat(state: KilnState, body: ChatCompletionRequest) -> PreparedRequest:
    adapter = resolve_model(state, body.model)
    headers = check_request(body)
    top = body.top_logprobs if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs=true", code="invalid_request", hint="set logprobs to true")
    logprobs = (top or 0) if body.logprobs else None
    check_limits(state, body, logprobs, body.stop_list())
    check_rows(state, body.n, f"n={body.n}", "n")
    check_tools(body)
    prompt = await chat_prompt(state, body)
    output = OutputParser.for_chat(state, body, prompt)
    max_tokens = max_tokens_for(state, body.max_completion_tokens or body.max_tokens, len(prompt))
    params = await sampling_params(state, body, max_tokens, logprobs, output=output)
    adapter, scoped = route_scope(state, adapter, body.messages)  # a scoped adapter: the base out of scope
    return PreparedRequest(adapter, (prompt,), (None,), tuple(params), body.n, max_tokens, logprobs,
                           headers | scoped, output)


async def _prepare_completion(state: KilnState, body: CompletionRequest) -> PreparedRequest:
    adapter = resolve_model(state, body.model)
    headers = check_request(body)
    check_limits(state, body, body.logprobs, body.stop_list())
    _check_prompt_logprobs(state, body)
    raw = prompt_list(body)
    many = len(raw) > 1
    check_rows(state, body.n * len(raw), f"{len(raw)} prompts x n={body.n}" if many else f"n={body.n}", "n")
    prompts, fits = [], []
    for j, p in enumerate(raw):
        param = f"prompt[{j}]" if many else "prompt"
        prompts.append(await completion_prompt(state, p, param))
        # each prompt is checked against the context as soon as it is tokenized: the first too long stops the rest
        fits.append(max_tokens_for(state, body.max_tokens, len(prompts[-1]), param if many else None))
    max_tokens = min(fits)
    params = (await sampling_params(state, body, max_tokens, body.logprobs, body.n * len(prompts))
              if max_tokens else [])
    texts = tuple(p if isinstance(p, str) else None for p in raw)
    # a scoped adapter: the base model answers when no prompt is in its scope
    adapter, scoped = route_texts(state, adapter, lambda: prompt_texts(state, texts, prompts))
    return PreparedRequest(adapter, tuple(prompts), texts, tuple(params), body.n, max_tokens, body.logprobs,
                           headers | scoped)


def prompt_texts(state: KilnState, texts: Sequence[str | None], prompts: Sequence[list[int]]) -> list[str]:
    """Each completion prompt's text (token-ID prompts decoded)."""
    return [t if t is not None else state.engine.decode(ids) for t, ids in zip(texts, prompts)]


# -- the model -------------------------------------------------------------------------------------


def resolve_model(state: KilnState, model: str) -> str | None:
    """``None`` for the bare base model, else the adapter name; unknown -> 404. The base model's ID
    gets the server default adapter while it serves its pinned revision; ``<base>@base`` never does."""
    if model == state.model_id:
        return adapter_for_base(state)
    if model == state.model_id + BARE_BASE_SUFFIX:
        return None
    if model in state.engine.active_adapters():
        return model
    raise unknown_model(state, f"model {model!r} does not exist")


def unknown_model(state: KilnState, message: str) -> NotFound:
    known = [state.model_id, state.model_id + BARE_BASE_SUFFIX, *state.engine.active_adapters()]
    return NotFound(message, code="model_not_found", param="model",
                    hint=f"use one of {known} (GET /v1/models lists them)")


# -- the limits ------------------------------------------------------------------------------------


_WARNED_IGNORED: set[str] = set()


def check_request(body: Any) -> dict[str, str]:
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


def check_limits(state: KilnState, req: Any, logprobs: int | None, stop: Sequence[str]) -> None:
    lim = state.settings.limits
    if req.n > lim.max_n:
        raise InvalidRequest(f"n={req.n} exceeds limits.max_n={lim.max_n}", code="limit_exceeded", hint="lower n")
    if len(stop) > lim.max_stop_sequences:
        raise InvalidRequest(f"{len(stop)} stop sequences exceed limits.max_stop_sequences={lim.max_stop_sequences}",
                             code="limit_exceeded", hint="send fewer stop sequences")
    if logprobs is not None and logprobs > lim.max_logprobs:
        raise InvalidRequest(f"{logprobs} logprobs exceed limits.max_logprobs={lim.max_logprobs}",
                             code="limit_exceeded", hint="ask for fewer logprobs")


def check_tools(req: ChatCompletionRequest) -> None:
    if req.tool_choice is not None and req.tool_choice != "none" and not req.tools:
        raise InvalidRequest("tool_choice needs tools", code="invalid_request", param="tool_choice",
                             hint="send the tools the model may call, or drop tool_choice")
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise InvalidRequest("two tools share a name", code="invalid_request", param="tools",
                             hint="give every function a distinct name")


def _check_prompt_logprobs(state: KilnState, body: CompletionRequest) -> None:
    if body.prompt_logprobs is None:
        return
    lim = state.settings.limits
    if body.prompt_logprobs > lim.max_prompt_logprobs:
        raise InvalidRequest(f"prompt_logprobs={body.prompt_logprobs} exceeds "
                             f"limits.max_prompt_logprobs={lim.max_prompt_logprobs}", code="limit_exceeded",
                             hint="ask for fewer prompt logprobs")
    if body.stream:
        raise InvalidRequest("prompt_logprobs is not supported with stream=true", code="invalid_request",
                             hint="send the scoring request with stream=false")


def check_rows(state: KilnState, rows: int, what: str, param: str) -> None:
    """Refuse (400) a request of more rows than the engine's queue can ever take, which would otherwise get
    429 forever; ``what`` says how the rows were counted."""
    cap = state.engine.max_request_rows
    if rows > cap:
        raise InvalidRequest(f"{what} make {rows} rows; one request may queue at most {cap} "
                             "(batching.max_queued_rows), so it could never be admitted", code="limit_exceeded",
                             param=param, hint="send fewer prompts or a lower n per request, or raise "
                             "batching.max_queued_rows")


def max_tokens_for(state: KilnState, requested: int | None, prompt_len: int, prompt_param: str | None = None) -> int:
    """The ``max_tokens`` a prompt of ``prompt_len`` tokens gets; ``prompt_param`` (``prompt[j]`` in a list of
    prompts) is named in a refusal of the prompt as the param, and in the message."""
    lim = state.settings.limits
    model_len: int = state.engine.config.max_model_len  # min(limits.max_model_len, the model's own limit)
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
