"""Reasoning parsers: a model's raw text -> ``reasoning_content`` and ``content``, chosen by name per template family.

As vLLM's ``--reasoning-parser``, ``serving.reasoning_parser`` picks one by name (``auto``: by the chat
template's family, :data:`TEMPLATE_FAMILIES`; ``none``: no parsing). Both parsers shipped read a
``<think>...</think>`` span at the start of the answer:

``qwen3`` (Qwen3, Qwen3.5): the span is reasoning when the answer opens it, or when the prompt left it
open (a template that writes ``<think>`` into the generation prompt); an answer that opens none is all
content, so ``enable_thinking: false`` (whose prompt holds an empty, closed span) gives plain content.

``deepseek_r1`` (DeepSeek-R1 and its distillations): the answer starts inside the span unless the prompt
closed one, so an answer with no ``</think>`` is all reasoning (R1 often omits the opening tag).

The reasoning text is the span's inside without its leading and trailing newlines, and the content is what
follows ``</think>`` without its leading newlines: the same split Qwen3's template applies when it renders
an assistant turn back (``reasoning_content`` in, ``<think>\\n...\\n</think>\\n\\n`` + content out). An empty
part is ``None``. A stream yields the same parts in pieces (:class:`ReasoningStream`); the whole-text split
runs the same state machine, so the two never disagree. Tool-call parsing runs on the content part.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.errors import InvalidRequest
from kiln.runtime.tags import partial_suffix

AUTO, NONE = "auto", "none"
SETTING = "serving.reasoning_parser"
PROMPT_TAIL_TOKENS = 16  # the prompt's last tokens decoded to see whether it leaves a span open


class ReasoningParser:
    name = ""
    START, END = "<think>", "</think>"
    CLOSING = "\n</think>\n\n"  # what a thinking budget writes to close the span (as the templates render it)
    starts_open = False  # the answer begins inside the span unless the prompt closed one

    def opened_by(self, prompt_tail: str) -> bool:
        """Whether an answer that follows ``prompt_tail`` (the rendered prompt's end) starts inside the span."""
        start, end = prompt_tail.rfind(self.START), prompt_tail.rfind(self.END)
        if start < 0 and end < 0:
            return self.starts_open
        return start > end

    def stream(self, opened: bool) -> "ReasoningStream":
        return ReasoningStream(self, opened)

    def split(self, text: str, opened: bool) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a whole answer."""
        st = self.stream(opened)
        r1, c1 = st.feed(text)
        r2, c2 = st.finish()
        return (r1 + r2) or None, (c1 + c2) or None


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_open = True


_START, _THINK, _AFTER, _CONTENT = range(4)


class ReasoningStream:
    """One choice's incremental split: :meth:`feed` each text delta, :meth:`finish` at the end; both return
    ``(reasoning, content)`` text released so far (either may be ""). A possible tag is held back until
    the next text settles it; so are the newlines that may turn out to end the reasoning."""

    def __init__(self, parser: ReasoningParser, opened: bool):
        self._p = parser
        self._state = _THINK if opened else _START
        self._fresh = True  # in _THINK: no reasoning text released yet (its leading newlines are dropped)
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._state == _START:
                head = self._buf.lstrip()
                if head.startswith(self._p.START):
                    self._buf = head[len(self._p.START):]
                    self._state = _THINK
                    continue
                if self._p.START.startswith(head):  # whitespace, or a tag still arriving
                    break
                self._state = _CONTENT
                continue
            if self._state == _THINK:
                if self._fresh:
                    self._buf = self._buf.lstrip("\n")
                    if not self._buf:
                        break
                j = self._buf.find(self._p.END)
                if j >= 0:
                    reasoning.append(self._release(self._buf[:j].rstrip("\n")))
                    self._buf = self._buf[j + len(self._p.END):]
                    self._state = _AFTER
                    continue
                hold = partial_suffix(self._buf, self._p.END)
                body = self._buf[:len(self._buf) - hold]
                kept = body.rstrip("\n")  # newlines that may end the reasoning wait for what follows
                reasoning.append(self._release(kept))
                self._buf = self._buf[len(kept):]
                break
            if self._state == _AFTER:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    break
                self._state = _CONTENT
                continue
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def _release(self, text: str) -> str:
        if text:
            self._fresh = False
        return text

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == _THINK:  # the span never closed: the answer was all reasoning
            return rest.rstrip("\n"), ""
        if self._state == _AFTER:
            return "", rest.lstrip("\n")
        return "", rest


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
}
# template families for ``auto``: markers the chat template writes (all of them) -> the parser, first match
# wins; a template with none of them gets no reasoning parser
TEMPLATE_FAMILIES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("think>", "<｜Assistant｜>"), DeepSeekR1ReasoningParser.name),  # R1 writes <think> or strips </think>
    (("think>",), Qwen3ReasoningParser.name),
)


def check_reasoning_parser_setting(name: str) -> None:
    """Start-up check of ``serving.reasoning_parser``: ConfigError naming the key and the known parsers."""
    if name not in (AUTO, NONE) and name not in REASONING_PARSERS:
        from kiln.config import ConfigError

        raise ConfigError(f"{SETTING} = {name!r} is not a known reasoning parser; use one of "
                          f"{[AUTO, NONE, *sorted(REASONING_PARSERS)]}")


def reasoning_parser_for(setting: str, chat_template: str | None) -> ReasoningParser | None:
    """The parser ``serving.reasoning_parser`` names (``None`` for ``none``), or with ``auto`` the one for
    the template's family (``None`` when the template writes no reasoning span)."""
    check_reasoning_parser_setting(setting)
    if setting == NONE:
        return None
    if setting != AUTO:
        return REASONING_PARSERS[setting]()
    for markers, name in TEMPLATE_FAMILIES:
        if chat_template and all(m in chat_template for m in markers):
            return REASONING_PARSERS[name]()
    return None


def closing_ids(parser: ReasoningParser, tokens: Any) -> list[int]:
    """The token IDs a thinking budget writes to close ``parser``'s span: its :attr:`~ReasoningParser.CLOSING`
    text (else the bare end tag) as the tokenizer encodes it, validated by decoding it back to the same text."""
    for text in (parser.CLOSING, parser.END):
        ids = list(tokens.encode_text(text))
        if ids and tokens.decode(ids) == text:
            return ids
    raise InvalidRequest(f"this tokenizer cannot write {parser.END!r} so that it decodes back to itself, so a "
                         "thinking budget cannot close the reasoning span", code="invalid_request",
                         param="thinking_token_budget", hint="drop thinking_token_budget")


def with_thinking_budget(params: list[Any], parser: ReasoningParser | None, opened: bool, budget: int | None,
                         tokens: Any) -> list[Any]:
    """``params`` (``SamplingParams``) with each row's :class:`~kiln.runtime.thinking.ThinkingBudget`, when it
    has work: a budget to enforce, or a grammar that must wait until a span the prompt opened has closed."""
    if parser is None or (budget is None and not (opened and any(p.constraint is not None for p in params))):
        return params
    from kiln.runtime.thinking import ThinkingBudget

    closing = closing_ids(parser, tokens)
    return [dataclasses.replace(p, constraint=ThinkingBudget(
        budget=budget, opened=opened, closing=closing, start_tag=parser.START, end_tag=parser.END,
        token_text=tokens.token_text, inner=p.constraint)) for p in params]


def prompt_opens_span(parser: ReasoningParser, tokens: Any, prompt_ids: list[int]) -> bool:
    """Whether the answer to ``prompt_ids`` starts inside ``parser``'s span (``tokens``: the engine's
    :class:`~kiln.runtime.tokenization.Tokenization`)."""
    return parser.opened_by(tokens.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:])))
