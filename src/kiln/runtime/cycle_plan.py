"""How one engine cycle spends its token budget, as a frozen :class:`CyclePlan`: decode blocks first
(preempting the youngest row when the pool is out), then prompt chunks for generation and scoring rows,
admission from the waiting queue, the mixed-step allowance beside decoding rows, and the torch threads of
a prompt-only cycle.

:class:`CyclePlanner` is the *schedule* step of a cycle (schedule -> execute -> update, see
:mod:`kiln.runtime.scheduler`). It moves rows between the stages of :class:`~kiln.runtime.row_queues.RowQueues`
and grows block tables through the :class:`~kiln.runtime.kv_ledger.BlockLedger`; what it returns is fixed
for the rest of the cycle: :mod:`kiln.runtime.cycle_execute` runs the plan's forwards without touching a row,
and :mod:`kiln.runtime.cycle_update` applies their results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, cast

from kiln.runtime.rows import Row, ScoreRow

if TYPE_CHECKING:
    from kiln.runtime.engine_config import EngineConfig
    from kiln.runtime.kv_ledger import BlockLedger
    from kiln.runtime.row_queues import RowQueues
    from kiln.runtime.step_cost import StepCost

QUEUE_DETAIL_MAX = 32  # waiting rows listed one by one in stats()["queue"] (the count covers all)
OOM_BUDGET_HOLD_S = 60.0  # how long a token budget lowered after an out-of-memory cycle stays lowered
MIN_OOM_BUDGET = 8  # the lowest an out-of-memory cycle lowers the token budget to
MIN_MIXED_PROMPT_TOKENS = 4  # prompt tokens a cycle beside decoding rows always may take (so prompts progress)
# the mixed_step_factor allowance grows by one more of itself for every this many decode cycles the oldest
# held-back prompt has waited (so a backlog is served in about sqrt(2 x cycles x backlog / allowance) cycles)
MIXED_AGE_CYCLES = 4

PlanItem = tuple[Row | ScoreRow, int]  # (row, tokens this cycle: 1 for a decoding row, the chunk for a prompt)


@dataclass(frozen=True)
class CyclePlan:
    """What one cycle runs: one token for each decoding row, a prompt chunk for each generation and
    scoring row (in that row's order of the scheduler's lists), and the torch threads to run it on
    (0: the engine's own). Rows hold every block their positions of this cycle need."""

    decoding: tuple[Row, ...] = ()
    prompts: tuple[tuple[Row, int], ...] = ()
    scoring: tuple[tuple[ScoreRow, int], ...] = ()
    threads: int = 0

    @property
    def empty(self) -> bool:
        return not (self.decoding or self.prompts or self.scoring)

    @property
    def rows(self) -> list[Row | ScoreRow]:
        return [*self.decoding, *(r for r, _ in self.prompts), *(r for r, _ in self.scoring)]

    @property
    def generation_tokens(self) -> int:
        """Tokens of the generation rows (what the cycle-cost fit is of)."""
        return len(self.decoding) + sum(c for _, c in self.prompts)

    def items(self) -> list[PlanItem]:
        return [*((r, 1) for r in self.decoding), *self.prompts, *self.scoring]

    @classmethod
    def of(cls, items: list[PlanItem], decoding: set[int]) -> CyclePlan:
        """A plan of ``items`` (rows whose id is in ``decoding`` decode one token), on the engine's threads."""
        return cls(cast("tuple[Row, ...]", tuple(r for r, _ in items if id(r) in decoding)),
                   cast("tuple[tuple[Row, int], ...]",
                        tuple((r, c) for r, c in items if id(r) not in decoding and not r.scoring)),
                   cast("tuple[tuple[ScoreRow, int], ...]", tuple((r, c) for r, c in items if r.scoring)))

    def shrunk(self) -> CyclePlan | None:
        """A one-row plan of a prompt chunk cut to its first half (the rest waits for a later cycle);
        None when there is nothing left to cut (a decode token, a one-token chunk, several rows)."""
        items = self.items()
        if len(items) != 1 or self.decoding or items[0][1] < 2:
            return None
        row, c = items[0]
        return CyclePlan.of([(row, c // 2)], set())

    def split(self, *, halves: bool) -> list[CyclePlan]:
        """Smaller plans covering this one: two halves (``halves``) or one plan per row."""
        items = self.items()
        decoding = {id(r) for r in self.decoding}
        if halves and len(items) > 1:
            mid = len(items) // 2
            return [CyclePlan.of(items[:mid], decoding), CyclePlan.of(items[mid:], decoding)]
        return [CyclePlan.of([item], decoding) for item in items]


class CyclePlanner:
    """Plans each cycle over the scheduler's rows (see the module docstring)."""

    def __init__(self, config: EngineConfig, queues: RowQueues, ledger: BlockLedger, step_cost: StepCost,
                 wide_min_tokens: int | None):
        self.config = config
        self.oom_budget: int | None = None  # the token budget in force after an out-of-memory cycle (lower_after_oom)
        self.oom_budget_until = 0.0  # time.monotonic() at which it lifts
        self.queues = queues
        self.ledger = ledger
        self.step_cost = step_cost
        # prompt-only cycles with at least this many tokens run on config.prefill_threads (None: never)
        self.wide_min_tokens = wide_min_tokens
        self.oldest_wait: float | None = None  # perf_counter the oldest waiting row entered the queue
        # published after each plan (one assignment, read by any thread): (what the head of the queue
        # waits for, [(t_wait, prompt tokens, scoring)] of the first rows)
        self.queue_view: tuple[str | None, list[tuple[float, int, bool]]] = (None, [])

    def plan(self) -> CyclePlan:
        """Blocks for this cycle's decode tokens, then prompt chunks within the token budget.

        Decoding rows get the block their next token needs first, oldest row first; when the
        pool is out, the youngest running row is preempted (possibly the row itself).
        Generation prompts (those under way, then newly admitted ones) take the budget before
        scoring prompts, except for a quarter of it kept for scoring while any is pending; and
        scoring rows hold at most half the running slots (``scoring_slots``). So a burst of long
        scoring requests cannot keep a chat from being admitted and answered between their
        chunks, and a stream of chats cannot starve scoring. A prompt chunk shrinks to the
        blocks it can get (preempting only younger prefilling rows); a waiting row is admitted
        only while the pool can hold its prompt."""
        q = self.queues
        self._grow_decoding()
        budget = self.token_budget()
        total = budget - len(q.decoding)
        reserve = budget // 4
        mixed = self._mixed_allowance()
        if mixed is not None and mixed < total:
            total, reserve = mixed, max(1, mixed // 4)
        scoring_pending = any(r.scoring for r in q.prefilling) or any(r.scoring for r in q.waiting)
        chunks = _Chunks(self, total - (reserve if scoring_pending else 0))
        for row in [r for r in q.prefilling if not r.scoring]:
            if chunks.budget > 0:
                chunks.take(row)
        chunks.admit(lambda r: not r.scoring)
        chunks.budget = total - sum(c for _, c in chunks.taken)  # what is left, the scoring reserve included
        for row in [r for r in q.prefilling if r.scoring]:
            if chunks.budget > 0:
                chunks.take(row)
        chunks.admit(lambda r: r.scoring and sum(1 for p in q.prefilling if p.scoring) < self.scoring_slots)
        self.oldest_wait = min((r.t_wait for r in q.waiting), default=None)
        if q.waiting or self.queue_view[1]:
            self.queue_view = (chunks.blocked, [(r.t_wait, len(r.tokens), r.scoring)
                                                for r in list(q.waiting)[:QUEUE_DETAIL_MAX]])
        decoding = tuple(q.decoding)
        prompts = tuple((r, c) for r, c in chunks.taken if isinstance(r, Row))
        return CyclePlan(decoding, prompts, tuple((r, c) for r, c in chunks.taken if isinstance(r, ScoreRow)),
                         self._cycle_threads(decoding, chunks.taken))

    def token_budget(self) -> int:
        """``batching.token_budget``, or the lower budget in force for a while after an out-of-memory cycle."""
        if self.oom_budget is not None and time.monotonic() >= self.oom_budget_until:
            self.oom_budget = None  # the hold is over: plan the configured size again (a new OOM lowers it again)
        return self.config.token_budget if self.oom_budget is None else min(self.oom_budget, self.config.token_budget)

    def lower_after_oom(self, plan: CyclePlan) -> int:
        """After ``plan`` ran out of memory: plan at most half its tokens (never under ``MIN_OOM_BUDGET``) for the
        next ``OOM_BUDGET_HOLD_S`` seconds, instead of planning the same size and failing again; another
        out-of-memory cycle in that time halves it again and restarts the hold. Returns the budget in force."""
        tokens = min(sum(c for _, c in plan.items()), self.token_budget())
        lowered = max(MIN_OOM_BUDGET, tokens // 2)
        self.oom_budget = lowered if self.oom_budget is None else min(lowered, self.oom_budget)
        self.oom_budget_until = time.monotonic() + OOM_BUDGET_HOLD_S
        return self.token_budget()

    def _grow_decoding(self) -> None:
        """The block each decoding row's next token needs, oldest row first; when the pool is out the
        youngest running row not yet served this cycle is preempted (possibly the row itself)."""
        q = self.queues
        done: set[int] = set()
        for row in sorted(q.decoding, key=lambda r: r.seq):
            while row in q.decoding and not self.ledger.grow(row, row.pos + 1):
                victim = max((r for r in q.prefilling + q.decoding if id(r) not in done), key=lambda r: r.seq)
                q.preempt(victim)
            done.add(id(row))

    def _mixed_allowance(self) -> int | None:
        """Prompt tokens this cycle may carry beside the decoding rows so that it is expected to
        take at most ``mixed_step_factor`` times a decode-only cycle (at least
        ``MIN_MIXED_PROMPT_TOKENS``), scaled up with the age of the oldest prompt held back; None:
        no limit (nothing decoding, the factor off, no fit yet).

        The age scaling keeps a backlog from trickling in: when a burst arrives while a few rows
        decode, the allowance (a fraction of one cycle's cost, about 10 tokens on a model whose
        cycles are mostly weight reads) would admit the rest of the burst over a hundred cycles,
        each reading every weight for a handful of tokens. Once the oldest waiting or
        partly prefilled prompt has waited ``k x MIXED_AGE_CYCLES`` predicted decode cycles, a
        cycle may take ``k`` times the allowance, so the stall each cycle adds grows gently
        instead of jumping to the whole token budget."""
        factor = self.config.mixed_step_factor
        decoding = self.queues.decoding
        if not decoding or factor <= 0:
            return None
        extra = self.step_cost.extra_tokens(len(decoding), factor)
        if extra is None:
            return None
        held = [r.t_wait for r in self.queues.waiting] + [r.t_wait for r in self.queues.prefilling]
        cycle_s = self.step_cost.predict(len(decoding)) or 0.0
        scale = 1.0
        if held and cycle_s > 0.0:
            scale = max(1.0, (time.perf_counter() - min(held)) / (MIXED_AGE_CYCLES * cycle_s))
        return max(MIN_MIXED_PROMPT_TOKENS, int(extra * scale))

    def _cycle_threads(self, decoding: tuple[Row, ...], chunks: list[PlanItem]) -> int:
        """Torch threads for this cycle's forwards: ``prefill_threads`` for a prompt-only cycle
        with enough work to pay for them (:mod:`kiln.runtime.threads`), else 0 (the engine's own)."""
        if self.wide_min_tokens is None or decoding or sum(c for _, c in chunks) < self.wide_min_tokens:
            return 0
        return self.config.prefill_threads

    @property
    def scoring_slots(self) -> int:
        return max(1, self.config.max_running_rows // 2)


class _Chunks:
    """The prompt chunks of one plan being built: the budget left, what was taken, what blocked admission."""

    def __init__(self, planner: CyclePlanner, budget: int):
        self.planner = planner
        self.budget = budget
        self.taken: list[PlanItem] = []
        self._planned: set[int] = set()
        self.blocked: str | None = None

    def take(self, row: Row | ScoreRow) -> None:
        """The next chunk of ``row``'s prompt, shrunk to the blocks it can get (preempting only
        younger prefilling rows not planned yet)."""
        q, ledger = self.planner.queues, self.planner.ledger
        if row not in q.prefilling:
            return  # preempted by an older row this cycle
        c = min(len(row.tokens) - row.prefilled, self.planner.config.prefill_chunk_tokens, self.budget)
        while not ledger.grow(row, row.prefilled + c):
            younger = [r for r in q.prefilling if r.seq > row.seq and id(r) not in self._planned]
            if not younger:
                break
            q.preempt(max(younger, key=lambda r: r.seq))
        c = min(c, ledger.blocks_room(row))
        if c > 0:
            self.taken.append((row, c))
            self._planned.add(id(row))
            self.budget -= c

    def admit(self, pick: Callable[[Row | ScoreRow], bool]) -> None:
        """Admit waiting rows ``pick`` accepts, in queue order, while budget, running slots and blocks last."""
        q, cfg = self.planner.queues, self.planner.config
        while True:
            row = next((r for r in q.waiting if pick(r)), None)
            if row is None:
                return
            if self.budget <= 0:
                self.blocked = self.blocked or "token_budget"
                return
            if q.running() >= cfg.max_running_rows:
                self.blocked = self.blocked or "running_rows"
                return
            if not q.admit(row):
                self.blocked = self.blocked or "kv_budget"
                return
            self.take(row)
