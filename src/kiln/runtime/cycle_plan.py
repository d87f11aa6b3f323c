"""How one engine cycle spends its token budget: decode blocks first (preempting the youngest row when the
pool is out), then prompt chunks for generation and scoring rows, admission from the waiting queue, the
mixed-step allowance beside decoding rows, and the torch threads of a prompt-only cycle.

:class:`CyclePlanner` is the planning half of :class:`kiln.runtime.scheduler.Scheduler` (which owns the rows,
the KV pool and the actor thread, and provides the attributes and block operations declared below).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kiln.runtime.engine_config import EngineConfig
    from kiln.runtime.paged_kv import BlockPool
    from kiln.runtime.rows import Row, ScoreRow
    from kiln.runtime.step_cost import StepCost

QUEUE_DETAIL_MAX = 32  # waiting rows listed one by one in stats()["queue"] (the count covers all)
MIN_MIXED_PROMPT_TOKENS = 4  # prompt tokens a cycle beside decoding rows always may take (so prompts progress)
# the mixed_step_factor allowance grows by one more of itself for every this many decode cycles the oldest
# held-back prompt has waited (so a backlog is served in about sqrt(2 x cycles x backlog / allowance) cycles)
MIXED_AGE_CYCLES = 4


class CyclePlanner:
    """Plans a cycle over the scheduler's row lists (mixed into the scheduler)."""

    config: EngineConfig
    kv: BlockPool
    step_cost: StepCost
    _decoding: list[Row]
    _prefilling: list[Row | ScoreRow]
    _waiting: deque[Row | ScoreRow]
    _queue_view: tuple[str | None, list[Any]]
    _oldest_wait: float | None
    _wide_min_tokens: int | None

    def _grow(self, row: Row | ScoreRow, positions: int) -> bool: ...
    def _preempt(self, row: Row | ScoreRow) -> None: ...
    def _admit(self, row: Row | ScoreRow) -> bool: ...
    def _running(self) -> int: ...

    def _plan(self) -> list[tuple[Row | ScoreRow, int]]:
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
        cfg = self.config
        done: set[int] = set()
        for row in sorted(self._decoding, key=lambda r: r.seq):
            while row in self._decoding and not self._grow(row, row.pos + 1):
                victim = max((r for r in self._prefilling + self._decoding if id(r) not in done), key=lambda r: r.seq)
                self._preempt(victim)
            done.add(id(row))
        total = cfg.token_budget - len(self._decoding)
        reserve = cfg.token_budget // 4
        mixed = self._mixed_allowance()
        if mixed is not None and mixed < total:
            total, reserve = mixed, max(1, mixed // 4)
        scoring_pending = any(r.scoring for r in self._prefilling) or any(r.scoring for r in self._waiting)
        budget = [total - (reserve if scoring_pending else 0)]
        chunks: list[tuple[Row | ScoreRow, int]] = []
        planned: set[int] = set()

        def take(row: Row | ScoreRow) -> None:
            if row not in self._prefilling:
                return  # preempted by an older row this cycle
            c = min(len(row.tokens) - row.prefilled, cfg.prefill_chunk_tokens, budget[0])
            while not self._grow(row, row.prefilled + c):
                younger = [r for r in self._prefilling if r.seq > row.seq and id(r) not in planned]
                if not younger:
                    break
                self._preempt(max(younger, key=lambda r: r.seq))
            c = min(c, len(row.blocks) * self.kv.block_size - row.prefilled)
            if c > 0:
                chunks.append((row, c))
                planned.add(id(row))
                budget[0] -= c

        blocked: list[str | None] = [None]

        def admit(pick: Callable[[Row | ScoreRow], bool]) -> None:
            while True:
                row = next((r for r in self._waiting if pick(r)), None)
                if row is None:
                    return
                if budget[0] <= 0:
                    blocked[0] = blocked[0] or "token_budget"
                    return
                if self._running() >= cfg.max_running_rows:
                    blocked[0] = blocked[0] or "running_rows"
                    return
                if not self._admit(row):
                    blocked[0] = blocked[0] or "kv_budget"
                    return
                self._waiting.remove(row)
                take(row)

        for row in [r for r in self._prefilling if not r.scoring]:
            if budget[0] > 0:
                take(row)
        admit(lambda r: not r.scoring)
        budget[0] = total - sum(c for _, c in chunks)  # what is left, the scoring reserve included
        for row in [r for r in self._prefilling if r.scoring]:
            if budget[0] > 0:
                take(row)
        admit(lambda r: r.scoring and sum(1 for p in self._prefilling if p.scoring) < self.scoring_slots)
        self._oldest_wait = min((r.t_wait for r in self._waiting), default=None)
        if self._waiting or self._queue_view[1]:
            self._queue_view = (blocked[0], [(r.t_wait, len(r.tokens), r.scoring)
                                             for r in list(self._waiting)[:QUEUE_DETAIL_MAX]])
        return chunks

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
        if not self._decoding or factor <= 0:
            return None
        extra = self.step_cost.extra_tokens(len(self._decoding), factor)
        if extra is None:
            return None
        held = [r.t_wait for r in self._waiting] + [r.t_wait for r in self._prefilling]
        cycle_s = self.step_cost.predict(len(self._decoding)) or 0.0
        scale = 1.0
        if held and cycle_s > 0.0:
            scale = max(1.0, (time.perf_counter() - min(held)) / (MIXED_AGE_CYCLES * cycle_s))
        return max(MIN_MIXED_PROMPT_TOKENS, int(extra * scale))

    def _cycle_threads(self, decoding: list[Row], chunks: list[tuple[Row | ScoreRow, int]]) -> int:
        """Torch threads for this cycle's forwards: ``prefill_threads`` for a prompt-only cycle
        with enough work to pay for them (:mod:`kiln.runtime.threads`), else 0 (the engine's own)."""
        if self._wide_min_tokens is None or decoding or sum(c for _, c in chunks) < self._wide_min_tokens:
            return 0
        return self.config.prefill_threads

    @property
    def scoring_slots(self) -> int:
        return max(1, self.config.max_running_rows // 2)
