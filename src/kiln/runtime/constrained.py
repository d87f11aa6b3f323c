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

import asyncio
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from kiln.errors import InvalidRequest, Unavailable

MAX_GRAMMAR_CHARS = 200_000  # serialized schema/regex/choices; bounded before compiling
MAX_CACHED_GRAMMARS = 64  # compiled grammars kept per compiler (and at most GRAMMAR_CACHE_BYTES of them)
GRAMMAR_CACHE_BYTES = 64 << 20  # estimated resident bytes of the cached grammars, least recently used dropped
COMPILE_TIMEOUT_S = 2.0  # a request's grammar compilation (queue wait included) past this is refused
MAX_PENDING_COMPILES = 8  # compilations queued on the one compile thread; more are refused with 503
PROBE_TOKENS = 32  # tokens a new grammar is walked at compile time (lowest allowed token each step)
# llguidance's resource limits (its defaults: 1e6, 2e5, 250k states, 5e5 symbols). A counted repetition
# such as ``(y{1000}){1000}`` spends the initial fuel building its regex: at the default 1e6 it took
# 2.2 s and ~200 MB on this project's machines, at 1e5 ~40 ms and ~20 MB. Realistic schemas (nested
# pydantic models with $defs, formats, maxLength 10000, 200 properties) need < 1e5 on Qwen3's vocabulary.
INITIAL_LEXER_FUEL = 100_000
STEP_LEXER_FUEL = 200_000  # one mask (~14 ms at most): a 150k-token vocabulary's masks need most of it
MAX_LEXER_STATES = 20_000  # ~1-2 kB each: ~40 MB per grammar at most
MAX_GRAMMAR_SIZE = 200_000  # symbols in the grammar's productions

log = logging.getLogger(__name__)


class NoValidOutput(InvalidRequest):
    """The request's own constraints exclude every token (a grammar and ``bad_words``, say): not a resource
    limit of the grammar, a contradiction in the request (400 ``no_valid_output``)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message, code="no_valid_output", param=param,
                         hint="drop the bad_words (or logit_bias) that forbid what the grammar requires, or "
                              "widen the grammar")


class GrammarTooComplex(InvalidRequest):
    """The grammar hit a resource limit (compile time, lexer fuel, states, items): a 400 naming it."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message, code="grammar_too_complex", param=param,
                         hint="simplify the schema/regex (nested counted repetitions such as (a{100}){100}, "
                              "deep recursion or huge alternations)")


def _allowed_tokens(m: Any, vocab_size: int) -> np.ndarray:
    """The token IDs matcher ``m`` allows next (one mask computation)."""
    words = (vocab_size + 31) // 32
    mask: Any = np.zeros(words, dtype=np.int32)
    m.unsafe_compute_mask_ptr(mask.ctypes.data, 4 * words)
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), count=vocab_size, bitorder="little"))


def _first_line(text: str) -> str:
    return (text or "").strip().split("\n", 1)[0][:300]


class CompiledGrammar:
    """A grammar built and probed once: its initial matcher, copied for every row that uses it."""

    __slots__ = ("grammar", "base", "nbytes", "_compiler")

    def __init__(self, grammar: str, base: Any, nbytes: int, compiler: "GrammarCompiler"):
        self.grammar, self.base, self.nbytes, self._compiler = grammar, base, nbytes, compiler

    def first_tokens(self) -> tuple[set[int], bool]:
        """The tokens the grammar allows first, end tokens left out, and whether an end token is allowed
        there too (an empty output is valid)."""
        c = self._compiler
        allowed = set(_allowed_tokens(self.base.deep_copy(), c.vocab_size).tolist())
        ends = allowed & set(c.eos_ids)
        return allowed - ends, bool(ends)

    def row(self) -> "RowConstraint":
        """A fresh row state: a copy of the initial matcher (a few microseconds; creating one ~0.5 ms)."""
        c = self._compiler
        return RowConstraint(self.base.deep_copy(), self.base, c.eos_ids, c.vocab_size)


