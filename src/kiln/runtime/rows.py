"""The scheduler's rows: a generated sequence (:class:`Row`) and a scored prompt (:class:`ScoreRow`).

A row carries what the scheduler needs from admission to cleanup: its tokens, its block table
and linear-state slot, its position and prefill progress, its adapter key; ``end`` delivers the
outcome (the final text and finish reason to the stream, or the scored rows to the future).
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from kiln.runtime.request_trace import RequestTrace
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scoring import PromptLogprobRow
from kiln.runtime.submission import EngineError, EngineNotRunning, RowFault, RowStream
from kiln.runtime.textstream import TextStream


class Row:
    """One generated sequence (one choice of a submission)."""

    scoring = False
    __slots__ = (
        "stream", "prompt", "params", "gen", "adapter_key", "prefilled", "pos", "generated",
        "text", "cancelled", "t_submit", "t_last", "eos_ids", "tokens", "blocks", "seq", "t_wait",
        "cache_uid", "registered", "cache_key", "state_slot", "t_admit", "t_first", "lock_wait", "trace",
    )

    def __init__(self, stream: RowStream, prompt: list[int], params: SamplingParams, gen: torch.Generator | None,
                 adapter_key: str, text: TextStream, eos_ids: frozenset[int], cache_key: str | None = None):
        self.stream = stream
        self.prompt = prompt
        self.params = params
        self.gen = gen
        self.adapter_key = adapter_key
        # prefix-cache namespace: the adapter key, or key#revision for a trainer's private adapter
        self.cache_key = cache_key or adapter_key
        self.tokens = prompt  # what prefill feeds: the prompt, plus the output so far after a preemption
        self.blocks: list[int] = []  # block table
        self.state_slot = -1  # linear-state slot of a hybrid model's row while it runs (-1: none)
        self.seq = 0  # admission order (kept across preemptions): younger rows are preempted first
        self.t_wait = 0.0  # when it (re)entered the queue
        self.cache_uid = 0  # prefix-cache uid of its last published block
        self.registered = 0  # blocks published to the prefix cache
        self.prefilled = 0
        self.pos = 0  # tokens held in the cache
        self.generated: list[int] = []
        self.text = text
        self.cancelled = False
        self.t_submit = time.perf_counter()
        self.t_last = 0.0
        self.eos_ids = eos_ids
        # phase stamps (kiln.runtime.request_trace): first admission, first token, ownership waits
        self.t_admit = self.t_first = self.lock_wait = 0.0
        self.trace: RequestTrace | None = None  # set when the recent-request log records this request

    def end(self, reason: str, fault: RowFault | None = None) -> RowStream:
        """Deliver the final text and the finish reason (and, for ``error``, the contained fault); returns
        the stream to wake."""
        tail = self.text.flush()
        self.stream.completion_tokens = len(self.generated)
        self.stream._push(tail, None)
        self.stream._close(reason, fault)
        return self.stream


class ScoreRow:
    """A ``prompt_logprobs`` request: the prompt prefilled in chunks, every position scored.

    With ``score_from`` > 1 only the rows from that position on are asked for: the prompt's first
    ``score_from - 1`` tokens may come from the prefix cache (whole blocks, keyed by the adapter key as a
    generation row's are), rows before them are ``None``, and the row publishes its own full blocks."""

    scoring = True
    __slots__ = ("prompt", "tokens", "top_k", "adapter_key", "future", "blocks", "seq", "t_wait", "prefilled", "pos",
                 "rows", "cancelled", "state_slot", "score_from", "cache_key", "cache_uid", "registered")

    def __init__(self, prompt: list[int], top_k: int, adapter_key: str, future: Future[list[PromptLogprobRow | None]], score_from: int = 0):
        self.score_from = score_from
        self.cache_key = adapter_key  # prefix-cache namespace (used only with score_from > 1)
        self.cache_uid = 0
        self.registered = 0
        self.prompt = prompt
        self.tokens = prompt
        self.top_k = top_k
        self.adapter_key = adapter_key
        self.future = future
        self.blocks: list[int] = []
        self.state_slot = -1
        self.seq = 0
        self.t_wait = 0.0
        self.prefilled = 0
        self.pos = 0
        self.rows: list[PromptLogprobRow | None] = [None]
        self.cancelled = False

    def end(self, reason: str, fault: RowFault | None = None) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # the caller cancelled it
        if reason == "stop":
            self.future.set_result(self.rows)
        elif reason == "error" and fault is not None:
            self.future.set_exception(fault.error())
        elif reason == "error":
            self.future.set_exception(EngineError("the engine failed while scoring this prompt"))
        else:
            self.future.set_exception(EngineNotRunning("scoring was aborted: the engine stopped"))
        return None
