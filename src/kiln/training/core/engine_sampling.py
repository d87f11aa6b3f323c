"""Sampling with a trainer's private adapter: the one sampler of OPD students and GRPO rollouts.

:func:`sample_policy` samples ``n`` completions per prompt with the private adapter's current weights.
On the built-in engine (:class:`kiln.runtime.engine.Engine`) the rows go through the serving engine's
continuous batching (:func:`sample_on_engine`): the adapter is named by its PEFT key, the prefix cache is
keyed ``key#<revision>`` (callers pass ``step-N``, the number of optimizer steps taken), every row has its own
seed (:func:`sample_seed`), and serving requests interleave with the rows. An engine that cannot run the
private adapter (vLLM serves from another process) gets one batched, seeded ``generate`` under exclusive
ownership (:func:`sample_batch`). Either way the caller gets token IDs only: log-probabilities for a loss
are computed by the trainer's own forward pass, never taken from the sampler.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kiln.errors import InvalidRequest

SUBMIT_RETRY_S = 0.05
SUBMIT_PATIENCE_S = 300.0
ENGINE_SAMPLER = "private adapter on the engine's continuous batching (kiln.training.core.engine_sampling)"
GENERATE_SAMPLER = "private adapter via PeftModel.generate (kiln.training.core.engine_sampling.sample_batch)"


def sample_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The seed of one row: job seed, step (or iteration), prompt index, sample index."""
    return (seed * 1_000_003 + step * 10_007 + prompt * 101 + sample) % (2**31 - 1)


def samples_on_engine(engine: Any) -> bool:
    """Whether ``engine`` samples a trainer's private adapter itself (the in-process built-in engine)."""
    from kiln.runtime.engine import Engine

    return isinstance(engine, Engine)


def sampler_name(engine: Any) -> str:
    """How :func:`sample_policy` samples on ``engine``, for reports."""
    return ENGINE_SAMPLER if samples_on_engine(engine) else GENERATE_SAMPLER


def check_samples_fit_queue(engine: Any, n: int, param: str) -> None:
    """400 ``samples_exceed_queue`` when one prompt's ``n`` rows cannot be queued together."""
    queue = getattr(engine.config, "max_queued_rows", None)
    if queue is not None and n > queue:
        raise InvalidRequest(f"{param}={n} exceeds the engine's queue (batching.max_queued_rows={queue}): one "
                             "prompt's samples are queued together", code="samples_exceed_queue", param=param,
                             hint=f"use at most {queue}")


def _per_prompt(value: int | Sequence[int], count: int) -> list[int]:
    return [value] * count if isinstance(value, int) else list(value)


def sample_policy(peft_model: Any, loop: Any, engine: Any, prompts: Sequence[list[int]], n: int | Sequence[int],
                  max_tokens: int | Sequence[int], temperature: float, top_p: float, *, seed: int, seed_step: int,
                  revision: str, pad_id: int, end_ids: Sequence[int]) -> list[list[int]]:
    """``n`` completions per prompt (prompt-major) from the private adapter ``loop.name`` as it is now, at
    most ``max_tokens`` each; either may be one value per prompt (all rows are sampled in one batch).

    ``seed_step`` enters every row's seed (:func:`sample_seed`), so the same step of a resumed job samples
    what the uninterrupted job did; ``revision`` names the adapter's current weights (the prefix-cache key).
    """
    import torch

    counts, budgets = _per_prompt(n, len(prompts)), _per_prompt(max_tokens, len(prompts))
    with torch.no_grad():
        if samples_on_engine(engine):
            seeds = [[sample_seed(seed, seed_step, k, j) for j in range(c)] for k, c in enumerate(counts)]
            return sample_on_engine(engine, loop.name, revision, prompts, counts, budgets, temperature, top_p,
                                    seeds=seeds, end_ids=end_ids)
        with loop.step_ownership():
            return sample_batch(peft_model, prompts, counts, budgets, temperature, top_p,
                                seed=sample_seed(seed, seed_step, 0, 0), pad_id=pad_id, end_ids=end_ids,
                                device=loop.device)


