"""Ask a judge which of two responses is better, from the logprobs of ``A`` and ``B``.

The judge (the served base model or an adapter it serves, public or an eval's private load) reads the
:mod:`kiln.evals.judge_format` turn; its next-token logprobs of the two letters, renormalised over the
pair, give P(first is better). Each pair is asked in both orders and the two probabilities of the same
response averaged, which cancels a judge's preference for a position. Scoring uses the engine's prompt
scoring (one prefill per order and letter, no sampling), so the answer is the same for every seed.

Used by ``POST /v1/judgments/compare``, the eval ``judge`` scorer in ``preference`` mode and GRPO's
``judge`` reward in ``preference`` mode.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kiln.adapters.scope import last_user_text
from kiln.errors import Conflict, NotFound, RateLimited, Unavailable
from kiln.evals.judge_format import CHOICES, judge_messages

SCORE_TIMEOUT_S = 120.0
WINDOW = 8  # pairs in flight at once (4 prompt scorings each); the engine batches them
OVERLOAD_WAIT_S = 0.05


@dataclass(frozen=True)
class Preference:
    p_first: float  # P(x better than y), both orders averaged
    orders: tuple[float, float]  # P(x better) with x shown as A, then with x shown as B

    @property
    def preferred(self) -> str:
        return "a" if self.p_first > 0.5 else "b" if self.p_first < 0.5 else "tie"


def served_judge_revision(engine: Any, judge: str | None, *, param: str) -> str | None:
    """The revision the engine serves ``judge`` at (None: the base model); 404 ``judge_not_loaded``: a model
    this server does not serve now (as vLLM and Kiln's generation routes answer an unknown model or LoRA)."""
    if judge is None:
        return None
    revision = engine.active_adapters().get(judge)
    if revision is None:
        raise NotFound(f"judge adapter {judge!r} is not loaded", code="judge_not_loaded", param=param,
                       hint="load it with POST /v1/adapters/{name}/load")
    return revision


def choice_tokens(engine: Any) -> tuple[int, int]:
    """The token IDs of ``A`` and ``B`` as the first token of the judge's answer (after the chat
    template's generation prompt). A tokenizer that merges the letter with the prompt: 409."""
    rendered = engine.render_chat(judge_messages("p", "a", "b"))
    base = engine.encode_text(rendered)
    out = []
    for letter in CHOICES:
        ids = engine.encode_text(rendered + letter)
        if ids[: len(base)] != base or len(ids) != len(base) + 1:
            raise Conflict(f"this model's tokenizer does not encode the answer {letter!r} as one token after the "
                           "chat template", code="judge_format_unsupported")
        out.append(ids[-1])
    return out[0], out[1]


def _p_first(rows_a: list, rows_b: list) -> float:
    """P(A) renormalised over {A, B} from the last scored position of each prompt."""
    la, lb = rows_a[-1][0].logprob, rows_b[-1][0].logprob
    return 1.0 / (1.0 + math.exp(max(-700.0, min(700.0, lb - la))))


def preferences(engine: Any, adapter: str | None, items: Sequence[tuple[str, str, str]], *,
                timeout: float = SCORE_TIMEOUT_S, check: Callable[[], None] | None = None) -> list[Preference]:
    """``items``: (prompt, x, y) -> P(x better than y) each, scored by ``adapter`` (None: the base model).
    ``check`` runs between windows (an eval's cancellation)."""
    tok_a, tok_b = choice_tokens(engine)
    out: list[Preference] = []
    for start in range(0, len(items), WINDOW):
        if check is not None:
            check()
        futures = []
        try:
            for prompt, x, y in items[start:start + WINDOW]:
                for first, second in ((x, y), (y, x)):
                    ids = engine.encode_chat(judge_messages(prompt, first, second))
                    futures.append((_submit(engine, ids + [tok_a], adapter), _submit(engine, ids + [tok_b], adapter)))
            probs = []
            for fa, fb in futures:
                try:
                    probs.append(_p_first(fa.result(timeout), fb.result(timeout)))
                except TimeoutError:
                    raise Unavailable(f"the judge did not answer within {timeout:g} s", code="judge_timeout") from None
        finally:
            for pair in futures:
                for f in pair:
                    f.cancel()
        for k in range(0, len(probs), 2):
            as_a, as_b = probs[k], 1.0 - probs[k + 1]
            out.append(Preference((as_a + as_b) / 2, (as_a, as_b)))
    return out


def _submit(engine: Any, ids: list[int], adapter: str | None) -> Any:
    deadline = time.monotonic() + SCORE_TIMEOUT_S
    while True:
        try:
            return engine.score_prompt(ids, 0, adapter=adapter)
        except RateLimited:  # the engine's queue is full: wait for room (rows ahead of us finish)
            if time.monotonic() > deadline:
                raise
            time.sleep(OVERLOAD_WAIT_S)


def preference_verdicts(engine: Any, judge: str | None, suite: Any, completions: list[list[dict[str, Any]]],
                        threshold: float, *, check: Callable[[], None] | None = None) -> list[list[tuple[bool, str]]]:
    """An eval's ``judge`` scorer in preference mode: per example and sample, (passed, detail) where
    passed is P(sample better than the example's reference) >= ``threshold``."""
    items: list[Any] = []
    shape: list[int] = []
    for ex, comps in zip(suite.examples, completions):
        question = last_user_text(ex.messages)
        items.extend((question, c["text"], ex.reference) for c in comps)
        shape.append(len(comps))
    prefs = iter(preferences(engine, judge, items, check=check))
    out = []
    for n in shape:
        row = []
        for _ in range(n):
            p = next(prefs)
            row.append((p.p_first >= threshold, f"p_better={p.p_first:.6f} orders={p.orders[0]:.6f},{p.orders[1]:.6f}"))
        out.append(row)
    return out
