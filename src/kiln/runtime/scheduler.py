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

A cycle is three steps over frozen values: *schedule* (:class:`~kiln.runtime.cycle_plan.CyclePlanner`
returns a :class:`~kiln.runtime.cycle_plan.CyclePlan`), *execute* (:class:`~kiln.runtime.cycle_execute.CycleExecutor`
runs its forwards and returns a :class:`~kiln.runtime.cycle_execute.ForwardOutput`, touching no row) and
*update* (:class:`~kiln.runtime.cycle_update.CycleUpdate` advances, publishes, samples and ends rows). Rows
live in :class:`~kiln.runtime.row_queues.RowQueues`; their blocks and state slots in the
:class:`~kiln.runtime.kv_ledger.BlockLedger`.

A row is *active* from admission until its cleanup (blocks released, linear-state slot
and adapter reference dropped, final event delivered) is done; ``stats()["active_rows"]`` counts exactly
that, so a zero means nothing is held. Cancellation is settled by the actor at
the next cycle boundary. A failure while sampling one row ends that row alone
(finish reason ``error``). A failing forward is contained to the rows of its cycle
(:mod:`kiln.runtime.cycle_faults`): they run again one by one (in halves after out-of-memory) and
only a row that fails alone ends, with a typed error; the engine latches (``restart_required``)
only when the completion state is unknown.
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
from kiln.runtime.cycle_execute import CycleExecutor, ForwardOutput
from kiln.runtime.cycle_faults import (
    OUT_OF_MEMORY,
    UNKNOWN_STATE,
    Containment,
    CycleLatched,
    FaultHook,
    RestartRequired,
    contain,
    describe,
)
from kiln.runtime.cycle_plan import OOM_BUDGET_HOLD_S, QUEUE_DETAIL_MAX, CyclePlan, CyclePlanner
from kiln.runtime.cycle_update import CycleUpdate
from kiln.runtime.engine_config import EngineConfig
from kiln.runtime.kv_ledger import BlockLedger
from kiln.runtime.paged_kv import BlockPool
from kiln.runtime.ownership import AcceleratorOwnership
from kiln.runtime.row_queues import RowQueues
from kiln.runtime.rows import Row, ScoreRow
from kiln.runtime.request_trace import row_phases
from kiln.runtime.step_cost import StepCost
from kiln.runtime.submission import EngineNotRunning, Observer, RowFault, RowStream, _wake_all
from kiln.runtime.threads import WIDE_PREFILL_MIN_MACS

log = logging.getLogger("kiln.engine")

JOIN_TIMEOUT_S = 30.0  # engine.stop waits this long for the thread, then gives up loudly
HYBRID_UNSETTLED = "a hybrid model's forward updates its linear state in place, so a failed cycle cannot be rerun"
CYCLE_EWMA = 0.2  # weight of the newest generation cycle in Scheduler.cycle_s


