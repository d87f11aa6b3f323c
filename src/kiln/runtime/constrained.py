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
itself (it checks the row's tokens against what it consumed and replays on a mismatch),
so the sampler only asks it to mask a row's logits before the row's token is picked and
tells it the picked tokens after; nothing else in the engine has to know about it. Once the grammar is complete only end-of-sequence tokens remain.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch

from kiln.errors import InvalidRequest

MAX_GRAMMAR_CHARS = 200_000  # serialized schema/regex/choices; bounded before compiling
MAX_CACHED_GRAMMARS = 64  # initial matchers kept per compiler, least recently used dropped

log = logging.getLogger(__name__)


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
        return RowConstraint(base.deep_copy(), base, self.eos_ids, self.vocab_size)

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
    """One row's grammar state.

    The sampler calls :meth:`mask_rows` for every constrained row of a step before the
    tokens are picked, and :meth:`advance_rows` with the picked tokens after. ``advance_rows``
    hands the matchers to one background thread (:class:`_MaskWorker`) that consumes each
    row's token and computes its next bitmask while the model runs the next forward
    (llguidance releases the GIL), so at the next step ``mask_rows`` usually finds every mask
    ready (a job the worker has not started by then is cancelled and done in line: on a busy
    machine a thread's wake-up can take longer than the forward) and only unpacks them (one numpy call) and masks the logits (one in-place fill when
    every row is constrained). A row whose history is not what was consumed (a token picked
    but not kept) is replayed from the grammar's initial state, so the result never depends
    on the prefetch; without ``advance_rows`` the masks are computed on the caller's thread.
    """

    def __init__(self, matcher: Any, initial: Any, eos_ids: Sequence[int], vocab_size: int):
        self._m = matcher
        self._initial = initial  # the grammar's initial matcher (read-only here): replay source
        self._eos = list(eos_ids)
        self._words = (vocab_size + 31) // 32  # bitmask width (int32 words) of the grammar's vocabulary
        self._seen = 0  # tokens of the row's history consumed (or being consumed) by the matcher
        self._last: int | None = None  # the last of them: checked against the history
        self._prev_last: int | None = None  # the one before the token handed to the worker
        self._ready: np.ndarray | None = None  # the bitmask after ``_seen`` tokens, when prefetched
        self._job: Future | None = None  # the worker's job that consumes the last token and fills _ready
        self._done_words: np.ndarray | None = None  # the end-tokens-only bitmask, built once
        self.mask_calls = 0  # masks computed while the grammar was live (not complete)

    def _settle(self, generated: Sequence[int]) -> None:
        """Wait for this row's prefetch, then make the matcher's history equal ``generated``."""
        job, self._job = self._job, None
        if job is not None:
            if job.cancel():  # the worker has not started it (a busy machine): the token is consumed here
                self._seen, self._last = self._seen - 1, self._prev_last
            else:
                try:
                    job.result()
                except Exception:  # a failed prefetch costs a replay, nothing else
                    log.exception("grammar prefetch failed; replaying the row's tokens")
                    self._seen, self._last = -1, None
        n = len(generated)
        diverged = self._seen > 0 and (n < self._seen or generated[self._seen - 1] != self._last)
        if diverged or self._seen < 0:
            self._m, self._seen, self._ready = self._initial.deep_copy(), 0, None
        if n > self._seen:
            new = list(generated[self._seen:])
            self._seen, self._ready = n, None
            if not self._m.is_error():
                self._m.consume_tokens(new)
        self._last = generated[n - 1] if n else None

    def _write(self, bitmask: np.ndarray, j: int, ptr: int) -> None:
        """Row ``j`` of ``bitmask`` (int32 words, bit ``t`` set = token ``t`` allowed; ``ptr``: its address)."""
        if self._ready is not None:
            bitmask[j] = self._ready
            self._ready = None
        elif self._m.is_stopped():  # done (or broken: is_stopped includes errors): only an end token
            if self._done_words is None:
                words = np.zeros(self._words, dtype=np.uint32)
                for e in self._eos:
                    if 0 <= e < 32 * self._words:
                        words[e // 32] |= np.uint32(1 << (e % 32))
                self._done_words = words.view(np.int32)
            bitmask[j] = self._done_words
        else:
            self._m.unsafe_compute_mask_ptr(ptr, 4 * self._words)
            self.mask_calls += 1

    @staticmethod
    def mask_rows(logits: torch.Tensor, items: Sequence[tuple[int, "RowConstraint", Sequence[int]]]) -> None:
        """``logits``: ``[rows, vocab]`` float, masked in place; ``items``: (row index, its constraint,
        the row's generated tokens so far), in ascending row order."""
        rows, vocab = logits.shape
        words = max(c._words for _, c, _ in items)
        bitmask = np.zeros((len(items), words), dtype=np.int32)
        base = bitmask.ctypes.data  # once: ndarray.ctypes costs microseconds
        for j, (_, c, generated) in enumerate(items):
            c._settle(generated)
            c._write(bitmask, j, base + 4 * words * j)
        # set bit = forbidden; tokens past the grammar's vocabulary (count > 32 * words) unpack as forbidden too
        np.invert(bitmask, out=bitmask)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
        if vocab > 32 * words:
            bits[:, 32 * words:] = 1
        forbidden = torch.from_numpy(bits).view(torch.bool).to(logits.device)
        if len(items) == rows:  # every row constrained (ascending, unique): one fill for the batch
            logits.masked_fill_(forbidden, float("-inf"))
            return
        for j, (i, _, _) in enumerate(items):  # row by row, in place: an index_put of the rows cost ms
            logits[i].masked_fill_(forbidden[j], float("-inf"))

    @staticmethod
    def advance_rows(items: Sequence[tuple["RowConstraint", int]]) -> None:
        """The token each row picked: consumed, and the row's next mask computed, on the worker
        thread, while the caller goes on. Never raises (a row then computes its mask in line)."""
        batch = []
        for c, tok in items:
            if c._job is not None:  # not masked since its last advance: no prefetch to build on
                continue
            c._seen += 1
            c._prev_last, c._last = c._last, tok
            c._ready = None
            batch.append((c, tok))
        if not batch:
            return
        try:
            job = _worker().submit(_advance, batch)
        except Exception:  # shutting down: each row replays its history at its next mask
            log.warning("grammar prefetch unavailable; masks computed in line", exc_info=True)
            for c, _ in batch:
                c._seen = -1
            return
        for c, _ in batch:
            c._job = job

    def apply(self, logits_row: torch.Tensor, generated: Sequence[int]) -> None:
        """One row alone: ``logits_row`` ``[1, vocab]``, masked in place."""
        self.mask_rows(logits_row, [(0, self, generated)])


def _advance(batch: Sequence[tuple[RowConstraint, int]]) -> None:
    """Worker thread: consume each row's token, then compute the live rows' next masks."""
    live = []
    for c, tok in batch:
        m = c._m
        if not m.is_error():
            m.consume_token(tok)
        if not m.is_stopped():
            live.append(c)
    if not live:
        return
    words = live[0]._words
    bitmask = np.empty((len(live), words), dtype=np.int32)
    base = bitmask.ctypes.data
    for j, c in enumerate(live):
        c._m.unsafe_compute_mask_ptr(base + 4 * words * j, 4 * words)
        c.mask_calls += 1
        c._ready = bitmask[j]


class _MaskWorker:
    """The one thread that advances matchers for :meth:`RowConstraint.advance_rows`."""

    _lock = threading.Lock()
    _pool: ThreadPoolExecutor | None = None

    @classmethod
    def get(cls) -> ThreadPoolExecutor:
        with cls._lock:
            if cls._pool is None:
                cls._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-grammar")
            return cls._pool


def _worker() -> ThreadPoolExecutor:
    return _MaskWorker.get()