class GrammarCompiler:
    """Compiles request grammars for one tokenizer (built once per served model).

    ``json_schema``/``regex``/``lark``/``choice`` turn a request's constraint into llguidance
    grammar text (checked, cheap); :meth:`prepare` builds its matcher under llguidance's resource
    limits and walks it a few tokens (a grammar that fails there, or admits no output, is a 400
    before any generation) and caches it, bounded by count and estimated bytes. The HTTP layer
    calls :meth:`compile`, which does all of that on one compile thread with a deadline, so a
    grammar never runs on the event loop or the engine's thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int], *,
                 timeout_s: float = COMPILE_TIMEOUT_S, cache_bytes: int = GRAMMAR_CACHE_BYTES):
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        eos = sorted(int(e) for e in eos_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size = vocab_size
        self.eos_ids = eos
        self.timeout_s, self.cache_bytes = timeout_s, cache_bytes
        self._limits = llguidance.LLParserLimits(
            initial_lexer_fuel=INITIAL_LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL,
            max_lexer_states=MAX_LEXER_STATES, max_grammar_size=MAX_GRAMMAR_SIZE, verbose_errors=False)
        self._cache: dict[str, CompiledGrammar] = {}  # grammar -> compiled, least recently used first
        self._cached_bytes = 0
        self._lock = threading.Lock()  # the cache: prepare runs on the compile thread and in line
        self._pending = 0  # compilations submitted and not finished (event loop only)
        self.observer: Callable[[str, float], None] | None = None  # e.g. Metrics.grammar_compile

    # -- request constraint -> grammar text ----------------------------------------------------

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

    # -- grammar text -> probed matcher ----------------------------------------------------------

    async def compile(self, build: Callable[[], str], param: str) -> CompiledGrammar:
        """``build()`` (one of the methods above) then :meth:`prepare`, on the compile thread, within
        ``timeout_s`` (queue wait included). Refused with 503 when too many wait, 400 past the deadline.
        ``observer(outcome, seconds)``, when set, sees each call (compiled, cached, refused, timeout, busy)."""
        t0 = time.perf_counter()
        if self._pending >= MAX_PENDING_COMPILES:
            self._observe("busy", t0)
            raise Unavailable(f"{self._pending} grammar compilations are already waiting (at most "
                              f"{MAX_PENDING_COMPILES})", code="grammar_compile_busy", retry_after=1,
                              hint="retry shortly; repeated schemas are cached after their first compilation")
        self._pending += 1

        job = _compile_pool().submit(lambda: self._prepare(build(), param))
        try:
            compiled, hit = await asyncio.wait_for(asyncio.wrap_future(job), self.timeout_s)
        except TimeoutError:
            self._observe("timeout", t0)
            job.cancel()  # not started yet: never runs; running: bounded by the lexer fuel, its result dropped
            raise GrammarTooComplex(f"compiling {param} took longer than the grammar compile limit "
                                    f"({self.timeout_s:g} s, limits.grammar_compile_timeout_s)", param) from None
        except InvalidRequest:
            self._observe("refused", t0)
            raise
        finally:
            self._pending -= 1
        self._observe("cached" if hit else "compiled", t0)
        return compiled

    def _observe(self, outcome: str, t0: float) -> None:
        if self.observer is not None:
            self.observer(outcome, time.perf_counter() - t0)

    def prepare(self, grammar: str, param: str = "grammar") -> CompiledGrammar:
        """The grammar's matcher, from the cache or built, probed and cached (any thread)."""
        return self._prepare(grammar, param)[0]

    def _prepare(self, grammar: str, param: str) -> tuple[CompiledGrammar, bool]:
        """:meth:`prepare`, and whether the cache had it."""
        with self._lock:
            hit = self._cache.pop(grammar, None)
            if hit is not None:
                self._cache[grammar] = hit  # most recently used last
                return hit, True
        before = _rss_bytes()
        base = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        self._probe(base, param)
        nbytes = max(_rss_bytes() - before, 64 << 10) + len(grammar)
        compiled = CompiledGrammar(grammar, base, nbytes, self)
        with self._lock:
            if nbytes <= self.cache_bytes and grammar not in self._cache:
                self._cache[grammar] = compiled
                self._cached_bytes += nbytes
                while len(self._cache) > MAX_CACHED_GRAMMARS or self._cached_bytes > self.cache_bytes:
                    self._cached_bytes -= self._cache.pop(next(iter(self._cache))).nbytes
        return compiled, False

    def matcher(self, grammar: str) -> "RowConstraint":
        """A fresh row state for ``grammar`` (prepared in line on the caller's thread)."""
        return self.prepare(grammar).row()

    @property
    def cached(self) -> tuple[int, int]:
        """(grammars, estimated bytes) in the cache."""
        with self._lock:
            return len(self._cache), self._cached_bytes

    def _probe(self, base: Any, param: str) -> None:
        """Walk a copy of ``base`` up to :data:`PROBE_TOKENS` tokens (the lowest allowed non-end token
        each step): an error there (a resource limit, or a schema that admits nothing, such as
        ``{"$ref": "#"}``) is refused now instead of ending a generation with invalid output."""
        m = base.deep_copy()
        eos = sorted(self.eos_ids)
        for step in range(PROBE_TOKENS):
            allowed = _allowed_tokens(m, self.vocab_size)
            if m.is_error() or m.is_stopped():
                break
            allowed = np.setdiff1d(allowed, eos)
            if not len(allowed):
                if step == 0 and not m.is_accepting():
                    raise GrammarTooComplex(f"{param} admits no output", param)
                break
            m.consume_token(int(allowed[0]))
        if m.is_error():
            raise GrammarTooComplex(f"{param} cannot be used for constrained decoding: "
                                    f"{_first_line(m.get_error())} (limits: lexer fuel {INITIAL_LEXER_FUEL}, "
                                    f"{MAX_LEXER_STATES} lexer states, grammar size {MAX_GRAMMAR_SIZE})", param)

    def _validated(self, grammar: str, param: str) -> str:
        is_error, messages = self._ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer,
                                                                               limits=self._limits)
        if is_error:
            raise InvalidRequest(f"the grammar is not usable: {'; '.join(messages)}", code="invalid_schema",
                                 param=param, hint="fix or simplify the schema/regex")
        return grammar

    @staticmethod
    def _bound(text: str, param: str) -> None:
        if len(text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"{param} is {len(text)} characters, more than {MAX_GRAMMAR_CHARS}",
                                 code="limit_exceeded", param=param, hint="send a smaller schema")


