"""A generation request's sampling parameters: controls, structured output and the thinking budget.

:func:`sampling_params` turns a validated chat or completion request into the engine's
:class:`~kiln.runtime.sampling.SamplingParams` rows, compiling its grammar (``response_format``,
vLLM's ``guided_*`` or a forced ``tool_choice``) off the event loop; a chat's rows get the
reasoning span's thinking budget from its :class:`~kiln.serving.output_parser.OutputParser`.
The grammar compiler is built once per served model and cached in ``state.extras``.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, Callable, cast

from kiln.errors import InvalidRequest
from kiln.runtime.constrained import CompiledGrammar, GrammarCompiler, NoValidOutput
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.strict_schema import close_schema
from kiln.runtime.reasoning import ReasoningParser, with_thinking_budget
from kiln.serving.state import KilnState

if TYPE_CHECKING:
    from kiln.serving.output_parser import OutputParser


async def sampling_params(state: KilnState, req: Any, max_tokens: int, logprobs: int | None,
                          count: int | None = None, output: OutputParser | None = None) -> list[SamplingParams]:
    """``count`` rows (default ``n``); each gets its own grammar state when the output is constrained
    (the grammar compiled off the event loop, under the compiler's limits and deadline); with a chat's
    ``output`` parser, each row also gets its thinking budget (:func:`thinking_budget`)."""
    top_k = 0 if req.top_k in (-1, 0) else req.top_k
    extra = _controls(state, req, max_tokens)
    asked = _grammar(state, req, output)
    compiled = None if asked is None else await grammar_compiler(state).compile(*asked)
    if compiled is not None and asked is not None and extra.get("bad_words"):
        await asyncio.to_thread(_check_some_output, compiled, extra["bad_words"], asked[1])
    rows = [
        SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=top_k,
            seed=None if req.seed is None else (req.seed + i) % (2**63), stop=req.stop_list(),
            logprobs=logprobs, ignore_eos=req.ignore_eos, **extra,
            constraint=compiled.row() if compiled is not None else None,
        )
        for i in range(req.n if count is None else count)
    ]
    if output is None:
        return rows
    return with_thinking_budget(rows, output.reasoning, output.opened,
                                thinking_budget(state, req, output.reasoning), state.engine)


def _check_some_output(compiled: CompiledGrammar, bad_words: tuple[tuple[int, ...], ...], param: str) -> None:
    """Refuse (400 ``no_valid_output``) a grammar whose every first token ``bad_words`` forbids: generation
    could only end in an invalid output, which is the request's contradiction, not a grammar limit."""
    first, may_end = compiled.first_tokens()
    banned = {w[0] for w in bad_words if len(w) == 1}
    if first and not may_end and first <= banned:
        raise NoValidOutput(f"{param} and bad_words together exclude every token: {param} must start with one of "
                            f"{len(first)} token(s), and bad_words forbids all of them", param="bad_words")


def _controls(state: KilnState, req: Any, max_tokens: int) -> dict[str, Any]:
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
        check_token_ids(state, [t for t, _ in bias], "logit_bias")
        out["logit_bias"] = bias
    if req.min_tokens:
        if req.min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens={req.min_tokens} exceeds max_tokens={max_tokens}",
                                 code="invalid_request", param="min_tokens", hint="lower min_tokens")
        out["min_tokens"] = req.min_tokens
    if req.stop_token_ids:
        check_token_ids(state, req.stop_token_ids, "stop_token_ids")
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


def grammar_compiler(state: KilnState) -> GrammarCompiler:
    """One compiler per served model, built on first use (route-module cache in ``state.extras``)."""
    comp = state.extras.get("grammar_compiler")
    if comp is None:
        engine = state.engine
        config = getattr(state.model.model, "config", None)
        vocab = max(int(getattr(config, "vocab_size", 0) or 0), engine.vocab_size)
        lim = state.settings.limits
        comp = state.extras["grammar_compiler"] = GrammarCompiler(
            engine.tokenizer, vocab, engine.eos_ids, timeout_s=lim.grammar_compile_timeout_s,
            cache_bytes=lim.grammar_cache_mib << 20)
        comp.observer = state.metrics.grammar_compile  # /metrics kiln_grammar_compile_seconds{outcome}
    return cast(GrammarCompiler, comp)


def _grammar(state: KilnState, req: Any, output: OutputParser | None) -> tuple[Callable[[], str], str] | None:
    """The request's structured-output grammar (``response_format`` or vLLM's ``guided_*``): a builder of
    its grammar text (run on the compile thread by :meth:`GrammarCompiler.compile`) and the field it came from."""
    rf = req.response_format
    forced = forced_tools(req)
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
    comp = grammar_compiler(state)
    strict = _strictly if not req.allow_additional_properties else (lambda schema: schema)
    if asked[0] == "tool_choice":
        assert forced is not None  # asked[0] names a field that was given
        tools, parallel = forced
        parser = output.tools if output is not None else None
        assert parser is not None  # a chat whose tool_choice forces calls has its tools on
        return (lambda: comp.lark(parser.forcing_grammar(
            [{**t, "parameters": strict(t["parameters"] or {"type": "object"})} for t in tools], parallel),
            "tool_choice")), "tool_choice"
    if asked[0] == "response_format":
        if rf.type != "json_schema":  # json_object: any object, never closed
            return (lambda: comp.json_schema(None, "response_format")), "response_format"
        schema = rf.json_schema.schema_
        return (lambda: comp.json_schema(strict(schema), "response_format")), "response_format"
    if asked[0] == "guided_json":
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequest(f"guided_json is not JSON: {exc}", code="invalid_schema", param="guided_json",
                                     hint="send the schema as an object or as JSON text") from exc
        return (lambda: comp.json_schema(strict(schema), "guided_json")), "guided_json"
    if asked[0] == "guided_regex":
        return (lambda: comp.regex(req.guided_regex, "guided_regex")), "guided_regex"
    return (lambda: comp.choice(req.guided_choice, "guided_choice")), "guided_choice"


def check_token_ids(state: KilnState, ids: list[int], param: str) -> None:
    vocab = state.engine.vocab_size
    bad = state.engine.first_out_of_vocab(ids)
    if bad is not None:
        raise InvalidRequest(f"{param}: token id {bad} is outside the vocabulary (size {vocab})",
                             code="invalid_token_id", param=param, hint=f"token ids must be in [0, {vocab})")


def forced_tools(req: Any) -> tuple[list[dict[str, Any]], bool] | None:
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


def _strictly(schema: Any) -> Any:
    """``schema`` closed as vLLM's default backend reads it (:mod:`kiln.runtime.strict_schema`); ``None``
    (``response_format`` json_schema without a schema) stays any object."""
    return None if schema is None else close_schema(schema)


def thinking_budget(state: KilnState, req: Any, reasoner: ReasoningParser | None) -> int | None:
    """The request's ``thinking_token_budget`` (omitted: the server default; ``None``: unlimited)."""
    if "thinking_token_budget" not in req.model_fields_set:
        default: int | None = state.settings.serving.thinking_token_budget
        return default if reasoner is not None else None
    if req.thinking_token_budget is not None and reasoner is None:
        raise InvalidRequest("thinking_token_budget needs a reasoning parser, and this server has none for its "
                             "chat template", code="invalid_request", param="thinking_token_budget",
                             hint="drop thinking_token_budget, or start the server with --reasoning-parser")
    budget: int | None = req.thinking_token_budget
    return budget
