"""Thinking budgets: request-local decode state that closes an open reasoning span after N reasoning tokens.

A :class:`ThinkingBudget` rides in a row's ``SamplingParams.constraint`` slot (the sampler masks every
constrained row's logits before a token is picked and reports the picked token after), so the engine needs
nothing else. It follows the row's generated tokens: while the reasoning span is open it counts them; once
``budget`` of them were generated and the model has not closed the span itself, it masks every token but
the next of ``closing`` (a tokenizer-validated sequence such as ``"\\n</think>\\n\\n"``) until the whole
sequence is out. Those tokens go through the normal decode path (they are sampled from a one-token mask,
detokenized, counted against ``max_tokens``, reported with their raw logprobs), and the answer continues.

A row that also has a grammar (structured output, forced tool calls) gets it only for the answer: the
grammar sees the tokens after the span closed, so reasoning stays free and the grammar starts where the
answer does. A span counts as open when the prompt left it open (``opened``) or, with no grammar, when the
answer starts with the opening tag (leading whitespace allowed); with a grammar and a closed prompt, the
grammar applies from the first token, as without a budget.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

_START, _OPEN, _ANSWER = range(3)


class ThinkingBudget:
    def __init__(self, *, budget: int | None, opened: bool, closing: Sequence[int], start_tag: str, end_tag: str,
                 token_text: Callable[[int], str], inner: Any = None):
        if not closing:
            raise ValueError("a thinking budget needs a non-empty closing sequence")
        self.budget = budget
        self.closing = list(closing)
        self._start, self._end = start_tag, end_tag
        self._text = token_text
        self.inner = inner
        self._opened = opened
        self._reset()

    def _reset(self) -> None:
        self.phase = _OPEN if self._opened else (_START if self.inner is None else _ANSWER)
        self.answer_at = 0  # where the answer starts in the row's tokens (the grammar's input)
        self.reasoning_tokens = 0
        self._forced = -1 if self.budget is None or self.budget > 0 or self.phase != _OPEN else 0
        self._tail = ""
        self._seen = 0
        self._last: int | None = None

    @property
    def error(self) -> str | None:
        """Why the answer's grammar gave up (the engine then ends the row as an error, not ``stop``)."""
        return getattr(self.inner, "error", None)

    @property
    def forcing(self) -> bool:
        return self._forced >= 0

    def _settle(self, generated: Sequence[int]) -> None:
        """Bring the state to the row's tokens (replayed from the start if the history is not the one seen)."""
        n = len(generated)
        if n < self._seen or (self._seen and generated[self._seen - 1] != self._last):
            self._reset()
        for k in range(self._seen, n):
            self._consume(k, int(generated[k]))
        self._seen = n
        self._last = int(generated[n - 1]) if n else None

    def _consume(self, k: int, tok: int) -> None:
        if self.phase == _START:
            self._tail += self._text(tok)
            head = self._tail.lstrip()
            if head.startswith(self._start):
                self.phase, self._tail = _OPEN, head[len(self._start):]
                self._maybe_force()
            elif not self._start.startswith(head):
                self.phase, self.answer_at = _ANSWER, 0
            return
        if self.phase != _OPEN:
            return
        if self._forced >= 0:
            self._forced += 1
            if self._forced >= len(self.closing):
                self.phase, self.answer_at, self._forced = _ANSWER, k + 1, -1
            return
        self.reasoning_tokens += 1
        self._tail = (self._tail + self._text(tok))[-4 * len(self._end):]
        if self._end in self._tail:  # the model closed the span itself
            self.phase, self.answer_at = _ANSWER, k + 1
            return
        self._maybe_force()

    def _maybe_force(self) -> None:
        if self.budget is not None and self.reasoning_tokens >= self.budget:
            self._forced = 0

    # -- the sampler's constraint interface (kiln.runtime.sampling) ------------------------------------

    @staticmethod
    def mask_rows(logits: torch.Tensor, items: Sequence[tuple[int, "ThinkingBudget", Sequence[int]]]) -> None:
        """``logits``: ``[rows, vocab]``, masked in place; ``items``: (row index, budget, the row's tokens)."""
        grammar: list[tuple[int, Any, Sequence[int]]] = []
        for i, b, generated in items:
            b._settle(generated)
            if b.forcing:
                tok = b.closing[b._forced]
                keep = logits[i, tok].clone()
                logits[i].fill_(float("-inf"))
                logits[i, tok] = keep if torch.isfinite(keep) else 0.0
            elif b.phase == _ANSWER and b.inner is not None:
                grammar.append((i, b.inner, generated[b.answer_at:]))
        if grammar:
            type(grammar[0][1]).mask_rows(logits, grammar)

    @staticmethod
    def advance_rows(items: Sequence[tuple["ThinkingBudget", int]]) -> None:
        """The picked tokens: rows in their answer hand theirs to the grammar (which prefetches its next mask)."""
        grammar = [(b.inner, tok) for b, tok in items if b.inner is not None and b.phase == _ANSWER
                   and not b.forcing and b._seen >= b.answer_at]
        if grammar:
            type(grammar[0][0]).advance_rows(grammar)
