"""Constrained decoding: a per-row token mask from a grammar (JSON schema, regex, choice).

Engine: llguidance (chosen over xgrammar on this project's machines: 6.5 us per token
to compute the mask on the built-in model's 551-token byte-level BPE, it handled that
tokenizer out of the box, and it needs no Triton; xgrammar pulled in Triton and TVM and
refused a valid token sequence of that tokenizer in a first try). ``bench/serving.py``
reports the mask cost per token on the served model.

A :class:`RowConstraint` belongs to one generated row. It follows the row's history
itself (it consumes the tokens generated since its last call), so the sampler only asks
it to mask a row's logits before the row's token is picked; nothing else in the engine
has to know about it. Once the grammar is complete only end-of-sequence tokens remain.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Sequence

import torch

from kiln.errors import InvalidRequest

MAX_GRAMMAR_CHARS = 200_000  # serialized schema/regex/choices; bounded before compiling


class GrammarCompiler:
    """Compiles request grammars for one tokenizer (built once per served model)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]):
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        eos = sorted(int(e) for e in eos_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size = vocab_size
        self.eos_ids = eos

    def json_schema(self, schema: dict | bool | None, param: str) -> str:
        """``None``: any JSON object (``response_format: json_object``)."""
        if schema is None:
            schema = {"type": "object"}
        text = json.dumps(schema)
        self._bound(text, param)
        try:
            grammar = self._ll.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        except Exception as exc:
            raise InvalidRequest(f"the JSON schema cannot be used for constrained decoding: {exc}",
                                 code="invalid_schema", param=param, hint="send a valid JSON schema") from exc
        return self._validated(grammar, param)

    def regex(self, pattern: str, param: str) -> str:
        self._bound(pattern, param)
        try:
            grammar = self._ll.LLMatcher.grammar_from_regex(pattern)
        except Exception as exc:
            raise InvalidRequest(f"the regex cannot be used for constrained decoding: {exc}", code="invalid_regex",
                                 param=param, hint="send a valid regular expression") from exc
        return self._validated(grammar, param)

    def lark(self, grammar_text: str, param: str) -> str:
        """A Lark grammar in llguidance's dialect (``%json {schema}`` embeds a JSON schema)."""
        self._bound(grammar_text, param)
        try:
            grammar = self._ll.LLMatcher.grammar_from_lark(grammar_text)
        except Exception as exc:
            raise InvalidRequest(f"the grammar cannot be used for constrained decoding: {exc}",
                                 code="invalid_schema", param=param, hint="check the JSON schemas involved") from exc
        return self._validated(grammar, param)

    def choice(self, options: Sequence[str], param: str) -> str:
        return self.regex("(" + "|".join(re.escape(o) for o in options) + ")", param)

    def matcher(self, grammar: str) -> "RowConstraint":
        return RowConstraint(self._ll.LLMatcher(self.tokenizer, grammar), self.eos_ids)

    def _validated(self, grammar: str, param: str) -> str:
        is_error, messages = self._ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise InvalidRequest(f"the grammar is not usable: {'; '.join(messages)}", code="invalid_schema",
                                 param=param, hint="fix or simplify the schema/regex")
        return grammar

    @staticmethod
    def _bound(text: str, param: str) -> None:
        if len(text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"{param} is {len(text)} characters, more than {MAX_GRAMMAR_CHARS}",
                                 code="limit_exceeded", param=param, hint="send a smaller schema")


class RowConstraint:
    """One row's grammar state; :meth:`apply` masks that row's logits in place."""

    def __init__(self, matcher: Any, eos_ids: Sequence[int]):
        self._m = matcher
        self._eos = list(eos_ids)
        self._seen = 0
        self._bitmask: torch.Tensor | None = None
        self._lock = threading.Lock()  # a row is sampled by one thread, but be safe against a retry
        self.mask_calls = 0

    def apply(self, logits_row: torch.Tensor, generated: Sequence[int]) -> None:
        """``logits_row``: ``[1, vocab]`` float, masked in place to the tokens the grammar allows next
        after ``generated`` (the row's output so far)."""
        import llguidance.torch as lt

        with self._lock:
            if len(generated) > self._seen:
                new = list(generated[self._seen:])
                self._seen = len(generated)
                if not self._m.is_error():
                    self._m.consume_tokens(new)
            vocab = logits_row.shape[-1]
            if self._m.is_error() or self._m.is_stopped():
                keep = torch.full((vocab,), float("-inf"), dtype=logits_row.dtype, device=logits_row.device)
                ends = [e for e in self._eos if 0 <= e < vocab]
                keep[ends] = 0.0
                logits_row += keep
                return
            if self._bitmask is None:
                self._bitmask = lt.allocate_token_bitmask(1, vocab)
            lt.fill_next_token_bitmask(self._m, self._bitmask, 0)
            self.mask_calls += 1
            lt.apply_token_bitmask_inplace(logits_row, self._bitmask.to(logits_row.device))
