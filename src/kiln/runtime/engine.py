"""The batching engine: one actor thread runs continuous batching over the HF model.

Each scheduling cycle spends a token budget (``batching.token_budget``) in this
order: one decode token for every decoding row, then the next chunk of prompts
whose prefill is already under way (rotating, so one long prompt cannot hog the
cycles), then the first chunk of newly admitted rows while slots and budget last.
All decoding rows advance in ONE batched forward; all prefill chunks of the cycle
go in one more (right-padded). Rows join and leave between cycles.

When a cycle has prompt chunks, decode tokens and chunks are usually packed into
ONE forward instead (a batch of one sequence, no padding, a mask that keeps every
token to its own row's cache); that saves a forward's fixed cost per cycle, which
dominates on small models.

KV state lives in a preallocated :class:`~kiln.runtime.kv_slots.SlotKV`; decoding
rows are kept in slots ``0..n-1`` so the decode step reads a view, and every row
carries its own positions and attention mask. Each forward runs under shared
accelerator ownership; adapter changes and training steps take it exclusively,
so they land between two steps.

A row is *active* from admission until its cleanup (slot freed, adapter reference
dropped, final event delivered) is done; ``stats()["active_rows"]`` counts exactly
that, so a zero means nothing is held. Cancellation (``Submission.cancel``) is
settled by the actor at the next cycle boundary.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from kiln.errors import Internal, InvalidRequest, RateLimited, Unavailable
from kiln.runtime.adapter_slots import (
    BASE_KEY,
    AdapterError,
    AdapterSlots,
    UnknownAdapter,
)
from kiln.runtime.kv_slots import SlotKV, cache_shape
from kiln.runtime.ownership import AcceleratorOwnership
from kiln.runtime.sampling import (
    SamplingParams,
    TokenChoice,
    make_generator,
    select_tokens,
)
from kiln.runtime.scoring import PromptLogprobRow, prompt_logprob_rows
from kiln.runtime.textstream import TextStream

log = logging.getLogger("kiln.engine")

CANARY_TOKENS = 4
PACKED_MAX_SCORES = 1 << 21  # tokens x rows x kv_len above which a mixed cycle uses two forwards
CANARY_MESSAGE = "Hello"
JOIN_TIMEOUT_S = 30.0
ENCODE_HOLDING_GIL_MAX_CHARS = 1000  # ~1 ms of tokenizing at most while holding the GIL

__all__ = [
    "AdapterError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineOverloaded",
    "EngineNotRunning",
    "PromptTooLong",
    "RowStream",
    "Submission",
    "UnknownAdapter",
]


class EngineError(Internal):
    """The engine failed while running a request."""

    code = "engine_error"
    default_hint = "see the server log; GET /health"


class EngineOverloaded(RateLimited):
    """The waiting queue is full; retry later."""

    code = "overloaded"
    default_hint = "retry after a short wait"


class EngineNotRunning(Unavailable):
    """The engine is stopped or failed; restart the server."""

    code = "engine_unavailable"
    default_hint = "check GET /health; restart the server"


class PromptTooLong(InvalidRequest):
    """Prompt plus requested tokens exceed the model length limit."""

    code = "context_length_exceeded"
    default_hint = "shorten the prompt or lower max_tokens"


@dataclass(frozen=True)
class EngineConfig:
    token_budget: int = 512
    max_running_rows: int = 32
    max_queued_rows: int = 256
    prefill_chunk_tokens: int = 256
    max_model_len: int = 2048

    @classmethod
    def from_settings(cls, settings: Any) -> "EngineConfig":
        b = settings.batching
        return cls(
            token_budget=b.token_budget,
            max_running_rows=b.max_running_rows,
            max_queued_rows=b.max_queued_rows,
            prefill_chunk_tokens=b.prefill_chunk_tokens,
            max_model_len=settings.limits.max_model_len,
        )


class Observer:
    """Metrics hooks the engine calls from its thread (no-ops by default)."""

    def first_token(self, ttft_s: float) -> None: ...

    def inter_token(self, itl_s: float) -> None: ...

    def tokens_generated(self, count: int) -> None: ...


# -- consumer side ---------------------------------------------------------------


@dataclass
class StreamChunk:
    """What a consumer gets from one drain: new text, the tokens behind it, and the end (if reached)."""

    text: str = ""
    tokens: list[TokenChoice] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort | error


class RowStream:
    """One generated sequence (one choice), written by the engine thread, read by one consumer."""

    def __init__(self, index: int, loop: asyncio.AbstractEventLoop | None, event: asyncio.Event | None = None,
                 incremental: bool = True):
        self.index = index
        self.loop = loop
        self.incremental = incremental  # False: the consumer is woken only when the row ends
        self._lock = threading.Lock()
        self._text: list[str] = []
        self._tokens: list[TokenChoice] = []
        self._finish: str | None = None
        self._delivered_finish = False
        # one event may be shared by all streams of a submission, so a consumer can wait on any of them
        self._aevent = event if event is not None else (asyncio.Event() if loop is not None else None)
        self._tevent = threading.Event()
        self.prompt_tokens = 0
        self.completion_tokens = 0

    # engine thread
    def _push(self, text: str, choice: TokenChoice | None) -> None:
        with self._lock:
            if text:
                self._text.append(text)
            if choice is not None:
                self._tokens.append(choice)

    def _close(self, reason: str) -> None:
        with self._lock:
            self._finish = reason

    def _wake(self) -> None:  # on the consumer's loop (async) or any thread (sync)
        if self._aevent is not None:
            self._aevent.set()
        self._tevent.set()

    # consumer
    def _take(self) -> StreamChunk | None:
        with self._lock:
            if not self._text and not self._tokens and (self._finish is None or self._delivered_finish):
                return None
            chunk = StreamChunk("".join(self._text), self._tokens, self._finish)
            self._text, self._tokens = [], []
            if self._finish is not None:
                self._delivered_finish = True
            return chunk

    @property
    def finished(self) -> bool:
        return self._delivered_finish

    async def next_chunk(self) -> StreamChunk:
        """Wait for new output (async consumers; the stream must be bound to this loop)."""
        assert self._aevent is not None
        while True:
            self._aevent.clear()
            chunk = self._take()
            if chunk is not None:
                return chunk
            await self._aevent.wait()

    def next_chunk_sync(self, timeout: float | None = None) -> StreamChunk | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._tevent.clear()
            chunk = self._take()
            if chunk is not None:
                return chunk
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self._tevent.wait(left)


@dataclass
class Submission:
    streams: list[RowStream]
    adapter: str | None
    adapter_revision: str | None
    prompt_tokens: int
    _rows: list["_Row"] = field(default_factory=list, repr=False)
    _engine: "Engine | None" = field(default=None, repr=False)

    def cancel(self) -> None:
        """Abort every unfinished row of this submission (idempotent, any thread)."""
        if self._engine is not None:
            self._engine._cancel(self._rows)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    async def next_chunks(self) -> list[tuple[int, StreamChunk]]:
        """Wait until any choice has new output; ``(choice index, chunk)`` pairs, ``[]`` once all ended."""
        event = self.streams[0]._aevent
        assert event is not None, "submit(..., loop=...) binds the streams to an event loop"
        while not self.finished:
            event.clear()
            out = [(s.index, c) for s in self.streams if (c := s._take()) is not None]
            if out:
                return out
            await event.wait()
        return []


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    tokens: list[TokenChoice]


# -- engine internals --------------------------------------------------------------


class _Row:
    __slots__ = (
        "stream", "prompt", "params", "gen", "adapter_key", "slot", "prefilled", "pos", "generated",
        "text", "cancelled", "t_submit", "t_last", "eos_ids",
    )

    def __init__(self, stream, prompt, params, gen, adapter_key, text, eos_ids):
        self.stream: RowStream = stream
        self.prompt: list[int] = prompt
        self.params: SamplingParams = params
        self.gen = gen
        self.adapter_key: str = adapter_key
        self.slot = -1
        self.prefilled = 0
        self.pos = 0  # tokens held in the cache
        self.generated: list[int] = []
        self.text: TextStream = text
        self.cancelled = False
        self.t_submit = time.perf_counter()
        self.t_last = 0.0
        self.eos_ids: frozenset[int] = eos_ids


class Engine:
    """Continuous-batching engine over one loaded model (see module docstring)."""

    def __init__(
        self,
        loaded: Any,
        config: EngineConfig | None = None,
        *,
        ownership: AcceleratorOwnership | None = None,
        observer: Observer | None = None,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = config or EngineConfig()
        self.ownership = ownership or AcceleratorOwnership()
        self.observer = observer or Observer()
        self.adapters = AdapterSlots(self.model, self.ownership)
        self.device = loaded.device
        self._dtype = next(self.model.parameters()).dtype
        self._eos = self._eos_ids()
        self._backend = self._backend_tokenizer()
        self._pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        cfg = self.config
        self._kv = SlotKV(
            cache_shape(self.model.config), cfg.max_running_rows + 1, cfg.max_model_len,
            device=self.device, dtype=self._dtype,
        )
        self._spare = cfg.max_running_rows  # the extra slot, used only to swap two rows
        self._cv = threading.Condition()
        self._inbox: collections.deque[_Row] = collections.deque()
        self._jobs: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._cancel_pending = False
        self._waiting: collections.deque[_Row] = collections.deque()
        self._prefilling: list[_Row] = []
        self._decoding: list[_Row] = []  # index == slot
        self._free = set(range(cfg.max_running_rows))
        self._active = 0
        self._queued = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failed: str | None = None
        self._shared_gen = torch.Generator(device=self.device)
        self._shared_gen.manual_seed(int(time.time_ns() % (2**63)))
        self.steps = 0

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(JOIN_TIMEOUT_S)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self._failed is None

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {
                "queued_rows": self._queued,
                "active_rows": self._active,
                "max_running_rows": self.config.max_running_rows,
                "steps": self.steps,
                "kv_cache_bytes": self._kv.nbytes(),
                "failed": self._failed,
            }

    # -- adapters (public API used by training/adapters code) --------------------
    def activate_adapter(self, name: str, path: Path, revision: str) -> None:
        """Load ``path`` as the new revision of served adapter ``name`` (canary-checked, atomic)."""
        self.adapters.activate(name, Path(path), revision, self._canary)

    def deactivate_adapter(self, name: str) -> None:
        self.adapters.deactivate(name)

    def active_adapters(self) -> dict[str, str]:
        return self.adapters.active()

    def peft_model(self) -> Any:
        return self.adapters.peft_model()

    def delete_private_adapter(self, private_name: str) -> None:
        self.adapters.delete_private(private_name)

    def _canary(self, key: str) -> None:
        """Greedy decode a few tokens with adapter ``key``; caller holds exclusive ownership."""
        ids = self.encode_chat([{"role": "user", "content": CANARY_MESSAGE}])
        seq = torch.tensor([ids], device=self.device)
        fm = self.adapters.forward_model
        with torch.inference_mode():
            for _ in range(CANARY_TOKENS):
                logits = fm(input_ids=seq, adapter_names=[key], use_cache=False).logits[:, -1]
                if not torch.isfinite(logits).all():
                    raise AdapterError("canary generation produced non-finite logits")
                seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)

    # -- tokenization helpers ----------------------------------------------------
    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The chat template's text, tokenized as ``apply_chat_template(tokenize=True)`` would."""
        return self.encode_text(
            self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def encode_text(self, text: str) -> list[int]:
        """Short texts go straight to the Rust tokenizer's single ``encode``: ~80 us less than the
        wrapper, and it keeps the GIL (the wrapper's batch encode releases it, and a caller on the
        event loop then waits to win it back from the engine thread). Long texts take the wrapper,
        which lets the engine thread run while they are encoded."""
        if self._backend is not None and len(text) <= ENCODE_HOLDING_GIL_MAX_CHARS:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _backend_tokenizer(self) -> Any:
        """The Rust tokenizer when calling it directly is equivalent to the wrapper, else ``None``."""
        if getattr(self.tokenizer, "split_special_tokens", False):
            return None
        return getattr(self.tokenizer, "backend_tokenizer", None)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gc = getattr(self.model, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    # -- admission ---------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        params: list[SamplingParams],
        *,
        adapter: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        incremental: bool = True,
    ) -> Submission:
        """Queue one row per entry of ``params`` (the ``n`` choices) for ``prompt_ids``.

        ``incremental=False`` suits callers that only want the finished text (non-streaming
        responses, :meth:`generate`): output still accumulates per token, but the consumer
        is woken once per row, at its end, instead of after every step.
        """
        if not self.running:
            raise EngineNotRunning(f"the engine is not running ({self._failed or 'stopped'}); restart the server")
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty; send at least one token")
        need = len(prompt_ids) + max(p.max_tokens for p in params)
        if len(prompt_ids) >= self.config.max_model_len or need > self.config.max_model_len:
            raise PromptTooLong(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max(p.max_tokens for p in params)}) "
                f"exceeds the model length limit of {self.config.max_model_len} tokens; shorten the prompt "
                "or lower max_tokens"
            )
        keys: list[str] = []
        revision = None
        try:
            for _ in params:
                if adapter is None:
                    keys.append(BASE_KEY)
                else:
                    key, revision = self.adapters.acquire(adapter)
                    keys.append(key)
        except UnknownAdapter:
            for k in keys:
                self.adapters.release(k)
            raise
        shared_event = asyncio.Event() if loop is not None else None
        streams = [RowStream(i, loop, shared_event, incremental) for i in range(len(params))]
        rows = [
            _Row(s, list(prompt_ids), p, make_generator(p.seed, self.device), k, TextStream(self.tokenizer, p.stop),
                 self._eos)
            for s, p, k in zip(streams, params, keys)
        ]
        for s in streams:
            s.prompt_tokens = len(prompt_ids)
        with self._cv:
            if self._queued + len(rows) > self.config.max_queued_rows:
                overloaded = True
            else:
                overloaded = False
                self._queued += len(rows)
                self._inbox.extend(rows)
                self._cv.notify_all()
        if overloaded:
            for k in keys:
                if k != BASE_KEY:
                    self.adapters.release(k)
            raise EngineOverloaded(
                f"{self._queued} rows are already queued (limit batching.max_queued_rows="
                f"{self.config.max_queued_rows}); retry later"
            )
        return Submission(streams, adapter, revision, len(prompt_ids), rows, self)

    def _cancel(self, rows: Iterable[_Row]) -> None:
        with self._cv:
            for r in rows:
                r.cancelled = True
            self._cancel_pending = True
            self._cv.notify_all()

    def run_job(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread between two cycles, under shared ownership."""
        fut: Future = Future()
        with self._cv:
            if not self.running:
                raise EngineNotRunning("the engine is not running; restart the server")
            self._jobs.append((fn, fut))
            self._cv.notify_all()
        return fut

    def score_prompt(self, prompt_ids: list[int], top_k: int, *, adapter: str | None = None) -> Future:
        """Future of per-position prompt logprob rows (first ``None``), see :mod:`kiln.runtime.scoring`."""
        if len(prompt_ids) > self.config.max_model_len:
            raise PromptTooLong(
                f"prompt has {len(prompt_ids)} tokens, more than the limit of {self.config.max_model_len}"
            )
        key = self.adapters.acquire(adapter)[0] if adapter is not None else BASE_KEY

        def job() -> list[PromptLogprobRow | None]:
            try:
                ids = torch.tensor([prompt_ids], device=self.device)
                kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
                if self.adapters.wrapped:
                    kwargs["adapter_names"] = [key]
                logits = self.adapters.forward_model(**kwargs).logits[0]
                return prompt_logprob_rows(logits, prompt_ids, top_k)
            finally:
                if key != BASE_KEY:
                    self.adapters.release(key)

        try:
            return self.run_job(job)
        except EngineNotRunning:
            if key != BASE_KEY:
                self.adapters.release(key)
            raise

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams | list[SamplingParams],
        *,
        adapter: str | None = None,
        timeout: float | None = None,
    ) -> list[Completion]:
        """Blocking convenience for in-process callers (training rollouts, evals)."""
        plist = params if isinstance(params, list) else [params]
        sub = self.submit(prompt_ids, plist, adapter=adapter, incremental=False)
        out = []
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for stream, row in zip(sub.streams, sub._rows):
                text, tokens, reason = [], [], None
                while reason is None:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    chunk = stream.next_chunk_sync(left)
                    if chunk is None:
                        raise TimeoutError(f"generation did not finish within {timeout} s")
                    text.append(chunk.text)
                    tokens.extend(chunk.tokens)
                    reason = chunk.finish_reason
                out.append(Completion("".join(text), list(row.generated), reason, tokens))
        finally:
            sub.cancel()
        return out

    # -- the actor -----------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while True:
                with self._cv:
                    while not self._stopping and not self._has_work():
                        self._cv.wait()
                    if self._stopping:
                        break
                    incoming = list(self._inbox)
                    self._inbox.clear()
                    cancels = self._cancel_pending
                    self._cancel_pending = False
                    jobs = list(self._jobs)
                    self._jobs.clear()
                self._waiting.extend(incoming)
                if cancels:
                    self._settle_cancellations()
                for fn, fut in jobs:
                    self._run_job(fn, fut)
                self._cycle()
        except BaseException as exc:  # a bug or a device failure: fail every row, refuse new work
            log.exception("engine actor failed")
            self._failed = f"{type(exc).__name__}: {exc}"
        finally:
            self._abort_all("abort" if self._failed is None else "error")

    def _has_work(self) -> bool:
        return bool(self._inbox or self._jobs or self._cancel_pending or self._waiting or self._prefilling
                    or self._decoding)

    def _run_job(self, fn: Callable[[], Any], fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            with self.ownership.shared(), torch.inference_mode():
                self._ensure_eval()
                fut.set_result(fn())
        except BaseException as exc:  # delivered to the caller
            fut.set_exception(exc)

    def _ensure_eval(self) -> None:
        fm = self.adapters.forward_model
        if fm.training:
            fm.eval()

    def _settle_cancellations(self) -> None:
        touched: list[RowStream] = []
        for row in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(row)
            with self._cv:
                self._queued -= 1
            self._finish(row, "abort", touched, was_active=False)
        for row in [r for r in self._decoding + self._prefilling if r.cancelled]:
            self._finish(row, "abort", touched)
        self._notify(touched)

    def _abort_all(self, reason: str) -> None:
        touched: list[RowStream] = []
        with self._cv:
            incoming = list(self._inbox)
            self._inbox.clear()
            jobs = list(self._jobs)
            self._jobs.clear()
        for _fn, fut in jobs:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineNotRunning("the engine stopped before running this job"))
        for row in incoming + list(self._waiting):
            with self._cv:
                self._queued -= 1
            self._finish(row, reason, touched, was_active=False)
        self._waiting.clear()
        for row in list(self._decoding) + list(self._prefilling):
            self._finish(row, reason, touched)
        self._notify(touched)

    # -- slots -------------------------------------------------------------------------
    def _admit(self, row: _Row) -> None:
        row.slot = max(self._free)
        self._free.discard(row.slot)
        self._prefilling.append(row)
        with self._cv:
            self._queued -= 1
            self._active += 1

    def _to_decoding(self, row: _Row) -> None:
        """Move a row whose prefill just finished into slot ``len(decoding)``."""
        self._prefilling.remove(row)
        target = len(self._decoding)
        if row.slot != target:
            other = next((r for r in self._prefilling if r.slot == target), None)
            if other is not None:  # swap through the spare slot
                self._kv.move(other.slot, self._spare, other.pos)
                self._kv.move(row.slot, target, row.pos)
                self._kv.move(self._spare, row.slot, other.pos)
                other.slot = row.slot
            else:
                self._kv.move(row.slot, target, row.pos)
                self._free.add(row.slot)
                self._free.discard(target)
            row.slot = target
        self._decoding.append(row)

    def _release_slot(self, row: _Row) -> None:
        if row in self._prefilling:
            self._prefilling.remove(row)
            self._free.add(row.slot)
        else:
            last = self._decoding.pop()
            if last is not row:
                self._kv.move(last.slot, row.slot, last.pos)
                last.slot = row.slot
                self._decoding[row.slot] = last
            self._free.add(len(self._decoding))
        row.slot = -1

    def _finish(self, row: _Row, reason: str, touched: list[RowStream], *, was_active: bool = True) -> None:
        """Terminal cleanup: slot, adapter reference, final text; then the row stops counting as active."""
        if was_active and row.slot >= 0:
            self._release_slot(row)
        if row.adapter_key != BASE_KEY:
            try:
                self.adapters.release(row.adapter_key)
            except Exception:  # never let adapter bookkeeping wedge the actor
                log.exception("releasing adapter %s failed", row.adapter_key)
        tail = row.text.flush()
        row.stream.completion_tokens = len(row.generated)
        row.stream._push(tail, None)
        row.stream._close(reason)
        if was_active:
            with self._cv:
                self._active -= 1
        touched.append(row.stream)

    def _notify(self, streams: list[RowStream]) -> None:
        by_loop: dict[Any, list[RowStream]] = {}
        for s in streams:
            if s.loop is None:
                s._wake()
            else:
                by_loop.setdefault(s.loop, []).append(s)
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(_wake_all, group)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass

    # -- one cycle ---------------------------------------------------------------------
    def _cycle(self) -> None:
        cfg = self.config
        budget = cfg.token_budget - len(self._decoding)
        chunks: list[tuple[_Row, int]] = []
        for row in list(self._prefilling):
            if budget <= 0:
                break
            c = min(len(row.prompt) - row.prefilled, cfg.prefill_chunk_tokens, budget)
            chunks.append((row, c))
            budget -= c
        while budget > 0 and self._waiting and self._free:
            row = self._waiting.popleft()
            self._admit(row)
            c = min(len(row.prompt), cfg.prefill_chunk_tokens, budget)
            chunks.append((row, c))
            budget -= c
        decoding = list(self._decoding)
        if not decoding and not chunks:
            return
        with self.ownership.shared(), torch.inference_mode():
            self._ensure_eval()
            if chunks and self._packable(decoding, chunks):
                dec_logits, pre_logits, completing = self._packed_forward(decoding, chunks)
            else:
                dec_logits = self._decode_forward(decoding) if decoding else None
                pre_logits, completing = self._prefill_forward(chunks) if chunks else (None, [])
        self.steps += 1
        # rotate partial prefills so the next cycle starts with someone else
        partial = [r for r, _ in chunks if r.prefilled < len(r.prompt)]
        if partial:
            self._prefilling = [r for r in self._prefilling if r not in partial] + partial
        rows = decoding + completing
        logits = [t for t in (dec_logits, pre_logits) if t is not None]
        if not rows:
            return
        choices = select_tokens(
            torch.cat(logits) if len(logits) > 1 else logits[0],
            [r.params for r in rows],
            [r.gen for r in rows],
            self._shared_gen,
        )
        for row in completing:
            self._to_decoding(row)
        touched: list[RowStream] = []
        done: list[tuple[_Row, str]] = []
        now = time.perf_counter()
        obs = self.observer
        for row, choice in zip(rows, choices):
            tok = choice.token_id
            if row.generated:
                obs.inter_token(now - row.t_last)
            else:
                obs.first_token(now - row.t_submit)
            row.t_last = now
            row.generated.append(tok)
            reason = None
            if tok in row.eos_ids and not row.params.ignore_eos:
                reason = "stop"
                text = ""
            else:
                text = row.text.push(tok)
                if row.text.stopped:
                    reason = "stop"
            row.stream._push(text, choice)
            if reason is None and (len(row.generated) >= row.params.max_tokens or row.pos >= self._kv.capacity):
                reason = "length"
            if reason is not None or row.cancelled:
                done.append((row, reason or "abort"))
            elif row.stream.incremental:
                touched.append(row.stream)
        obs.tokens_generated(len(rows))
        # highest slot first keeps the compaction moves valid
        for row, reason in sorted(done, key=lambda rr: -rr[0].slot):
            self._finish(row, reason, touched)
        self._notify(touched)

    def _adapter_kwargs(self, rows: list[_Row]) -> dict[str, Any]:
        if not self.adapters.wrapped:
            return {}
        return {"adapter_names": [r.adapter_key for r in rows]}

    def _packable(self, decoding: list[_Row], chunks: list[tuple[_Row, int]]) -> bool:
        """One packed forward if every row uses the same adapter and the attention stays small."""
        rows = decoding + [r for r, _ in chunks]
        if len({r.adapter_key for r in rows}) != 1:
            return False  # PEFT picks adapters per batch row; a packed batch has one row
        tokens = len(decoding) + sum(c for _, c in chunks)
        kv_len = max([r.pos + 1 for r in decoding] + [r.prefilled + c for r, c in chunks])
        return tokens * len(rows) * kv_len <= PACKED_MAX_SCORES

    def _packed_forward(
        self, decoding: list[_Row], chunks: list[tuple[_Row, int]]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[_Row]]:
        """Decode tokens and prompt chunks of all rows as one sequence ``[1, T]``, no padding.

        Returns decode logits ``[len(decoding), vocab]`` (or ``None``), logits ``[m, vocab]``
        at the last prompt token of the ``m`` rows whose prefill completes, and those rows.
        """
        dev = self.device
        ids: list[int] = []
        row_of: list[int] = []
        pos_of: list[int] = []
        keep: list[int] = []
        for i, r in enumerate(decoding):
            ids.append(r.generated[-1])
            row_of.append(i)
            pos_of.append(r.pos)
            keep.append(i)
        completing = []
        for j, (r, c) in enumerate(chunks):
            start = r.prefilled
            ids.extend(r.prompt[start : start + c])
            row_of.extend([len(decoding) + j] * c)
            pos_of.extend(range(start, start + c))
            if start + c == len(r.prompt):
                keep.append(len(ids) - 1)
                completing.append(r)
        rows = decoding + [r for r, _ in chunks]
        kv_len = max(pos_of) + 1
        row_t = torch.tensor(row_of, device=dev)
        pos_t = torch.tensor(pos_of, device=dev)
        key_row = torch.arange(len(rows), device=dev).repeat_interleave(kv_len)
        key_pos = torch.arange(kv_len, device=dev).repeat(len(rows))
        mask = (key_row[None, :] == row_t[:, None]) & (key_pos[None, :] <= pos_t[:, None])
        cache = self._kv.packed_step([r.slot for r in rows], row_t, pos_t, kv_len)
        extra = {"adapter_names": [rows[0].adapter_key]} if self.adapters.wrapped else {}
        out = self.adapters.forward_model(
            input_ids=torch.tensor([ids], device=dev), position_ids=pos_t[None, :], attention_mask=mask[None, None],
            past_key_values=cache, use_cache=True,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev) if keep else 1, **extra,
        )
        logits = out.logits[0]
        for r in decoding:
            r.pos += 1
        for r, c in chunks:
            r.prefilled += c
            r.pos = r.prefilled
        n = len(decoding)
        return (logits[:n] if n else None), (logits[n:] if completing else None), completing

    def _decode_forward(self, rows: list[_Row]) -> torch.Tensor:
        """One token for each decoding row (slots ``0..n-1``) -> logits ``[n, vocab]``."""
        n = len(rows)
        pos = torch.tensor([r.pos for r in rows], device=self.device)
        kv_len = int(max(r.pos for r in rows)) + 1
        ids = torch.tensor([[r.generated[-1]] for r in rows], device=self.device)
        mask = (torch.arange(kv_len, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        cache = self._kv.step(list(range(n)), pos[:, None], kv_len)
        out = self.adapters.forward_model(
            input_ids=ids, position_ids=pos[:, None], attention_mask=mask, past_key_values=cache,
            use_cache=True, logits_to_keep=1, **self._adapter_kwargs(rows),
        )
        for r in rows:
            r.pos += 1
        return out.logits[:, -1]

    def _prefill_forward(self, chunks: list[tuple[_Row, int]]) -> tuple[torch.Tensor | None, list[_Row]]:
        """Next prompt chunk of each row, right-padded into one forward.

        Returns logits ``[m, vocab]`` at the last prompt token of the ``m`` rows whose
        prefill completes in this chunk (in that order), and those rows.
        """
        dev = self.device
        rows = [r for r, _ in chunks]
        width = max(c for _, c in chunks)
        starts = torch.tensor([r.prefilled for r in rows], device=dev)
        lens = torch.tensor([c for _, c in chunks], device=dev)
        col = torch.arange(width, device=dev)[None, :]
        qpos = starts[:, None] + torch.minimum(col, lens[:, None] - 1)
        real = col < lens[:, None]
        wpos = torch.where(real, starts[:, None] + col, torch.full_like(qpos, self._kv.scratch))
        ids = torch.full((len(rows), width), self._pad, dtype=torch.long, device=dev)
        for i, (r, c) in enumerate(chunks):
            ids[i, :c] = torch.tensor(r.prompt[r.prefilled : r.prefilled + c], device=dev)
        kv_len = int((starts + lens).max())
        mask = (torch.arange(kv_len, device=dev)[None, None, :] <= qpos[:, :, None])[:, None]
        cache = self._kv.step([r.slot for r in rows], wpos, kv_len)
        out = self.adapters.forward_model(
            input_ids=ids, position_ids=qpos, attention_mask=mask, past_key_values=cache,
            use_cache=True, logits_to_keep=(lens - 1)[:, None], **self._adapter_kwargs(rows),
        )
        completing_idx = []
        for i, (r, c) in enumerate(chunks):
            r.prefilled += c
            r.pos = r.prefilled
            if r.prefilled == len(r.prompt):
                completing_idx.append(i)
        if not completing_idx:
            return None, []
        logits = out.logits[:, -1]
        return logits[torch.tensor(completing_idx, device=dev)], [rows[i] for i in completing_idx]


def _wake_all(streams: list[RowStream]) -> None:
    for s in streams:
        s._wake()