def _rss_bytes() -> int:
    """This process's resident set (Linux ``/proc``; 0 elsewhere): a grammar's cache estimate is the
    growth across its build on the one compile thread."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class RowConstraint:
    """One row's grammar state.

    The sampler calls :meth:`mask_rows` for every constrained row of a step before the
    tokens are picked, and :meth:`advance_rows` with the picked tokens after. ``advance_rows``
    hands the matchers to one background thread (``_worker``) that consumes each
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
        self.error: str | None = None  # why the grammar engine gave up on this row (it then allows only the end)

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
            self._note_error()
            if self._done_words is None:
                words: Any = np.zeros(self._words, dtype=np.uint32)
                for e in self._eos:
                    if 0 <= e < 32 * self._words:
                        words[e // 32] |= np.uint32(1 << (e % 32))
                self._done_words = words.view(np.int32)
            bitmask[j] = self._done_words
        else:
            self._m.unsafe_compute_mask_ptr(ptr, 4 * self._words)
            self.mask_calls += 1
            self._note_error()

    def _note_error(self) -> None:
        """Record why the grammar engine gave up (its mask then allows only the end token), once."""
        if self.error is None and self._m.is_error():
            self.error = _first_line(self._m.get_error()) or "the grammar engine stopped"

    @staticmethod
    def mask_rows(logits: torch.Tensor, items: Sequence[tuple[int, "RowConstraint", Sequence[int]]]) -> None:
        """``logits``: ``[rows, vocab]`` float, masked in place; ``items``: (row index, its constraint,
        the row's generated tokens so far), in ascending row order."""
        rows, vocab = logits.shape
        words = max(c._words for _, c, _ in items)
        bitmask: Any = np.zeros((len(items), words), dtype=np.int32)
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
    bitmask: Any = np.empty((len(live), words), dtype=np.int32)
    base = bitmask.ctypes.data
    for j, c in enumerate(live):
        c._m.unsafe_compute_mask_ptr(base + 4 * words * j, 4 * words)
        c.mask_calls += 1
        c._note_error()
        c._ready = bitmask[j]


class _OneThread:
    """A lazily started single-thread pool (one per use, named by ``prefix``)."""

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._prefix)
            return self._pool


_worker = _OneThread("kiln-grammar")  # advances matchers for RowConstraint.advance_rows
_compile_pool = _OneThread("kiln-grammar-compile")  # GrammarCompiler.compile: off the loop and the engine
