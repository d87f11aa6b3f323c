"""Keeping what the base model knew: the KL-to-base anchor every training job kind adds to its loss.

A LoRA adapter trained on one correction moves every answer of a small model, not only the corrected one: on
the built-in model the old SFT defaults learned "Which bird guards the old mill?" in 10 steps and left 9 of 10
unrelated answers degenerate (issue 48, ``bench/locality.py``). The anchor pulls the adapter back towards the
base model (all adapters disabled) everywhere the job has nothing to teach, with no data from the user:

* the base model writes ``questions`` user questions of its own, sampled from the chat template's user-turn
  prefix (temperature 1, seeded), and answers each greedily (:mod:`kiln.training.core.rehearsal` writes them as
  it does OPD's rehearsal rows); the base's top-K log-probabilities at every answer token are kept;
* every optimizer step adds ``per_step`` of those rows, in turn, and the loss
  ``weight * mean_token D_tail(base || adapter)`` (the sparse forward KL with a tail bucket of
  :func:`kiln.training.losses.kd.linear_sparse_kd`) on their answer tokens.

The rows depend only on the base model and the settings, so one process builds them once per base model and
every later job reuses them (:func:`base_anchor`): a correction pays for them once, not per job. Rows whose prompt
is one of the job's own prompts are left out (the job decides those answers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.training.core.data import Row, collate
from kiln.training.core.loop import Piece
from kiln.training.schemas import DEFAULT_ANCHOR_PER_STEP, DEFAULT_ANCHOR_QUESTIONS, DEFAULT_ANCHOR_WEIGHT

ANCHOR_TOP_K = 32
ANCHOR_MAX_TOKENS = 48
ANCHOR_SEED = 0


@dataclass(frozen=True)
class AnchorSettings:
    """What an anchor is built from (the cache key with the base model) and how much each step uses."""

    questions: int = DEFAULT_ANCHOR_QUESTIONS
    per_step: int = DEFAULT_ANCHOR_PER_STEP
    weight: float = DEFAULT_ANCHOR_WEIGHT
    top_k: int = ANCHOR_TOP_K
    max_tokens: int = ANCHOR_MAX_TOKENS
    seed: int = ANCHOR_SEED

    prompts: tuple[str, ...] = ()  # the caller's own questions, beside the ``questions`` the base writes

    @property
    def on(self) -> bool:
        return (self.questions > 0 or bool(self.prompts)) and self.per_step > 0 and self.weight > 0

    def build_key(self) -> tuple[int, int, int, int]:
        return (self.questions, self.top_k, self.max_tokens, self.seed)


@dataclass(frozen=True)
class AnchorRow:
    """One base answer: the row (prompt + answer, loss mask on the answer) and the base's sparse distribution
    at each answer token (``ids``/``logp``/``mask``: ``[n, S]``; ``tail``: ``[n]`` mass outside ``ids``)."""

    prompt: tuple[int, ...]
    row: Row
    ids: torch.Tensor
    logp: torch.Tensor
    mask: torch.Tensor
    tail: torch.Tensor


class Anchor:
    """A job's anchor rows and weight; :meth:`loss` is one step's KL-to-base term."""

    def __init__(self, rows: Sequence[AnchorRow], settings: AnchorSettings):
        self.rows, self.settings = list(rows), settings

    def __len__(self) -> int:
        return len(self.rows)

    def without(self, prompts: Sequence[Sequence[int]]) -> Anchor:
        """The anchor less the rows whose prompt starts one of ``prompts`` (a job's own questions)."""
        own = [tuple(p) for p in prompts]
        keep = [r for r in self.rows if not any(p[:len(r.prompt)] == r.prompt for p in own)]
        return Anchor(keep, self.settings)

    def for_step(self, step: int) -> list[AnchorRow]:
        k = min(self.settings.per_step, len(self.rows))
        return [self.rows[(step * k + j) % len(self.rows)] for j in range(k)] if k else []

    def tokens(self, step: int) -> int:
        """The real tokens step ``step``'s rows run (sizes the anchor's piece of a sliced step)."""
        return sum(len(r.row.input_ids) for r in self.for_step(step))

    def loss(self, peft_model: Any, split: Any, step: int, pad_id: int, device: Any) -> torch.Tensor | None:
        """``weight x`` the mean per-token D_tail(base || adapter) on step ``step``'s rows, with gradients
        (the private adapter active); None when the anchor is empty."""
        from kiln.training.losses.kd import SparseKDLoss, linear_sparse_kd

        chosen = self.for_step(step)
        if not chosen:
            return None
        batch = collate([r.row for r in chosen], pad_id, device)
        ids = batch["input_ids"]
        rows, cols = batch["loss_mask"][:, 1:].bool().nonzero(as_tuple=True)
        sel = torch.cat([r.ids for r in chosen]).to(device)
        lp = torch.cat([r.logp for r in chosen]).to(device)
        mask = torch.cat([r.mask for r in chosen]).to(device)
        tail = torch.cat([r.tail for r in chosen]).to(device)
        target = ids[rows, cols + 1]
        if split is not None:
            h = split.hidden(ids)[rows, cols]
            loss, _ = linear_sparse_kd(h, split.head.weight, sel, lp, mask, tail, target, ce_weight=0.0,
                                       kd_weight=self.settings.weight)
            return loss
        logits = peft_model(input_ids=ids, use_cache=False).logits[rows, cols]
        loss, _ = SparseKDLoss(ce_weight=0.0, kd_weight=self.settings.weight)(logits, sel, lp, mask, tail, target)
        return loss


def anchor_settings(request: dict[str, Any]) -> AnchorSettings:
    """The anchor of a job's effective request (its ``anchor_*`` fields, resolved by
    :func:`kiln.training.core.plan.anchor_fields`); a request stored before they existed has none."""
    return AnchorSettings(questions=int(request.get("anchor_questions") or 0),
                          per_step=int(request.get("anchor_per_step") or DEFAULT_ANCHOR_PER_STEP),
                          weight=float(request.get("anchor_weight") or 0.0),
                          prompts=tuple(request.get("anchor_prompts") or ()))


def anchor_rows(peft_model: Any, tokenizer: Any, settings: AnchorSettings, *, pad_id: int,
                end_ids: Sequence[int], questions: Sequence[str] | None = None) -> list[AnchorRow]:
    """The base model's greedy answers with its top-K rows (all adapters disabled) to ``questions`` (user
    messages), or when None to ``settings.questions`` questions the base writes itself. Call under exclusive
    ownership of the model."""
    from kiln.training.core.data import grpo_prompt_ids
    from kiln.training.core.rehearsal import build_rehearsal, user_turn_prefix, write_questions

    device = next(peft_model.parameters()).device
    with torch.no_grad():
        if questions is None:
            prefix = user_turn_prefix(lambda m: tokenizer.apply_chat_template(m, tokenize=False),
                                      lambda s: list(tokenizer.encode(s, add_special_tokens=False)))
            asked = write_questions(peft_model, prefix, settings.questions, settings.max_tokens,
                                    seed=settings.seed, pad_id=pad_id, end_ids=end_ids, device=device)
        else:
            asked = [list(tokenizer.encode(q, add_special_tokens=False)) for q in questions]

        def chat_prompt(q: list[int]) -> list[int]:
            text = tokenizer.decode(q, skip_special_tokens=True).strip()
            return grpo_prompt_ids(tokenizer, [{"role": "user", "content": text}])

        rehearsal = build_rehearsal(peft_model, asked, chat_prompt=chat_prompt, exclude=[],
                                    max_tokens=settings.max_tokens, top_k=settings.top_k, pad_id=pad_id,
                                    end_ids=end_ids, device=device)
    return [_anchor_row(item) for item in rehearsal.items]


def _anchor_row(item: Any) -> AnchorRow:
    """One rehearsal item (prompt, base answer, top-K rows) as an anchor row."""
    width = max(len(d) for d in item.rows)
    n = len(item.rows)
    ids = torch.zeros((n, width), dtype=torch.long)
    logp = torch.zeros((n, width), dtype=torch.float32)
    mask = torch.zeros((n, width), dtype=torch.bool)
    for j, d in enumerate(item.rows):
        ids[j, :len(d)] = torch.tensor(list(d.keys()))
        logp[j, :len(d)] = torch.tensor(list(d.values()))
        mask[j, :len(d)] = True
    tail = (1.0 - torch.where(mask, logp.double().exp(), 0.0).sum(-1)).clamp(min=0.0).float()
    seq = list(item.prompt) + list(item.answer)
    row = Row(seq, [0] * len(item.prompt) + [1] * len(item.answer))
    return AnchorRow(tuple(item.prompt), row, ids, logp, mask, tail)


_CACHE: dict[tuple[Any, ...], list[AnchorRow]] = {}
_CACHE_LOCK = threading.Lock()
MAX_CACHED_ANCHORS = 8


def base_anchor(key: str, build: Callable[[], list[AnchorRow]], settings: AnchorSettings) -> Anchor:
    """The anchor of base model ``key`` (its SHA-256) with ``settings``: built by ``build`` the first time, then
    reused by every job of this process (the rows depend only on the base model and ``settings.build_key()``)."""
    full = (key, *settings.build_key())
    with _CACHE_LOCK:
        rows = _CACHE.get(full)
    if rows is None:
        rows = build()
        with _CACHE_LOCK:
            if len(_CACHE) >= MAX_CACHED_ANCHORS:
                _CACHE.pop(next(iter(_CACHE)))
            _CACHE[full] = rows
    return Anchor(rows, settings)


def model_anchor(peft_model: Any, loaded: Any, settings: AnchorSettings) -> Anchor:
    """The anchor of the served model ``loaded`` (:class:`kiln.runtime.loader.LoadedModel`) with ``settings``,
    built in ``peft_model`` on first use (:func:`base_anchor`). Call under exclusive ownership of the model: a
    job's recipe (:meth:`kiln.training.core.recipe.TrainingRecipe.anchor`) and the start-up warm-up
    (:mod:`kiln.training.core.warmup`) both come here, so they share one cache entry."""
    from kiln.training.core.templates import end_of_turn_ids

    tok = loaded.tokenizer
    end_ids = sorted(end_of_turn_ids(tok, getattr(loaded.model, "generation_config", None)))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else end_ids[0]
    own: list[AnchorRow] = []
    if settings.prompts:  # the caller's questions first, so a short job rehearses them all
        own = base_anchor(f"{loaded.base_model_sha256}:{prompts_key(settings.prompts)}", lambda: anchor_rows(
            peft_model, tok, settings, pad_id=pad_id, end_ids=end_ids, questions=list(settings.prompts)),
            settings).rows
    if not settings.questions:
        return Anchor(own, settings)
    written = base_anchor(loaded.base_model_sha256, lambda: anchor_rows(
        peft_model, tok, settings, pad_id=pad_id, end_ids=end_ids), settings)
    return Anchor(own + written.rows, settings)


def prompts_key(prompts: Sequence[str]) -> str:
    """A cache key for a list of anchor questions."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(list(prompts)).encode()).hexdigest()


def anchor_term(anchor: Any, peft_model: Any, split: Any, loop: Any, pad_id: int) -> Any:
    """The step's KL-to-base anchor loss (zero without rows) for the loop ``loop``
    (:class:`kiln.training.core.loop.TrainLoop`); its value is kept in the stats as ``anchor_kl``."""
    term = anchor.loss(peft_model, split, loop.step, pad_id, loop.device)
    if term is None:
        return torch.zeros((), device=loop.device)
    loop.stats["anchor_kl"] = round(float(term.detach()) / max(anchor.settings.weight, 1e-12), 6)
    loop.stats["anchor_rows"] = len(anchor)
    return term


def anchor_piece(anchor: Any, peft_model: Any, split: Any, loop: Any, pad_id: int) -> Piece:
    """The anchor term as its own piece of a sliced step (:class:`kiln.training.core.loop.Piece`, weight 1):
    its rows run in a hold of their own, not beside the job's rows."""
    return Piece(lambda: anchor_term(anchor, peft_model, split, loop, pad_id), 1.0, anchor.tokens(loop.step))
