"""OPD's teacher-path rows: the teacher's greedy answer, found by the student's own drafts, scored teacher-forced.

On-policy forward KL only teaches the positions the student visits. Past the first token where the student's
sample leaves the teacher's answer, the teacher is scoring a wrong prefix, so a student that gives the
teacher's answer almost no probability learns it one divergent token per visit. The teacher-path row adds
the teacher's own greedy continuation to each step, teacher-forced (off-policy positions, as in GKD's mix of
on-policy and fixed sequences), without asking the teacher to generate:

* every scored completion is a draft checked against the teacher as speculative decoding checks one: its
  longest prefix whose every token is the teacher's top-1, plus the teacher's top-1 at the first token that
  is not, is a prefix of the teacher's greedy answer (:meth:`TeacherPaths.observe`);
* per prompt the longest such prefix found so far is kept (:meth:`TeacherPaths.prefix`), and each step one
  extra row per prompt is that prefix followed by the student's own sample from it, so the prefix grows by at
  least one token every time the prompt is visited and by the whole agreeing draft once the student follows.

The prefix depends only on the teacher and on which drafts were seen; a job saves it in its checkpoints
(:meth:`TeacherPaths.to_tensor` / :meth:`from_tensor`), so a resumed job samples what the uninterrupted one did.
Pure Python except the two tensor converters (torch imported there).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

PAD = -1


def teacher_top1(row: dict[int, float]) -> int | None:
    """The teacher's most likely token in one row (ties: the smaller ID), ``None`` for an empty row."""
    if not row:
        return None
    return min(row.items(), key=lambda kv: (-kv[1], kv[0]))[0]


class TeacherPaths:
    """Per prompt, the longest known prefix of the teacher's greedy answer (token IDs after the prompt)."""

    def __init__(self, n_prompts: int, end_ids: Iterable[int]):
        self.paths: list[list[int]] = [[] for _ in range(n_prompts)]
        self.end_ids = frozenset(end_ids)

    def prefix(self, i: int) -> list[int]:
        return list(self.paths[i])

    def complete(self, i: int) -> bool:
        """Whether prompt ``i``'s path already ends with an end-of-turn token (the whole greedy answer)."""
        p = self.paths[i]
        return bool(p) and p[-1] in self.end_ids

    def observe(self, i: int, completion: Sequence[int], rows: Sequence[dict[int, float]]) -> None:
        """Check one scored completion of prompt ``i`` (``rows[j]``: the teacher's row for ``completion[j]``) and
        keep what it proves of the greedy answer when that is longer than the known prefix."""
        proved: list[int] = []
        for tok, row in zip(completion, rows):
            best = teacher_top1(row)
            if best is None:
                break
            proved.append(best)
            if tok != best or best in self.end_ids:
                break
        known = self.paths[i]
        if len(proved) > len(known) and proved[:len(known)] == known and not self.complete(i):
            self.paths[i] = proved

    def mean_length(self) -> float:
        return sum(len(p) for p in self.paths) / max(1, len(self.paths))

    def to_tensor(self) -> Any:
        """``[prompts, longest]`` int64, right-padded with ``PAD`` (for a checkpoint)."""
        import torch

        width = max(1, max(len(p) for p in self.paths))
        return torch.tensor([p + [PAD] * (width - len(p)) for p in self.paths], dtype=torch.long)

    def load_tensor(self, t: Any) -> None:
        """Restore from :meth:`to_tensor`'s output (a checkpoint)."""
        rows = t.tolist()
        if len(rows) != len(self.paths):
            raise ValueError(f"teacher paths for {len(rows)} prompts, job has {len(self.paths)}")
        self.paths = [[x for x in r if x != PAD] for r in rows]

    def rows_to_sample(self, chosen: Sequence[int], max_tokens: int) -> list[tuple[int, list[int], int]]:
        """This step's teacher-path rows: ``(prompt index, known prefix, tokens left to sample)`` per chosen
        prompt whose path is not empty (0 left: the row is the prefix alone, nothing to sample)."""
        out = []
        for i in chosen:
            known = self.prefix(i)
            if known:
                out.append((i, known, 0 if self.complete(i) else max(0, max_tokens - len(known))))
        return out
