"""The *update* step of an engine cycle: apply a :class:`~kiln.runtime.cycle_execute.ForwardOutput` to the
rows of its :class:`~kiln.runtime.cycle_plan.CyclePlan`.

In order: the ownership wait goes on the generation rows' phase stamps; every row advances (a decoding
row one position, a prompt row its chunk); completed prompt blocks go to the prefix cache; scoring rows
append their rows and those whose prompt is done end; partly prefilled rows rotate to the back; then
one token is sampled for each decoding row and each row whose prefill completed, and rows that reached
a stop, their length or a cancellation end. A failure while sampling one row ends that row alone
(finish reason ``error``). Any other failure here leaves rows half updated: the scheduler latches
(:mod:`kiln.runtime.cycle_faults`, ``unknown_state``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from kiln.runtime.cycle_execute import ForwardOutput
from kiln.runtime.cycle_faults import FaultHook
from kiln.runtime.cycle_plan import CyclePlan
from kiln.runtime.engine_config import EngineConfig
from kiln.runtime.kv_ledger import BlockLedger
from kiln.runtime.request_trace import Observer
from kiln.runtime.row_queues import RowQueues
from kiln.runtime.rows import Row, ScoreRow
from kiln.runtime.sampling import TokenChoice, select_tokens
from kiln.runtime.scoring import chunk_rows
from kiln.runtime.submission import RowStream

log = logging.getLogger("kiln.engine")

Finish = Callable[[Row | ScoreRow, str, list[RowStream]], None]


class CycleUpdate:
    """Applies forward outputs to rows (see the module docstring); ``finish`` is the scheduler's cleanup."""

    def __init__(self, config: EngineConfig, queues: RowQueues, ledger: BlockLedger, observer: Observer,
                 finish: Finish, shared_gen: torch.Generator, fault: FaultHook | None = None):
        self.config = config
        self.queues = queues
        self.ledger = ledger
        self.observer = observer
        self.finish = finish
        self.shared_gen = shared_gen
        self.fault = fault

    def apply(self, plan: CyclePlan, out: ForwardOutput) -> tuple[list[RowStream], float]:
        """Update the plan's rows; returns the streams to wake and the seconds spent sampling."""
        if self.fault is not None:
            self.fault.before_update(plan.rows)
        if out.lock_wait_s:  # a training step or an adapter change held ownership exclusively
            for row in plan.decoding:
                row.lock_wait += out.lock_wait_s
            for row, _ in plan.prompts:
                row.lock_wait += out.lock_wait_s
        for row in plan.decoding:
            row.pos += 1
        chunks: list[tuple[Row | ScoreRow, int]] = [*plan.prompts, *plan.scoring]
        for chunk_row, c in chunks:
            chunk_row.prefilled += c
            chunk_row.pos = chunk_row.prefilled
        for row, _ in plan.prompts:
            self.ledger.publish(row)
        touched: list[RowStream] = []
        if plan.scoring and out.score_logits is not None:
            self._scored(plan.scoring, out.score_logits, touched)
        self.queues.rotate([r for r, _ in chunks if r.prefilled < len(r.tokens)])
        rows = [*plan.decoding, *out.completing]
        sample_s = 0.0
        if rows:
            logits = [t for t in (out.decode_logits, out.prompt_logits) if t is not None]
            t0 = time.perf_counter()
            self._sample(rows, torch.cat(logits) if len(logits) > 1 else logits[0], out.completing, touched)
            sample_s = time.perf_counter() - t0
        return touched, sample_s

    def _scored(self, chunks: tuple[tuple[ScoreRow, int], ...], logits: torch.Tensor,
                touched: list[RowStream]) -> None:
        """Append each scoring row's chunk of rows (already advanced); end the rows now complete."""
        for i, (row, c) in enumerate(chunks):
            start = row.prefilled - c
            skip = max(0, min(c, row.score_from - 1 - start))  # positions whose rows were not asked for
            row.rows.extend([None] * skip)
            row.rows.extend(chunk_rows(logits[i, skip:c], row.prompt, start + skip, row.top_k))
            self.ledger.publish(row)
        for row, _ in chunks:
            if row.prefilled == len(row.tokens):
                self.finish(row, "stop", touched)

    def _choose(self, logits: torch.Tensor, rows: list[Row]) -> list[TokenChoice | None]:
        """One token per row; a row whose sampling fails gets ``None`` and the others are unharmed."""
        try:
            return list(select_tokens(logits, [r.params for r in rows], [r.gen for r in rows], self.shared_gen, rows))
        except Exception:
            log.exception("batched sampling failed; sampling the %d rows one by one", len(rows))
        out: list[TokenChoice | None] = []
        for i, r in enumerate(rows):
            try:
                out.append(select_tokens(logits[i : i + 1], [r.params], [r.gen], self.shared_gen, [r])[0])
            except Exception:
                log.exception("sampling failed for one row (params %s); ending that row", r.params)
                out.append(None)
        return out

    def _sample(self, rows: list[Row], logits: torch.Tensor, completing: tuple[Row, ...],
                touched: list[RowStream]) -> None:
        choices = self._choose(logits, rows)
        for row in completing:
            self.queues.to_decoding(row)
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
            self.finish(row, reason, touched)
