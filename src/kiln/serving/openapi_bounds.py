"""The bounds only the running server knows, written into the OpenAPI document it serves.

The request models (:mod:`kiln.serving.protocol`) carry static ceilings, true of every configuration.
The running server knows tighter ones: its configured ``limits.*``, its queue's row cap, its model's
context and vocabulary. :func:`apply_runtime_bounds` lowers the generated request schemas to them, so a
client (or a fuzzer) reading ``/openapi.json`` knows what will be refused before it asks:

* a token ID (token-ID prompts, ``stop_token_ids``, ``/detokenize`` tokens): ``maximum`` vocabulary
  size - 1, and a ``logit_bias`` key (a token ID as a string) a pattern of the decimals below the
  vocabulary size; a token-ID prompt: at most ``max_model_len`` - 1 IDs (a longer one leaves no room to answer);
* ``n`` <= ``limits.max_n`` (and ``batching.max_queued_rows``), ``stop`` <= ``limits.max_stop_sequences``
  (with 0, a single stop string is no longer admitted either),
  ``logprobs`` / ``top_logprobs`` <= ``limits.max_logprobs``, ``prompt_logprobs`` <=
  ``limits.max_prompt_logprobs``, ``max_tokens`` / ``max_completion_tokens`` <= ``limits.max_tokens_cap``,
  ``messages`` <= ``limits.max_messages``, the batch route's ``prompts`` <= ``limits.max_batch_prompts``,
  a list of prompts <= ``batching.max_queued_rows`` (prompts x ``n`` rows is still checked per request);
* a chat's ``thinking_token_budget`` only ``null`` when the server has no reasoning parser for its template.

The checks in :mod:`kiln.serving.prepare` stay: a request that ignores the document still gets the 400
``limit_exceeded`` / ``invalid_token_id`` naming the bound. What the document still cannot state (a text's
token count, rows of several prompts x ``n``) is listed in docs/security.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

CHAT, COMPLETION, BATCH = "ChatCompletionRequest", "CompletionRequest", "BatchCompletionRequest"
TOKENIZE_CHAT, DETOKENIZE = "TokenizeChatRequest", "DetokenizeRequest"
SAMPLING = (CHAT, COMPLETION, BATCH)
KEY_DIGITS = 9  # a logit_bias key: 1-9 decimal digits (kiln.serving.protocol.LOGIT_BIAS_KEY)


@dataclass(frozen=True)
class RuntimeBounds:
    vocab_size: int
    max_model_len: int  # the engine's: min(limits.max_model_len, the model's own)
    max_request_rows: int  # batching.max_queued_rows: the most rows one request may queue
    limits: Any  # kiln.config.LimitsSettings
    reasoning: bool = True  # a reasoning parser reads this server's chat template (thinking_token_budget works)

    @classmethod
    def of(cls, state: Any) -> RuntimeBounds:
        """The bounds of a built :class:`~kiln.serving.state.KilnState`."""
        from kiln.serving.output_parser import reasoning_parser

        engine = state.engine
        return cls(vocab_size=int(engine.vocab_size), max_model_len=int(engine.config.max_model_len),
                   max_request_rows=int(engine.max_request_rows), limits=state.settings.limits,
                   reasoning=reasoning_parser(state) is not None)

    def limits_table(self) -> list[tuple[tuple[str, ...], str, str, int]]:
        """(components, property, keyword, bound): each configured limit where a request states it."""
        lim = self.limits
        rows = self.max_request_rows  # >= 1: batching.max_queued_rows (and vLLM's running rows) are at least 1
        return [
            (SAMPLING, "n", "maximum", min(lim.max_n, rows)),
            (SAMPLING, "stop", "maxItems", lim.max_stop_sequences),
            ((COMPLETION, BATCH), "logprobs", "maximum", lim.max_logprobs),
            ((CHAT,), "top_logprobs", "maximum", lim.max_logprobs),
            ((COMPLETION,), "prompt_logprobs", "maximum", lim.max_prompt_logprobs),
            (SAMPLING, "max_tokens", "maximum", lim.max_tokens_cap),
            ((CHAT,), "max_completion_tokens", "maximum", lim.max_tokens_cap),
            ((CHAT, TOKENIZE_CHAT), "messages", "maxItems", lim.max_messages),
            ((BATCH,), "prompts", "maxItems", min(lim.max_batch_prompts, rows)),
        ]


def apply_runtime_bounds(components: dict[str, Any], bounds: RuntimeBounds) -> None:
    """Lower the request schemas in ``components`` (the document's ``components.schemas``) to ``bounds``."""
    for names, prop, keyword, bound in bounds.limits_table():
        for schema in _properties(components, names, prop):
            _lower(schema, keyword, bound)
            if keyword == "maxItems" and bound == 0 and "anyOf" in schema:  # a lone item (``stop: "x"``) is one too
                schema["anyOf"] = [m for m in schema["anyOf"] if m.get("type") in ("array", "null")]
    last_id = bounds.vocab_size - 1
    prompt_len = bounds.max_model_len - 1
    for schema in _properties(components, (COMPLETION,), "prompt"):
        _token_ids(schema, last_id, prompt_len)
        for member in schema.get("anyOf", ()):  # a list of prompts (not of IDs): each is at least one row
            if member.get("type") == "array" and member.get("items", {}).get("type") != "integer":
                _lower(member, "maxItems", bounds.max_request_rows)
    for schema in _properties(components, (BATCH,), "prompts"):
        _token_ids(schema, last_id, prompt_len)
    for schema in _properties(components, SAMPLING, "stop_token_ids"):
        _token_ids(schema, last_id, None)
    for schema in _properties(components, (DETOKENIZE,), "tokens"):
        _token_ids(schema, last_id, None)
    for schema in _properties(components, SAMPLING, "logit_bias"):
        for member in schema.get("anyOf", ()):
            if "propertyNames" in member and bounds.vocab_size <= 10**KEY_DIGITS:
                member["propertyNames"] = {"pattern": decimals_below(bounds.vocab_size, KEY_DIGITS)}
    if not bounds.reasoning:  # any budget is refused (request_params.thinking_budget): null or omitted only
        for schema in _properties(components, (CHAT,), "thinking_token_budget"):
            schema.pop("anyOf", None)
            schema["type"] = "null"


def _properties(components: dict[str, Any], names: tuple[str, ...], prop: str) -> Iterator[dict[str, Any]]:
    for name in names:
        schema = components.get(name, {}).get("properties", {}).get(prop)
        if schema is None:
            raise KeyError(f"{name}.{prop} is not in the OpenAPI document")  # a renamed field: fix the table
        yield schema


def _lower(schema: dict[str, Any], keyword: str, bound: int) -> None:
    """``keyword`` (``maximum``, ``maxItems``) lowered to ``bound`` in the schema and its ``anyOf`` members."""
    if keyword in schema:
        schema[keyword] = min(int(schema[keyword]), bound)
    for member in schema.get("anyOf", ()):
        _lower(member, keyword, bound)


def _token_ids(schema: dict[str, Any], last_id: int, max_len: int | None) -> None:
    """Every array of integers (token IDs) below ``schema``: items at most ``last_id``, at most ``max_len`` of them."""
    items = schema.get("items")
    if schema.get("type") == "array" and isinstance(items, dict) and items.get("type") == "integer":
        items["maximum"] = min(int(items.get("maximum", last_id)), last_id)
        if max_len is not None:
            schema["maxItems"] = min(int(schema.get("maxItems", max_len)), max_len)
        return
    for member in schema.get("anyOf", ()):
        _token_ids(member, last_id, max_len)
    if isinstance(items, dict):
        _token_ids(items, last_id, max_len)


def decimals_below(n: int, width: int) -> str:
    """An anchored regex of the decimal strings of at most ``width`` digits (leading zeros allowed) whose value
    is below ``n`` (``n`` >= 1, with at most ``width`` digits): the ``logit_bias`` keys a vocabulary of ``n`` admits."""
    top = str(n - 1)
    lengths = []
    for d in range(1, len(top) + 1):
        lo, hi = ("0" if d == 1 else "1" + "0" * (d - 1)), (top if d == len(top) else "9" * d)
        zeros = width - d
        lengths.append(("0{0,%d}" % zeros if zeros else "") + "(?:" + "|".join(_span(lo, hi)) + ")")
    return "^(?:" + "|".join(lengths) + ")$"


def _span(lo: str, hi: str) -> list[str]:
    """Regex alternatives for the digit strings of one length from ``lo`` to ``hi`` (``lo`` <= ``hi``)."""
    if not lo:
        return [""]
    rest = len(lo) - 1
    tail = f"[0-9]{{{rest}}}" if rest else ""
    if lo[1:] == "0" * rest and hi[1:] == "9" * rest:
        return [_digits(lo[0], hi[0]) + tail]
    if lo[0] == hi[0]:
        return [lo[0] + r for r in _span(lo[1:], hi[1:])]
    out = [lo[0] + r for r in _span(lo[1:], "9" * rest)]
    if int(hi[0]) - int(lo[0]) > 1:
        out.append(_digits(str(int(lo[0]) + 1), str(int(hi[0]) - 1)) + tail)
    return out + [hi[0] + r for r in _span("0" * rest, hi[1:])]


def _digits(a: str, b: str) -> str:
    return a if a == b else f"[{a}-{b}]"
