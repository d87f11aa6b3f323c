"""OPD's rehearsal rows: the base model's own answers to questions it writes itself, kept by the student.

An adapter trained on a few prompts moves every answer of a small model, not only theirs: on the built-in
model, ten facts distilled at once left 1-4 of ten unrelated answers repeating a token (bench/opd_transfer.py).
Rehearsal anchors the student to the base model (the adapter disabled) away from the job's prompts without any
data from the user, as self-synthesized rehearsal does for continual learning:

* once per job the base model writes ``n`` user questions, sampled (temperature 1, seeded) from the chat
  template's user-turn prefix, and answers each greedily; duplicates and the job's own prompts are dropped;
* the base model's top-K log-probabilities at every answer position are kept (:class:`Rehearsal`);
* each step adds as many rehearsal rows as it has prompts, teacher-forced on the base's answers, whose
  "teacher" rows are the base's: the same forward KL the samples get, pulling the student back towards the
  base model where the job has nothing to teach.

The questions are saved in each checkpoint (:meth:`Rehearsal.to_tensor`), so a resumed job rehearses what the
uninterrupted one did (the answers and rows are recomputed from the unchanged base model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

PAD = -1
REHEARSAL_TENSOR = "opd_rehearsal_questions"  # checkpoint tensor: the questions (Rehearsal.to_tensor)
SENTINEL = "\x01"  # stands for the question's text when the chat template is rendered


def user_turn_prefix(render: Callable[[list[dict[str, Any]]], str], encode_text: Callable[[str], list[int]]
                     ) -> list[int]:
    """The token IDs that open a user turn in the chat template: the rendered text of one user message up to
    its content (``render``: messages -> template text, without a generation prompt)."""
    text = render([{"role": "user", "content": SENTINEL}])
    if SENTINEL not in text:
        return []
    return encode_text(text.split(SENTINEL, 1)[0])


@dataclass(frozen=True)
class RehearsalRow:
    prompt: tuple[int, ...]  # the question as a chat prompt (ending with the assistant header)
    answer: tuple[int, ...]  # the base model's greedy answer, through its end-of-turn token
    rows: tuple[dict[int, float], ...]  # the base model's top-K log-probabilities at each answer token


class Rehearsal:
    """The job's rehearsal rows, handed out in turn (``k`` per step)."""

    def __init__(self, questions: Sequence[Sequence[int]], items: Sequence[RehearsalRow]):
        self.questions = [list(q) for q in questions]
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def for_step(self, step: int, k: int) -> list[RehearsalRow]:
        """Step ``step``'s ``k`` rows: the next ``k`` in turn (none when empty)."""
        if not self.items or k <= 0:
            return []
        return [self.items[(step * k + j) % len(self.items)] for j in range(k)]

    def add_to_step(self, step: int, k: int, pairs: list[Any], rows: list[dict[int, float]], tokens: list[int]) -> int:
        """Append step ``step``'s ``k`` rows to a step's (prompt, completion) ``pairs``, its per-token teacher
        ``rows`` and its completion ``tokens``, as :func:`kiln.training.opd.step.opd_loss` takes them; returns the
        number of tokens added."""
        added = 0
        for r in self.for_step(step, k):
            pairs.append((r.prompt, r.answer))
            rows += r.rows
            tokens += r.answer
            added += len(r.answer)
        return added

    def tensors(self) -> dict[str, Any]:
        """What a checkpoint keeps: the questions (:meth:`to_tensor`)."""
        return {REHEARSAL_TENSOR: self.to_tensor()}

    def to_tensor(self) -> Any:
        """``[questions, longest]`` int64 question token IDs, right-padded with ``PAD`` (for a checkpoint)."""
        import torch

        width = max([1] + [len(q) for q in self.questions])
        return torch.tensor([q + [PAD] * (width - len(q)) for q in self.questions] or [[PAD]], dtype=torch.long)


def questions_from_tensor(t: Any) -> list[list[int]]:
    """The question token IDs :meth:`Rehearsal.to_tensor` saved."""
    return [q for q in ([x for x in r if x != PAD] for r in t.tolist()) if q]


def write_questions(peft_model: Any, prefix: list[int], n: int, max_tokens: int, *, seed: int, pad_id: int,
                    end_ids: Sequence[int], device: Any) -> list[list[int]]:
    """``n`` questions sampled from the base model (adapter disabled) after the user-turn ``prefix``, at
    temperature 1, seeded; each cut at its end-of-turn token (dropped), empty ones left out."""
    from kiln.training.core.engine_sampling import sample_batch

    if not prefix or n <= 0:
        return []
    with peft_model.disable_adapter():
        drafts = sample_batch(peft_model, [prefix], n, max_tokens, 1.0, 1.0, seed=seed, pad_id=pad_id,
                              end_ids=end_ids, device=device)
    ends = set(end_ids)
    return [q for q in ([t for t in d if t not in ends] for d in drafts) if q]


