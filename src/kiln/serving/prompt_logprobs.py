"""Prompt-logprob scoring for ``/v1/completions``: ``prompt_logprobs`` and ``echo`` with ``logprobs``.

:func:`score` asks the engine for each prompt position's logprob and top entries (one admission,
cancelled on disconnect or timeout); the rest turns those rows into the response's JSON shapes.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from starlette.types import Receive

from kiln.runtime.engine import UnknownAdapter
from kiln.runtime.scoring import PromptLogprobRow
from kiln.serving.admission import admission_over
from kiln.serving.generation import until_done
from kiln.serving.prepare import unknown_model
from kiln.serving.state import KilnState


async def score(state: KilnState, prompt: list[int], k: int, adapter: str | None, receive: Receive,
                 timeout: float) -> list[PromptLogprobRow | None]:
    try:
        fut = state.engine.score_prompt(prompt, k, adapter=adapter)
    except UnknownAdapter as exc:  # unloaded between resolution and admission
        raise unknown_model(state, str(exc)) from exc
    admission_over()
    rows: list[PromptLogprobRow | None] = await until_done(
        receive, asyncio.wrap_future(fut), fut.cancel, timeout, "scoring",
        "score a shorter prompt or raise server.request_timeout_s")
    return rows


def prompt_logprobs_json(rows: list[PromptLogprobRow | None],
                         tt: Callable[[int], str]) -> list[dict[str, dict[str, Any]] | None]:
    """One ``{token id: PromptLogprob}`` per prompt position (``None`` first)."""
    return [
        None if row is None else {
            str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": tt(e.token_id)} for e in row
        }
        for row in rows
    ]


def echo_logprobs(prompt: list[int], rows: list[PromptLogprobRow | None], k: int,
                  tt: Callable[[int], str]) -> dict[str, Any]:
    """``CompletionLogprobs`` of the prompt itself (``echo`` with ``logprobs``): the first token has none."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for tid, row in zip(prompt, rows):
        s = tt(tid)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if row is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(row[0].logprob)  # the actual token comes first
        out["top_logprobs"].append({tt(e.token_id): e.logprob for e in _top_entries(row, k)})
    return out


def join_logprobs(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None or b is None:
        return a or b
    shift = sum(len(t) for t in a["tokens"])
    return {"tokens": a["tokens"] + b["tokens"], "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
            "top_logprobs": a["top_logprobs"] + b["top_logprobs"],
            "text_offset": a["text_offset"] + [o + shift for o in b["text_offset"]]}


def trim_rows(rows: list[PromptLogprobRow | None], k: int) -> list[PromptLogprobRow | None]:
    """Rows scored with more top entries than ``k``, cut back to the actual token plus the top ``k``
    (the layout of :func:`kiln.runtime.scoring.chunk_rows`)."""
    out: list[PromptLogprobRow | None] = []
    for row in rows:
        if row is None:
            out.append(None)
            continue
        entries = {row[0].token_id: row[0]}
        entries.update((e.token_id, e) for e in _top_entries(row, k))
        out.append(list(entries.values()))
    return out


def _top_entries(row: PromptLogprobRow, k: int) -> PromptLogprobRow:
    """The ``k`` best entries of a scored row (ranks are 1-based positions among the top)."""
    return sorted(row, key=lambda e: e.rank)[:k]
