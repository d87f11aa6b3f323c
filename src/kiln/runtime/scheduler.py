"""The engine's actor: one thread, continuous batching, and every row's lifecycle.

Each scheduling cycle spends a token budget (``batching.token_budget``) in this
order: one decode token for every decoding row, then the next chunk of prompts
whose prefill is already under way (rotating, so one long prompt cannot hog the
cycles), then the first chunk of newly admitted rows while rows, blocks and budget last.
While rows are decoding, the prompt tokens of a cycle are further limited to what
keeps it within ``batching.mixed_step_factor`` times a decode-only cycle, by an
online fit of step time against tokens (:mod:`kiln.runtime.step_cost`): a burst
of prompts is spread over several cycles instead of stalling every stream. A
cycle with nothing decoding and enough prompt work runs on more torch threads
(``EngineConfig.prefill_threads``, :mod:`kiln.runtime.threads`).
Generation rows and scoring rows (``prompt_logprobs``) share that queue, those
limits and that budget: a scoring row is a prompt prefilled chunk by chunk whose
every position's logits are kept, and it ends when its prefill does.

KV state lives in a :class:`~kiln.runtime.paged_kv.BlockPool` of fixed-size
blocks; each row holds a block table, grown a block at a time just before a step
writes past it. Admission is by memory as well as by row count: a waiting row is
admitted only while the pool can hold its prompt (blocks already in the prefix
cache count as held), so requests wait instead of failing. When a running row
cannot grow, the youngest running row (latest admitted) is *preempted*: its blocks
are released (its full prompt blocks stay in the prefix cache) and it goes back to
the head of the queue, to be recomputed from its prompt plus the tokens it had
generated (greedy outputs are unchanged). A request that could never fit the
whole pool is refused at submission. The forwards themselves are built in
:mod:`kiln.runtime.batches`. Each cycle runs under shared
accelerator ownership; adapter changes and training steps take it exclusively, so
they land between two cycles. Nothing that needs exclusive ownership runs inside
the shared section: retiring an adapter whose last row ended there is deferred to
:meth:`~kiln.runtime.adapter_slots.AdapterSlots.reap`, between cycles.

A hybrid model's row also owns a linear-state slot (:mod:`kiln.runtime.linear_state`)
from admission until its blocks are released (finish, cancel, preemption, engine stop);
a waiting row is admitted only while a slot is free. A preempted hybrid row recomputes
its state from scratch, as its KV.

A row is *active* from admission until its cleanup (blocks released, linear-state slot
and adapter reference dropped, final event delivered) is done; ``stats()["active_rows"]`` counts exactly
that, so a zero means nothing is held. Cancellation is settled by the actor at
the next cycle boundary. A failure while sampling one row ends that row alone
(finish reason ``error``); only a failure of the forward itself fails the engine.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable

import torch

from kiln.runtime.adapter_slots import BASE_KEY, AdapterSlots
from kiln.runtime.batches import Batches
from kiln.runtime.cycle_plan import QUEUE_DETAIL_MAX, CyclePlanner
from kiln.runtime.engine_config import EngineConfig
from kiln.runtime.paged_kv import BlockPool
from kiln.runtime.ownership import AcceleratorOwnership
from kiln.runtime.rows import Row, ScoreRow
from kiln.runtime.request_trace import row_phases
from kiln.runtime.sampling import TokenChoice, select_tokens
from kiln.runtime.step_cost import StepCost
from kiln.runtime.scoring import chunk_rows
from kiln.runtime.submission import EngineNotRunning, Observer, RowStream, _wake_all
from kiln.runtime.threads import WIDE_PREFILL_MIN_MACS, torch_threads

log = logging.getLogger("kiln.engine")

JOIN_TIMEOUT_S = 30.0  # engine.stop waits this long for the thread, then gives up loudly


class Scheduler(CyclePlanner):
    """The actor thread and the row queues (see the module docstring)."""

    def __init__(self, config: EngineConfig, kv: BlockPool, batches: Batches, adapters: AdapterSlots,
                 ownership: AcceleratorOwnership, observer: Observer, device: Any, macs_per_token: int = 0):
        self.config = config
        # prompt-only cycles with at least this many tokens run on config.prefill_threads (CPU only)
        wide = config.prefill_threads > 0 and torch.device(device).type == "cpu" and macs_per_token > 0
        self._wide_min_tokens = max(1, math.ceil(WIDE_PREFILL_MIN_MACS / macs_per_token)) if wide else None
        self.wide_steps = 0
        self.kv = kv
        self.batches = batches
        self.adapters = adapters
        self.ownership = ownership
        self.observer = observer
        self._cv = threading.Condition()
        self._inbox: collections.deque[Row | ScoreRow] = collections.deque()
        self._jobs: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._cancel_pending = False
        self._admitting = 0  # requests the HTTP layer is parsing and rendering, not yet submitted
        self._waiting: collections.deque[Row | ScoreRow] = collections.deque()
        self._prefilling: list[Row | ScoreRow] = []
        self._decoding: list[Row] = []
        self._seq = 0
        self.preemptions = 0
        self._oldest_wait: float | None = None  # perf_counter the oldest waiting row entered the queue
        # published by the engine thread after each plan (one assignment, read by any thread):
        # (what the head of the queue waits for, [(t_wait, prompt tokens, scoring)] of the first rows)
        self._queue_view: tuple[str | None, list[tuple[float, int, bool]]] = (None, [])
        self._active = 0
        self._queued = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failed: str | None = None
        self._busy_since: float | None = None  # monotonic start of the iteration under way; None when idle
        self._shared_gen = torch.Generator(device=device)
        self._shared_gen.manual_seed(int(time.time_ns() % (2**63)))
        self.steps = 0
        self.step_cost = StepCost()

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = JOIN_TIMEOUT_S) -> bool:
        """Stop the thread; ``False`` (logged as an error) when it did not end within ``timeout_s``."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            busy = self._busy_for()
            self._failed = self._failed or f"the engine thread did not stop within {timeout_s} s"
            log.error("engine thread did not stop within %.1f s (its current iteration has run %.1f s); "
                      "giving up on it: its rows are lost", timeout_s, busy or 0.0)
            return False
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self._failed is None

    def _busy_for(self) -> float | None:
        since = self._busy_since
        return None if since is None else time.monotonic() - since

    def health(self) -> tuple[bool, str | None]:
        """``(ok, why not)``: not ok when stopped, failed, or one iteration has run past the stall timeout."""
        if self._failed is not None:
            return False, self._failed
        if not self.running:
            return False, "the engine is stopped"
        busy = self._busy_for()
        if busy is not None and busy > self.config.stall_timeout_s:
            return False, (f"the engine is stuck: its current step has not advanced for {busy:.1f} s "
                           f"(limit {self.config.stall_timeout_s} s) with {self._active + self._queued} rows pending")
        return True, None

    def stats(self) -> dict[str, Any]:
        busy = self._busy_for()
        now = time.perf_counter()
        with self._cv:
            starts = [r.t_wait for r in self._inbox]
            if self._oldest_wait is not None:
                starts.append(self._oldest_wait)
            incoming = [(r.t_wait, len(r.tokens), r.scoring) for r in self._inbox]
            blocked_on, waiting = self._queue_view
            queue = [{"position": i + 1, "wait_s": round(now - t, 3), "prompt_tokens": n,
                      "kind": "score" if scoring else "generate"}
                     for i, (t, n, scoring) in enumerate((waiting + incoming)[:QUEUE_DETAIL_MAX])]
            return {
                "queue": queue,
                "queue_blocked_on": blocked_on if self._queued else None,
                "queued_rows": self._queued,
                "active_rows": self._active,
                "max_running_rows": self.config.max_running_rows,
                "steps": self.steps,
                "kv_cache_bytes": self.kv.nbytes(),
                "kv_used_bytes": self.kv.used() * self.kv.block_nbytes,
                "kv_workspace_bytes": self.kv.workspace_nbytes(),
                "queue_oldest_wait_s": round(now - min(starts), 3) if starts else 0.0,
                "preemptions": self.preemptions,
                **self.kv.stats(),
                **(self.batches.states.stats() if self.batches.states is not None else {}),
                "failed": self._failed,
                "busy_s": None if busy is None else round(busy, 3),
                "step_cost": self.step_cost.snapshot(),
                "admitting": self._admitting,
                "prefill_threads": self.config.prefill_threads if self._wide_min_tokens is not None else None,
                "wide_prefill_steps": self.wide_steps,
            }

    # -- admission (any thread) ----------------------------------------------------------
    def enqueue(self, rows: list[Row | ScoreRow]) -> bool:
        """Queue ``rows`` unless the waiting queue would overflow (then ``False``)."""
        with self._cv:
            if self._queued + len(rows) > self.config.max_queued_rows:
                return False
            self._queued += len(rows)
            now = time.perf_counter()
            for r in rows:
                r.t_wait = now
            self._inbox.extend(rows)
            self._cv.notify_all()
            return True

    @property
    def queued(self) -> int:
        return self._queued

    def admission_started(self) -> None:
        """A request is being parsed and rendered (any thread): a burst being gathered waits for it."""
        with self._cv:
            self._admitting += 1

    def admission_ended(self) -> None:
        """That request was submitted or refused."""
        with self._cv:
            self._admitting -= 1
            self._cv.notify_all()

    def cancel(self, rows: Iterable[Row | ScoreRow]) -> None:
        with self._cv:
            for r in rows:
                r.cancelled = True
            self._cancel_pending = True
            self._cv.notify_all()

    def run_job(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        with self._cv:
            if not self.running:
                raise EngineNotRunning("the engine is not running; restart the server")
            self._jobs.append((fn, fut))
            self._cv.notify_all()
        return fut

    # -- the actor ---------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while True:
                with self._cv:
                    self._busy_since = None
                    while not self._stopping and not self._has_work():
                        self._cv.wait()
                    if self._stopping:
                        break
                    self._gather_burst()
                    self._busy_since = time.monotonic()
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
                self.adapters.reap()  # retirements deferred out of the shared section
        except BaseException as exc:  # a bug or a device failure: fail every row, refuse new work
            log.exception("engine actor failed")
            self._failed = f"{type(exc).__name__}: {exc}"
        finally:
            self._abort_all("abort" if self._failed is None else "error")
            self._busy_since = None

    def _gather_burst(self) -> None:
        """Waking from idle to new rows, wait (holding no GIL) while more keep arriving, at most
        ``burst_gap_s`` apart, or while requests are still being admitted by the HTTP layer
        (:meth:`admission_started`), for ``burst_max_s`` in all, so a burst of requests shares
        its first prefill instead of each waiting a cycle behind the one before (the caller
        holds ``_cv``). Parsing and rendering a request costs the event loop about as long
        as the gap, so the gap alone split bursts the loop was still working through."""
        cfg = self.config
        if cfg.burst_gap_s <= 0 or not self._inbox or self._decoding or self._prefilling or self._waiting:
            return
        deadline = time.monotonic() + cfg.burst_max_s
        seen = -1
        while (len(self._inbox) != seen or self._admitting > 0) and not self._stopping:
            seen = len(self._inbox)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(min(cfg.burst_gap_s, left))

    def _has_work(self) -> bool:
        return bool(self._inbox or self._jobs or self._cancel_pending or self._waiting or self._prefilling
                    or self._decoding or self.adapters.reap_pending)

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

    # -- rows and blocks ------------------------------------------------------------------
    def _running(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    def _admit(self, row: Row | ScoreRow) -> bool:
        """Start ``row`` (cached prefix blocks attached) if the pool can hold its prompt; else ``False``."""
        kv = self.kv
        if not row.scoring:  # scoring keeps every position's logits: it computes them all, unless it
            row.blocks, row.cache_uid = kv.match(row.cache_key, row.tokens, len(row.tokens) - 1)
            row.registered = len(row.blocks)
        elif row.score_from > 1:  # ... asks for rows from score_from on only (logits from score_from - 1)
            row.blocks, row.cache_uid = kv.match(row.cache_key, row.tokens, row.score_from - 1)
            row.registered = len(row.blocks)
        need = kv.blocks_for(len(row.tokens)) - len(row.blocks)
        states = self.batches.states
        slot = None if need > kv.available() and self._running() else states.allocate() if states else -1
        if slot is None:
            kv.release(row.blocks)  # wait for memory (or a linear-state slot); rows running now will free theirs
            row.blocks = []
            return False
        row.state_slot = slot
        if not row.seq:
            self._seq += 1
            row.seq = self._seq
        now = time.perf_counter()
        self.observer.queue_wait(now - row.t_wait)
        if not row.scoring and not row.t_admit:
            row.t_admit = now
        row.prefilled = row.pos = len(row.blocks) * kv.block_size
        if row.scoring:
            row.rows = [None] * (row.prefilled + 1)
        self._prefilling.append(row)
        with self._cv:
            self._queued -= 1
            self._active += 1
        return True

    def _to_decoding(self, row: Row) -> None:
        self._prefilling.remove(row)
        self._decoding.append(row)

    def _grow(self, row: Row | ScoreRow, positions: int) -> bool:
        """Blocks for ``row``'s first ``positions`` positions; ``False`` when the pool ran out."""
        for _ in range(self.kv.blocks_for(positions) - len(row.blocks)):
            block = self.kv.allocate()
            if block is None:
                return False
            row.blocks.append(block)
        return True

    def _release_blocks(self, row: Row | ScoreRow) -> None:
        if row in self._prefilling:
            self._prefilling.remove(row)
        elif row in self._decoding:
            self._decoding.remove(row)
        self.kv.release(row.blocks)
        row.blocks = []
        if row.state_slot >= 0:
            self.batches.states.release(row.state_slot)
            row.state_slot = -1

    def _preempt(self, row: Row | ScoreRow) -> None:
        """Back to the head of the queue (in admission order), its blocks released; recomputed later."""
        self._release_blocks(row)
        row.prefilled = row.pos = 0
        if row.scoring:
            row.rows = [None]
        else:
            row.tokens = row.prompt + row.generated
        row.registered = 0
        row.cache_uid = 0
        row.t_wait = time.perf_counter()
        at = next((i for i, w in enumerate(self._waiting) if w.seq == 0 or w.seq > row.seq), len(self._waiting))
        self._waiting.insert(at, row)
        self.preemptions += 1
        with self._cv:
            self._queued += 1
            self._active -= 1

    def _publish(self, row: Row | ScoreRow) -> None:
        """Offer ``row``'s newly completed prompt blocks to the prefix cache (a scoring row's only when it
        asked for rows from a position on: a full-prompt scoring computes every position anyway)."""
        if not self.kv.prefix_cache or (row.scoring and row.score_from <= 1):
            return
        bs = self.kv.block_size
        while row.registered < row.prefilled // bs:
            i = row.registered
            row.cache_uid = self.kv.register(row.cache_key, row.cache_uid, tuple(row.tokens[i * bs:(i + 1) * bs]),
                                             row.blocks[i])
            row.registered += 1

    def _finish(self, row: Row | ScoreRow, reason: str, touched: list[RowStream], *, was_active: bool = True) -> None:
        """Terminal cleanup: blocks, adapter reference, final output; then the row stops counting as active."""
        if was_active:
            self._release_blocks(row)
        if row.adapter_key != BASE_KEY:
            try:
                self.adapters.release(row.adapter_key)
            except Exception:  # never let adapter bookkeeping wedge the actor
                log.exception("releasing adapter %s failed", row.adapter_key)
        if not row.scoring:
            self._row_ended(row, reason)
        stream = row.end(reason)
        if was_active:
            with self._cv:
                self._active -= 1
        if stream is not None:
            touched.append(stream)

    def _row_ended(self, row: Row, reason: str) -> None:
        """Report the row's phases (if it ever ran) to the observer and to its request's trace."""
        phases = row_phases(row, time.perf_counter())
        if row.t_admit:
            self.observer.request_phases(phases)
        if row.trace is not None:
            row.trace.row_ended(phases, len(row.generated), reason, row.generated)

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
        chunks = self._plan()
        gen_chunks = [(r, c) for r, c in chunks if not r.scoring]
        score_chunks = [(r, c) for r, c in chunks if r.scoring]
        decoding = list(self._decoding)
        if not decoding and not chunks:
            return
        scored: list[ScoreRow] = []
        threads = self._cycle_threads(decoding, chunks)
        with self.ownership.shared(), torch.inference_mode(), torch_threads(threads) as wide:
            t0 = time.perf_counter()
            waited = self.ownership.last_shared_wait_s()
            if waited:  # a training step or an adapter change held ownership exclusively
                for row in decoding:
                    row.lock_wait += waited
                for row, _ in gen_chunks:
                    row.lock_wait += waited
            self._ensure_eval()
            dec_logits = pre_logits = None
            completing: list[Row] = []
            if gen_chunks and self.batches.packable(decoding, gen_chunks):
                dec_logits, pre_logits, completing = self.batches.packed(decoding, gen_chunks)
            elif decoding or gen_chunks:
                dec_logits = self.batches.decode(decoding) if decoding else None
                if gen_chunks:
                    pre_logits, completing = self.batches.prefill(gen_chunks)
            if score_chunks:
                scored = self._score_chunks(score_chunks)
            forward_s = time.perf_counter() - t0
        self.steps += 1
        self.wide_steps += wide
        for row, _ in gen_chunks:
            self._publish(row)
        # rotate partial prefills so the next cycle starts with someone else
        partial = [r for r, _ in chunks if r.prefilled < len(r.tokens)]
        if partial:
            self._prefilling = [r for r in self._prefilling if r not in partial] + partial
        touched: list[RowStream] = []
        for row in scored:
            self._finish(row, "stop", touched)
        rows = decoding + completing
        if rows:
            logits = [t for t in (dec_logits, pre_logits) if t is not None]
            t0 = time.perf_counter()
            self._sample(rows, torch.cat(logits) if len(logits) > 1 else logits[0], completing, touched)
            forward_s += time.perf_counter() - t0
        if not score_chunks and not wide:  # the fit is of generation cycles on the engine's own threads
            self.step_cost.observe(len(decoding) + sum(c for _, c in gen_chunks), forward_s)
        self._notify(touched)
        if not self._decoding and not self._prefilling:
            self.kv.release_workspace()

    def _score_chunks(self, chunks: list[tuple[ScoreRow, int]]) -> list[ScoreRow]:
        """One forward over the scoring rows' chunks; appends their rows; returns the rows now complete."""
        starts = [r.prefilled for r, _ in chunks]
        logits, rows = self.batches.prefill(chunks, all_logits=True)
        for i, ((row, c), start) in enumerate(zip(chunks, starts)):
            skip = max(0, min(c, row.score_from - 1 - start))  # positions whose rows were not asked for
            row.rows.extend([None] * skip)
            row.rows.extend(chunk_rows(logits[i, skip:c], row.prompt, start + skip, row.top_k))
            self._publish(row)
        return [r for r in rows if r.prefilled == len(r.tokens)]

    def _choose(self, logits: torch.Tensor, rows: list[Row]) -> list[TokenChoice | None]:
        """One token per row; a row whose sampling fails gets ``None`` and the others are unharmed."""
        try:
            return list(select_tokens(logits, [r.params for r in rows], [r.gen for r in rows], self._shared_gen, rows))
        except Exception:
            log.exception("batched sampling failed; sampling the %d rows one by one", len(rows))
        out: list[TokenChoice | None] = []
        for i, r in enumerate(rows):
            try:
                out.append(select_tokens(logits[i : i + 1], [r.params], [r.gen], self._shared_gen, [r])[0])
            except Exception:
                log.exception("sampling failed for one row (params %s); ending that row", r.params)
                out.append(None)
        return out

    def _sample(self, rows: list[Row], logits: torch.Tensor, completing: list[Row], touched: list[RowStream]) -> None:
        choices = self._choose(logits, rows)
        for row in completing:
            self._to_decoding(row)
        done: list[tuple[Row, str]] = []
        now = time.perf_counter()
        obs = self.observer
        produced = 0
        for row, choice in zip(rows, choices):
            if choice is None:
                done.append((row, "error"))
                continue
            produced += 1
            tok = choice.token_id
            if row.generated:
                obs.inter_token(now - row.t_last)
            else:
                obs.first_token(now - row.t_submit)
                if not row.t_first:
                    row.t_first = now
            row.t_last = now
            row.generated.append(tok)
            reason = None
            if (tok in row.eos_ids and not row.params.ignore_eos) or tok in row.params.stop_token_ids:
                c = row.params.constraint
                reason = "grammar_error" if getattr(c, "error", None) is not None else "stop"
                text = ""
            else:
                text = row.text.push(tok)
                if row.text.stopped:
                    reason = "stop"
            row.stream._push(text, choice)
            if reason is None and (len(row.generated) >= row.params.max_tokens or row.pos >= self.config.max_model_len):
                reason = "length"
            if reason is not None or row.cancelled:
                done.append((row, reason or "abort"))
            elif row.stream.incremental:
                touched.append(row.stream)
        obs.tokens_generated(produced)
        for row, reason in done:
            self._finish(row, reason, touched)