def chat_prompts(questions: Sequence[Sequence[int]], chat_prompt: Callable[[list[int]], list[int]],
                 exclude: Sequence[Sequence[int]] = ()) -> list[list[int]]:
    """``questions`` (token IDs of each question's text) as chat prompts (``chat_prompt``), in order, without
    repeats and without the prompts in ``exclude``."""
    seen = {tuple(p) for p in exclude}
    prompts: list[list[int]] = []
    for q in questions:
        p = chat_prompt(list(q))
        if tuple(p) not in seen:
            seen.add(tuple(p))
            prompts.append(p)
    return prompts


def greedy_answers(peft_model: Any, prompts: Sequence[list[int]], *, max_tokens: int, pad_id: int,
                   end_ids: Sequence[int], device: Any) -> list[list[int]]:
    """The greedy answer (through its end-of-turn token, at most ``max_tokens``) of the model as it is now (its
    active adapter, or the base inside ``disable_adapter()``) to each prompt: one batched ``generate``."""
    import torch

    from kiln.training.core.engine_sampling import sample_batch

    with torch.no_grad():
        return sample_batch(peft_model, prompts, 1, max_tokens, 0.0, 1.0, seed=0, pad_id=pad_id, end_ids=end_ids,
                            device=device)


def build_rehearsal(peft_model: Any, questions: Sequence[Sequence[int]], *,
                    chat_prompt: Callable[[list[int]], list[int]], exclude: Sequence[Sequence[int]],
                    max_tokens: int, top_k: int, pad_id: int, end_ids: Sequence[int], device: Any) -> Rehearsal:
    """The rehearsal rows for ``questions`` (token IDs of each question's text): ``chat_prompt`` turns one into
    the student's chat prompt; prompts equal to one in ``exclude`` (the job's own) and repeats are dropped; the
    base model answers each greedily and its top-K rows on the answer are kept."""
    import torch

    from kiln.training.core.step import completion_logits

    prompts = chat_prompts(questions, chat_prompt, exclude)
    if not prompts:
        return Rehearsal(questions, [])
    with torch.no_grad(), peft_model.disable_adapter():
        answers = greedy_answers(peft_model, prompts, max_tokens=max_tokens, pad_id=pad_id, end_ids=end_ids,
                                 device=device)
        kept = [(p, a) for p, a in zip(prompts, answers) if a]
        if not kept:
            return Rehearsal(questions, [])
        logp = completion_logits(peft_model, kept, device).float().log_softmax(-1)
    top_v, top_i = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    items, at = [], 0
    for p, a in kept:
        rows = tuple({int(i): float(v) for i, v in zip(top_i[at + j].tolist(), top_v[at + j].tolist())}
                     | {int(t): float(logp[at + j, t])} for j, t in enumerate(a))
        items.append(RehearsalRow(tuple(p), tuple(a), rows))
        at += len(a)
    return Rehearsal(questions, items)


def question_prompt(engine: Any) -> Callable[[list[int]], list[int]]:
    """A written question's token IDs -> the chat prompt of one user turn holding its text (``engine``:
    ``encode_chat`` and ``decode``)."""
    return lambda q: engine.encode_chat([{"role": "user", "content": engine.decode(q).strip()}])


def job_rehearsal(peft_model: Any, render: Callable[[list[dict[str, Any]]], str], engine: Any, data: Any, *,
                  seed: int, pad_id: int, end_ids: Sequence[int], saved: Any = None) -> Rehearsal:
    """An OPD job's rehearsal rows (``data``: :class:`kiln.training.opd.job.OPDData`): ``data.rehearsal`` questions the
    base model writes (or the ones a checkpoint ``saved``), turned into chat prompts with ``engine.encode_chat``
    as the job's prompts are, the job's own prompts excluded. The caller holds exclusive ownership."""
    device = next(peft_model.parameters()).device
    if saved is not None:
        questions = questions_from_tensor(saved)
    else:
        questions = write_questions(peft_model, user_turn_prefix(render, engine.encode_text), data.rehearsal,
                                    data.max_tokens, seed=seed, pad_id=pad_id, end_ids=end_ids, device=device)
    return build_rehearsal(
        peft_model, questions, exclude=[it.student_ids for it in data.items],
        chat_prompt=question_prompt(engine),
        max_tokens=data.max_tokens, top_k=data.top_k, pad_id=pad_id, end_ids=end_ids, device=device)