def sample_batch(peft_model: Any, prompts: Sequence[list[int]], n: int | Sequence[int],
                 max_tokens: int | Sequence[int], temperature: float, top_p: float, *, seed: int, pad_id: int,
                 end_ids: Sequence[int], device: Any) -> list[list[int]]:
    """``n`` completions per prompt (token IDs, through the first end-of-turn token, at most ``max_tokens``;
    either may be one value per prompt), one left-padded ``generate`` over all of them with the active
    (private) adapter. Seeded: the same step samples the same tokens after a resume. Used where the engine
    cannot run the private adapter.
    """
    import torch

    counts, budgets = _per_prompt(n, len(prompts)), _per_prompt(max_tokens, len(prompts))
    seqs = [list(p) for p, c in zip(prompts, counts) for _ in range(c)]
    limits = [b for b, c in zip(budgets, counts) for _ in range(c)]
    if not seqs:
        return []
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s):] = torch.tensor(s)
        attn[r, width - len(s):] = 1
    kw: dict[str, Any] = {"do_sample": temperature > 0}
    if temperature > 0:
        kw.update(temperature=temperature, top_p=top_p, top_k=0)
    with torch.random.fork_rng(devices=[] if str(device) == "cpu" else [device]):
        torch.manual_seed(seed)
        out = peft_model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                  max_new_tokens=max(limits), pad_token_id=pad_id, eos_token_id=list(end_ids) or None,
                                  use_cache=True, **kw)
    ends = set(end_ids)
    comps = []
    for row, limit in zip(out[:, width:].tolist(), limits):
        c = []
        for t in row[:limit]:
            c.append(t)
            if t in ends:
                break
        comps.append(c)
    return comps


def sample_on_engine(engine: Any, key: str, revision: str, prompts: Sequence[list[int]], n: int | Sequence[int],
                     max_tokens: int | Sequence[int], temperature: float, top_p: float, *,
                     seeds: Sequence[Sequence[int]], end_ids: Sequence[int]) -> list[list[int]]:
    """``n`` completions per prompt from the engine's continuous batching with the trainer's private adapter
    ``key`` (token IDs, through the first end-of-turn token), prompt-major like :func:`sample_batch`; ``n``
    and ``max_tokens`` may be one value per prompt.

    ``revision`` names the adapter's current weights: the engine keys the private adapter's prefix-cache
    blocks by ``key#revision``, so blocks computed before an optimizer step are never reused after it. Every
    row has its own seed (``seeds[prompt][sample]``), so a resumed job samples what the uninterrupted one did.
    All rows are queued under exclusive ownership: the engine's first cycle sees all of them (the same
    batches every time the same step runs), and serving requests interleave with them after that.
    """
    from kiln.runtime.sampling import SamplingParams

    counts, budgets = _per_prompt(n, len(prompts)), _per_prompt(max_tokens, len(prompts))
    # waves of whole prompts, at most half the engine's queue (serving keeps the other half)
    per_wave = max(1, engine.config.max_queued_rows // 2 // max(1, max(counts, default=1)))
    out: list[list[int]] = []
    for w in range(0, len(prompts), per_wave):
        subs: list[Any] = []
        try:
            _submit_all(engine, subs, [(list(p), [SamplingParams(
                max_tokens=budget, temperature=temperature, top_p=top_p, seed=sd,
                stop_token_ids=frozenset(end_ids)) for sd in row_seeds[:c]])
                for p, row_seeds, c, budget in zip(prompts[w:w + per_wave], seeds[w:w + per_wave],
                                                   counts[w:w + per_wave], budgets[w:w + per_wave])
                if c > 0], key, revision)
            for sub in subs:
                for stream in sub.streams:
                    toks: list[int] = []
                    while True:
                        chunk = stream.next_chunk_sync(None)
                        toks.extend(c.token_id for c in chunk.tokens)
                        if chunk.finish_reason is not None:
                            break
                    if chunk.finish_reason not in ("stop", "length"):
                        raise RuntimeError(f"policy sampling ended with {chunk.finish_reason!r}")
                    out.append(toks)
        finally:
            for sub in subs:
                sub.cancel()
    return out


def _submit_all(engine: Any, subs: list[Any], rows: list[tuple[list[int], list[Any]]], key: str,
                revision: str) -> None:
    """Queue every (prompt, params) for the private adapter under exclusive ownership (appending each
    submission to ``subs``). While serving fills the engine's queue, leave ownership so the engine can drain
    it, wait and retry the rest (for at most ``SUBMIT_PATIENCE_S``)."""
    from kiln.runtime.engine import EngineOverloaded

    pending = list(rows)
    deadline = time.monotonic() + SUBMIT_PATIENCE_S
    while pending:
        try:
            with engine.ownership.exclusive():
                while pending:
                    prompt, params = pending[0]
                    subs.append(engine.submit(prompt, params, adapter=key, incremental=False,
                                              private_revision=revision))
                    pending.pop(0)
        except EngineOverloaded:
            if time.monotonic() > deadline:
                raise
            time.sleep(SUBMIT_RETRY_S)
