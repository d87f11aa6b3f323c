"""Constrained decoding: a per-row token mask from a grammar (JSON schema, regex, choice).

Engine: llguidance, chosen over xgrammar on this project's machines: computing a JSON
schema's mask took 6.5 us per token on the built-in model's 551-token byte-level BPE (a
compact 52-token object), it handled that tokenizer out of the box, and it needs no
Triton; xgrammar pulled in Triton and TVM and refused a valid token sequence of that
tokenizer in a first try. llguidance's own ``apply_token_bitmask_inplace`` (a TorchScript
kernel) cost far more than the mask itself on CPU, so the bitmask is unpacked here with one
vectorized numpy call for all constrained rows of a step. ``bench/serving.py
--structured-only`` reports the mask cost per token and the end-to-end ratio.

A :class:`RowConstraint` belongs to one generated row. It follows the row's history
itself (it consumes the tokens generated since its last call), so the sampler only asks
it to mask a row's logits before the row's token is picked; nothing else in the engine
has to know about it. Once the grammar is complete only end-of-sequence tokens remain.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

import numpy as np
import torch

from kiln.errors import InvalidRequest

MAX_GRAMMAR_CHARS = 200_000  # serialized schema/regex/choices; bounded before compiling
MAX_CACHED_GRAMMARS = 64  # initial matchers kept per compiler, least recently used dropped


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
        self._bases: dict[str, Any] = {}  # grammar -> its initial matcher, least recently used first

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
        """A fresh row state: a copy of the grammar's cached initial matcher (creating a matcher costs
        ~0.5 ms on the built-in model, copying one a few microseconds)."""
        base = self._bases.pop(grammar, None)
        if base is None:
            base = self._ll.LLMatcher(self.tokenizer, grammar)
        self._bases[grammar] = base  # most recently used last
        while len(self._bases) > MAX_CACHED_GRAMMARS:
            self._bases.pop(next(iter(self._bases)))
        return RowConstraint(base.deep_copy(), self.eos_ids)

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
    """One row's grammar state. :meth:`mask_rows` masks the logits of every constrained row of a
    step at once: each row's matcher writes its bitmask (llguidance, ~5-40 us a row), and one
    vectorized unpack turns the bitmasks into ``-inf`` for every forbidden token."""

    def __init__(self, matcher: Any, eos_ids: Sequence[int]):
        self._m = matcher
        self._eos = list(eos_ids)
        self._seen = 0
        self._done_words: np.ndarray | None = None  # the end-tokens-only bitmask, built once
        self.mask_calls = 0

    def _sync(self, generated: Sequence[int]) -> None:
        if len(generated) > self._seen:
            new = list(generated[self._seen:])
            self._seen = len(generated)
            if not self._m.is_error():
                self._m.consume_tokens(new)

    def _fill(self, bitmask: torch.Tensor, j: int, vocab: int) -> None:
        """Row ``j`` of ``bitmask`` (int32 words, bit ``t`` set = token ``t`` allowed)."""
        if self._m.is_error() or self._m.is_stopped():  # done (or broken): only an end token
            if self._done_words is None:
                words = np.zeros(bitmask.shape[1], dtype=np.uint32)
                for e in self._eos:
                    if 0 <= e < vocab:
                        words[e // 32] |= np.uint32(1 << (e % 32))
                self._done_words = words.view(np.int32)
            bitmask.numpy()[j] = self._done_words
            return
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(self._m, bitmask, j)
        self.mask_calls += 1

    @staticmethod
    def mask_rows(logits: torch.Tensor, items: Sequence[tuple[int, "RowConstraint", Sequence[int]]]) -> None:
        """``logits``: ``[rows, vocab]`` float, masked in place; ``items``: (row index, its constraint,
        the row's generated tokens so far)."""
        vocab = logits.shape[-1]
        words = (vocab + 31) // 32
        bitmask = torch.zeros((len(items), words), dtype=torch.int32)
        for j, (_, c, generated) in enumerate(items):
            c._sync(generated)
            c._fill(bitmask, j, vocab)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        forbidden = torch.from_numpy(bits == 0).to(logits.device)
        for j, (i, _, _) in enumerate(items):  # row by row, in place: an index_put of the rows cost ms
            logits[i].masked_fill_(forbidden[j], float("-inf"))

    def apply(self, logits_row: torch.Tensor, generated: Sequence[int]) -> None:
        """One row alone: ``logits_row`` ``[1, vocab]``, masked in place."""
        self.mask_rows(logits_row, [(0, self, generated)])
