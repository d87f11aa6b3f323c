"""How many CPU threads torch gets: for the engine's steady work, and for prompt-only cycles.

A CPU serving process shares its cores between the engine's matmuls and the
HTTP loop that parses requests and writes every stream's events. With every
core given to torch, the two fight (vLLM's CPU backend likewise keeps a core
for its front end), so ``model.threads = 0`` gives torch every core but one.

That reserved core has nothing to do while the engine prefills prompts with no
row decoding: a burst of requests has been parsed and every client is waiting
for its first token. Such a cycle is the whole of the burst's time to first
token, and with one thread it is one core's arithmetic. So a prompt-only cycle
with enough work runs on ``model.prefill_threads`` threads (by default every
core) and the engine goes back to its own count right after it. Measured on two
cores (docs/benchmarks.md): on the 31M-parameter Qwen3 shape a 64-token prefill
took 26.8 ms on one thread and 16.4 on two, eight prompts at once 80 vs 48 ms;
switching costs about 20 us each way. Below about ``WIDE_PREFILL_MIN_MACS``
multiply-adds a second thread does not pay (the built-in model's 256-token
prefill: 4.7 vs 5.0 ms), so smaller cycles stay on the engine's threads.

Decode cycles never widen: while rows decode, the HTTP loop is writing their
tokens and needs its core. Widening sets torch's process-wide count for the
cycle; threads that already use torch keep their own (:func:`pin_torch_threads`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

WIDE_PREFILL_MIN_MACS = 3e8  # a prompt-only cycle's multiply-adds (tokens x non-embedding weights) to widen


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """``model.threads = 0``: every core this process may use but one, which is left to the HTTP
    loop and clients (vLLM's CPU backend reserves one the same way). Measured on 2 cores
    (docs/serving.md): 1 torch thread served 1.8-2.1x the tokens/s of torch's default 2."""
    return max(1, usable_cores() - 1)


def engine_prefill_threads(model_threads: int, prefill_threads: int) -> int:
    """Threads for wide prompt-only cycles from the settings: ``prefill_threads`` when set, else
    every usable core when ``model.threads`` is left to Kiln (0), else 0 (no widening: a thread
    count the user chose is kept for every cycle)."""
    if prefill_threads:
        return prefill_threads
    return usable_cores() if model_threads == 0 else 0


def pin_torch_threads() -> int:
    """Fix the calling thread's torch thread count now; returns it.

    A thread takes torch's process-wide count when it first uses torch, and a wide cycle
    sets that count for as long as it runs: a worker thread whose first torch call fell
    in one would keep the wide count for good. Long-lived workers (the trainer, the eval
    worker) call this when they start, before any request can make a cycle wide."""
    import torch

    return torch.get_num_threads()


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[bool]:
    """Run the block with ``count`` torch threads when that is more than the calling thread has,
    then restore its count (a no-op otherwise); yields whether it widened."""
    import torch

    base = torch.get_num_threads()
    if count <= base:
        yield False
        return
    torch.set_num_threads(count)
    try:
        yield True
    finally:
        torch.set_num_threads(base)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block on one torch thread when the calling thread has more (a wide prompt-only cycle),
    then restore its count: for runs of small ops whose fork/join costs more than a second thread gives."""
    import torch

    base = torch.get_num_threads()
    if base > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if base > 1:
            torch.set_num_threads(base)
