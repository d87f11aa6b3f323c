"""The generation contract of in-process work: prompts and answers as ``/v1/chat/completions`` makes them.

Evals, GRPO rollouts, OPD sampling, judge scoring and OpenEnv actions generate on the serving engine
beside live traffic. A :class:`ChatGeneration` makes them follow the rules of an ordinary chat request:
the prompt is the chat template rendered with the job's ``chat_template_kwargs`` (e.g. Qwen3's
``enable_thinking: false``) by the same ``render_chat`` the route calls; the server's reasoning parser
(``serving.reasoning_parser``, ``auto`` by the template's family: :mod:`kiln.runtime.reasoning`) splits
every answer into its reasoning and its answer; and ``thinking_token_budget`` (omitted: the server's
``serving.thinking_token_budget``; ``None``: unlimited) closes the span the way the route does, through
:func:`~kiln.runtime.reasoning.with_thinking_budget`. Rewards and scorers get the answer, with the
reasoning beside it.

``thinking`` (in :meth:`ChatGeneration.describe`) says whether the rendered prompts leave the model room to
reason: a reasoning parser is in force and the prompt does not close an (empty) span itself, as Qwen3's
``enable_thinking: false`` does. Reports record it with the kwargs and the budget.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Sequence

from pydantic import BaseModel, Field, StringConstraints, field_validator, model_serializer

from kiln.errors import InvalidRequest
from kiln.runtime.reasoning import (PROMPT_TAIL_TOKENS, ReasoningParser, prompt_opens_span, reasoning_parser_for,
                                    with_thinking_budget)

DEFAULT = object()  # thinking_token_budget not given: the server's default

# ``chat_template_kwargs``, as a chat request and a job take them
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_VALUE_CHARS = 256
TemplateKwargName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
TemplateKwargValue = bool | int | float | Annotated[str, StringConstraints(max_length=MAX_TEMPLATE_VALUE_CHARS)] | None
# apply_chat_template's own parameters and the variables it sets itself: a request cannot override them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now", "bos_token",
    "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token", "additional_special_tokens",
})
# the schema states what check_template_kwargs refuses: names outside the pattern, and the reserved names
ChatTemplateKwargs = Annotated[dict[TemplateKwargName, TemplateKwargValue], Field(
    max_length=MAX_TEMPLATE_KWARGS,
    json_schema_extra={"additionalProperties": False,
                       "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}}})]


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A pydantic field validator: names the template sets itself are refused."""
    bad = sorted(set(value or ()) & RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise ValueError(f"chat_template_kwargs cannot set {bad}: the server sets them itself")
    return value


MAX_THINKING_BUDGET = 1_048_576


class ChatGenerationFields(BaseModel):
    """The contract's request fields, for jobs, suites and runs that render prompts and generate (a mixin beside
    the request's own base model): as on ``/v1/chat/completions``."""

    chat_template_kwargs: ChatTemplateKwargs | None = Field(
        None, description="extra chat-template variables for the prompts, as on /v1/chat/completions "
                          "(e.g. Qwen3's enable_thinking: false)")
    thinking_token_budget: int | None = Field(
        None, ge=0, le=MAX_THINKING_BUDGET, description="reasoning tokens a sample may spend before the span is "
        "closed for it; omitted: serving.thinking_token_budget; null: unlimited. Needs a reasoning parser")

    _check_template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @model_serializer(mode="wrap")
    def _dumps_as_before(self, handler: Any) -> Any:
        return dump_as_before(self, handler(self))

    def budget(self) -> Any:
        """``thinking_token_budget``, or :data:`DEFAULT` when it was omitted."""
        return self.thinking_token_budget if "thinking_token_budget" in self.model_fields_set else DEFAULT


class ReasoningLossField(BaseModel):
    """A training job's choice whether the reasoning span carries loss (a mixin, as above)."""

    reasoning_loss: bool = Field(
        True, description="whether the tokens of an answer's reasoning span (<think>...</think>, as the server's "
                          "reasoning parser reads it) carry loss; false: only the answer after the span does")

    @model_serializer(mode="wrap")
    def _dumps_as_before(self, handler: Any) -> Any:
        return dump_as_before(self, handler(self))


def dump_as_before(model: BaseModel, out: Any) -> Any:
    """The contract's fields left at their defaults dump as before they existed (digests of stored suites and
    plans do not change); an omitted budget stays omitted (the server default), an explicit null (unlimited) not."""
    if isinstance(out, dict):
        if out.get("chat_template_kwargs", "") is None:
            out.pop("chat_template_kwargs")
        if "thinking_token_budget" in out and "thinking_token_budget" not in model.model_fields_set:
            out.pop("thinking_token_budget")
        if out.get("reasoning_loss") is True:
            out.pop("reasoning_loss")
    return out


@dataclasses.dataclass(frozen=True)
class Answer:
    """One generated answer: ``content`` (what rewards and scorers read) and ``reasoning`` beside it."""

    content: str
    reasoning: str | None
    text: str  # the raw text, reasoning span included


@dataclasses.dataclass(frozen=True)
class ChatGeneration:
    engine: Any  # the serving engine: render_chat, encode_text, decode, token_text, chat_template
    parser: ReasoningParser | None
    template_kwargs: dict[str, Any] | None = None
    budget: int | None = None

    @classmethod
    def for_engine(cls, engine: Any, serving: Any, template_kwargs: dict[str, Any] | None = None,
                   budget: Any = DEFAULT, *, param: str = "thinking_token_budget") -> "ChatGeneration":
        """The contract for ``engine`` under the server's ``[serving]`` settings (``serving``), with a job's
        ``template_kwargs`` and ``budget`` (:data:`DEFAULT`: ``serving.thinking_token_budget``)."""
        parser = reasoning_parser_for(serving.reasoning_parser, getattr(engine, "chat_template", None))
        if budget is DEFAULT:
            budget = serving.thinking_token_budget if parser is not None else None
        elif budget is not None and parser is None:
            raise InvalidRequest("thinking_token_budget needs a reasoning parser, and this server has none for its "
                                 "chat template", code="invalid_request", param=param,
                                 hint="drop thinking_token_budget, or start the server with --reasoning-parser")
        return cls(engine, parser, dict(template_kwargs) if template_kwargs else None, budget)

    def prompt_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The chat's prompt tokens, rendered with the job's template kwargs (a template error is a 400)."""
        try:
            text = self.engine.render_chat(list(messages), None, self.template_kwargs)
        except Exception as exc:  # template errors are the caller's input
            raise InvalidRequest(f"the chat template could not render these messages: {exc}", code="template_error",
                                 hint="check message roles and chat_template_kwargs") from exc
        return list(self.engine.encode_text(text))

    def opened(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the answer to ``prompt_ids`` starts inside the reasoning span."""
        return self.parser is not None and prompt_opens_span(self.parser, self.engine, list(prompt_ids))

    def thinking(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt leaves the model room to reason (see the module docstring)."""
        if self.parser is None:
            return False
        tail = self.engine.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]))
        start, end = tail.rfind(self.parser.START), tail.rfind(self.parser.END)
        return not (end >= 0 and end > start)

    def opening(self, prompt_ids: Sequence[int]) -> list[int]:
        """``prompt_ids`` with the reasoning span opened (its start tag appended) when the prompt leaves room to
        reason and does not open the span itself: for a grammar that must wait until the reasoning ends (a
        grammar over a prompt that does not open the span applies from the first token)."""
        ids = list(prompt_ids)
        if self.parser is None or not self.thinking(ids) or self.opened(ids):
            return ids
        return ids + list(self.engine.encode_text(self.parser.START))

    def constrain(self, params: list[Any], prompt_ids: Sequence[int]) -> list[Any]:
        """``params`` (``SamplingParams``, one per row of this prompt) with the thinking budget applied."""
        return with_thinking_budget(params, self.parser, self.opened(prompt_ids), self.budget, self.engine)

    def split(self, text: str, prompt_ids: Sequence[int]) -> Answer:
        """The answer's content and reasoning, as the chat route returns them (the whole text as content when
        no reasoning parser is in force)."""
        if self.parser is None:
            return Answer(text, None, text)
        reasoning, content = self.parser.split(text, self.opened(prompt_ids))
        return Answer(content or "", reasoning, text)

    def answer_mask(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[int]:
        """Per completion token: 0 inside the reasoning span (its closing tag included), 1 after it. All ones
        when no reasoning parser is in force or the answer has no span; all zeros when the span never closed."""
        ids = list(completion_ids)
        if self.parser is None or not ids:
            return [1] * len(ids)
        text = self.engine.decode(ids)
        if self.split(text, prompt_ids).reasoning is None and self.parser.END not in text:
            return [1] * len(ids)
        if self.parser.END not in text:
            return [0] * len(ids)
        lo, hi = 1, len(ids)  # the shortest prefix whose text holds the closing tag
        while lo < hi:
            mid = (lo + hi) // 2
            if self.parser.END in self.engine.decode(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return [0] * lo + [1] * (len(ids) - lo)

    def describe(self, prompts: Sequence[Sequence[int]] = ()) -> dict[str, Any]:
        """What a report records about how it generated."""
        return {"reasoning_parser": None if self.parser is None else self.parser.name,
                "chat_template_kwargs": self.template_kwargs, "thinking_token_budget": self.budget,
                "thinking": any(self.thinking(p) for p in prompts) if prompts else self.parser is not None}