class Scheduler:
    """The actor thread, the inbox, and one cycle (see the module docstring)."""

    def __init__(self, config: EngineConfig, kv: BlockPool, batches: Batches, adapters: AdapterSlots,
                 ownership: AcceleratorOwnership, observer: Observer, device: Any, macs_per_token: int = 0,
                 prompt_text: Callable[[list[int]], str] | None = None):
        self.config = config
        # prompt-only cycles with at least this many tokens run on config.prefill_threads (CPU only)
        wide = config.prefill_threads > 0 and torch.device(device).type == "cpu" and macs_per_token > 0
        wide_min_tokens = max(1, math.ceil(WIDE_PREFILL_MIN_MACS / macs_per_token)) if wide else None
        self.wide_steps = 0
        self.kv = kv
        self.batches = batches
        self.adapters = adapters
        self.ownership = ownership
        self.observer = observer
        self._cv = threading.Condition()
        self._inbox: collections.deque[Row | ScoreRow] = collections.deque()
        self._jobs: collections.deque[tuple[Callable[[], Any], Future[Any]]] = collections.deque()
        self._cancel_pending = False
        self._admitting = 0  # requests the HTTP layer is parsing and rendering, not yet submitted
        self.ledger = BlockLedger(kv, batches.states, batches.snapshots)
        self.queues = RowQueues(self.ledger, observer, self._cv)
        self.planner = CyclePlanner(config, self.queues, self.ledger, StepCost(), wide_min_tokens)
        fault = FaultHook.from_env(prompt_text) if prompt_text is not None else None
        self.execute = CycleExecutor(batches, adapters, ownership, fault)
        self._shared_gen = torch.Generator(device=device)
        self._shared_gen.manual_seed(int(time.time_ns() % (2**63)))
        self.update = CycleUpdate(config, self.queues, self.ledger, observer, self._finish, self._shared_gen, fault)
        self._containment = Containment(self.execute, self._apply_contained, self._fail_row, self._relieve,
                                        HYBRID_UNSETTLED if batches.states is not None else None)
        self.faults: dict[str, int] = {}  # failures contained so far, by class (cycle_faults)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._restart: RestartRequired | None = None
        self._busy_since: float | None = None  # monotonic start of the iteration under way; None when idle
        self.steps = 0
        # an exponential average of the generation cycles' seconds (forward + sampling): the cadence the
        # streams see, from which the trainer sizes its holds (training.hold_cycles); None before the first
        self.cycle_s: float | None = None

    @property
    def step_cost(self) -> StepCost:
        return self.planner.step_cost

    @step_cost.setter
    def step_cost(self, value: StepCost) -> None:
        self.planner.step_cost = value

    @property
    def preemptions(self) -> int:
        return self.queues.preemptions

    @property
    def _failed(self) -> str | None:
        return None if self._restart is None else self._restart.reason

    @property
    def restart_required(self) -> dict[str, str] | None:
        """``{"class", "reason"}`` once the engine latched (cycle_faults), else None."""
        return None if self._restart is None else self._restart.as_dict()

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
            if self._restart is None:
                self._restart = RestartRequired(UNKNOWN_STATE, f"the engine thread did not stop within {timeout_s} s")
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
                           f"(limit {self.config.stall_timeout_s} s) with {self.queues.active + self.queues.queued} rows pending")
        return True, None

    def stats(self) -> dict[str, Any]:
        busy = self._busy_for()
        now = time.perf_counter()
        with self._cv:
            starts = [r.t_wait for r in self._inbox]
            if self.planner.oldest_wait is not None:
                starts.append(self.planner.oldest_wait)
            incoming = [(r.t_wait, len(r.tokens), r.scoring) for r in self._inbox]
            blocked_on, waiting = self.planner.queue_view
            queue = [{"position": i + 1, "wait_s": round(now - t, 3), "prompt_tokens": n,
                      "kind": "score" if scoring else "generate"}
                     for i, (t, n, scoring) in enumerate((waiting + incoming)[:QUEUE_DETAIL_MAX])]
            return {
                "queue": queue,
                "queue_blocked_on": blocked_on if self.queues.queued else None,
                "queued_rows": self.queues.queued,
                "active_rows": self.queues.active,
                "max_running_rows": self.config.max_running_rows,
                "steps": self.steps,
                "kv_cache_bytes": self.kv.nbytes(),
                "kv_used_bytes": self.kv.used() * self.kv.block_nbytes,
                "kv_workspace_bytes": self.kv.workspace_nbytes(),
                "queue_oldest_wait_s": round(now - min(starts), 3) if starts else 0.0,
                "preemptions": self.preemptions,
                **self.kv.stats(),
                **(self.batches.states.stats() if self.batches.states is not None else {}),
                **(self.batches.snapshots.stats() if self.batches.snapshots is not None else {}),
                "failed": self._failed,
                "restart_required": self.restart_required,
                "cycle_faults": dict(self.faults),
                "token_budget": self.planner.token_budget(),  # lower than batching.token_budget after an OOM
                "busy_s": None if busy is None else round(busy, 3),
                "step_cost": self.step_cost.snapshot(),
                "cycle_s": None if self.cycle_s is None else round(self.cycle_s, 6),
                "admitting": self._admitting,
                "prefill_threads": self.config.prefill_threads if self.planner.wide_min_tokens is not None else None,
                "wide_prefill_steps": self.wide_steps,
            }

    # -- admission (any thread) ----------------------------------------------------------
    def enqueue(self, rows: list[Row | ScoreRow]) -> bool:
        """Queue ``rows`` unless the waiting queue would overflow (then ``False``)."""
        with self._cv:
            if self.queues.queued + len(rows) > self.config.max_queued_rows:
                return False
            self.queues.queued += len(rows)
            now = time.perf_counter()
            for r in rows:
                r.t_wait = now
            self._inbox.extend(rows)
            self._cv.notify_all()
            return True

    @property
    def queued(self) -> int:
        return self.queues.queued

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

    def run_job(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
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
                self.queues.arrive(incoming)
                if cancels:
                    self._settle_cancellations()
                for fn, fut in jobs:
                    self._run_job(fn, fut)
                self._cycle()
                self.adapters.reap()  # retirements deferred out of the shared section
        except CycleLatched as exc:  # a cycle's completion state is unknown (cycle_faults)
            log.error("engine latched (%s): %s; restart the server", exc.restart.fault_class, exc.restart.reason)
            self._restart = exc.restart
        except BaseException as exc:  # a bug outside a cycle's forwards: fail every row, refuse new work
            log.exception("engine actor failed")
            self._restart = RestartRequired(UNKNOWN_STATE, describe(exc))
        finally:
            self._abort_all("abort" if self._restart is None else "error")
            self._busy_since = None

    def _gather_burst(self) -> None:
        """Waking from idle to new rows, wait (holding no GIL) while more keep arriving, at most
        ``burst_gap_s`` apart, or while requests are still being admitted by the HTTP layer
        (:meth:`admission_started`), for ``burst_max_s`` in all, so a burst of requests shares
        its first prefill instead of each waiting a cycle behind the one before (the caller
        holds ``_cv``). Parsing and rendering a request costs the event loop about as long
        as the gap, so the gap alone split bursts the loop was still working through."""
        cfg = self.config
        if cfg.burst_gap_s <= 0 or not self._inbox or self.queues.busy():
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
        return bool(self._inbox or self._jobs or self._cancel_pending or self.queues.busy()
                    or self.adapters.reap_pending)

    def _run_job(self, fn: Callable[[], Any], fut: Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            with self.ownership.shared(), torch.inference_mode():
                self.execute.ensure_eval()
                fut.set_result(fn())
        except BaseException as exc:  # delivered to the caller
            fut.set_exception(exc)

    def _settle_cancellations(self) -> None:
        q = self.queues
        touched: list[RowStream] = []
        for row in [r for r in q.waiting if r.cancelled]:
            q.drop_waiting(row)
            self._finish(row, "abort", touched, was_active=False)
        for row in [r for r in q.decoding + q.prefilling if r.cancelled]:
            self._finish(row, "abort", touched)
        self._notify(touched)

    def _abort_all(self, reason: str) -> None:
        q = self.queues
        touched: list[RowStream] = []
        with self._cv:
            incoming = list(self._inbox)
            self._inbox.clear()
            jobs = list(self._jobs)
            self._jobs.clear()
        for _fn, fut in jobs:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineNotRunning("the engine stopped before running this job"))
        for row in incoming + list(q.waiting):
            q.drop_waiting(row)
            self._finish(row, reason, touched, was_active=False)
        for row in list(q.decoding) + list(q.prefilling):
            self._finish(row, reason, touched)
        self._notify(touched)

    # -- row ends ---------------------------------------------------------------------
    def _finish(self, row: Row | ScoreRow, reason: str, touched: list[RowStream], *, was_active: bool = True,
                fault: RowFault | None = None) -> None:
        """Terminal cleanup: blocks, adapter reference, final output; then the row stops counting as active."""
        if was_active:
            self.queues.release(row)
        if row.adapter_key != BASE_KEY:
            try:
                self.adapters.release(row.adapter_key)
            except Exception:  # never let adapter bookkeeping wedge the actor
                log.exception("releasing adapter %s failed", row.adapter_key)
        if isinstance(row, Row):
            self._row_ended(row, reason)
        stream = row.end(reason, fault)
        if was_active:
            self.queues.ended()
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

    # -- one cycle: schedule -> execute -> update ------------------------------------------
    def _cycle(self) -> None:
        plan = self.planner.plan()
        if plan.empty:
            return
        try:
            out = self.execute(plan)
        except Exception as exc:  # noqa: BLE001  (classified and contained, or latched, by cycle_faults)
            seen = contain(plan, exc, self._containment)
            with self._cv:  # stats() copies the counts under it
                for cls, n in seen.items():
                    self.faults[cls] = self.faults.get(cls, 0) + n
            if OUT_OF_MEMORY in seen:  # a lasting cap: the next cycles plan a smaller size (cycle_plan)
                budget = self.planner.lower_after_oom(plan)
                log.warning("out of memory: the per-cycle token budget is %d (of %d) for the next %.0f s", budget,
                            self.config.token_budget, OOM_BUDGET_HOLD_S)
        else:
            self._apply(plan, out, observe=True)
        q = self.queues
        if not q.decoding and not q.prefilling:
            self.kv.release_workspace()

    def _apply(self, plan: CyclePlan, out: ForwardOutput, *, observe: bool) -> None:
        """The update step, the cycle counters and the cost fit (``observe``: of whole generation cycles
        on the engine's own threads), then wake the consumers."""
        touched, sample_s = self.update.apply(plan, out)
        self.steps += 1
        self.wide_steps += out.wide
        if observe and not plan.scoring and not out.wide:
            seconds = out.forward_s + sample_s
            self.step_cost.observe(plan.generation_tokens, seconds)
            self.cycle_s = seconds if self.cycle_s is None else self.cycle_s + CYCLE_EWMA * (seconds - self.cycle_s)
        self._notify(touched)

    def _apply_contained(self, plan: CyclePlan, out: ForwardOutput) -> None:
        self._apply(plan, out, observe=False)

    def _fail_row(self, row: Row | ScoreRow, fault: RowFault) -> None:
        touched: list[RowStream] = []
        self._finish(row, "error", touched, fault=fault)
        self._notify(touched)

    def _relieve(self) -> None:
        """Between out-of-memory tries: the pool's gather workspace and the CUDA caching allocator's free blocks."""
        self.kv.release_workspace()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
