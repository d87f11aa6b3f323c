"""OPD's teacher-path rows: the teacher's greedy answer, scored teacher-forced beside the student's samples.

On-policy forward KL only teaches the positions the student visits. Past the first token where the student's
sample leaves the teacher's answer, the teacher is scoring a wrong prefix, so a student that gives the
teacher's answer almost no probability learns it about one divergent token per visit. The teacher-path row
adds the teacher's own greedy answer to each step, teacher-forced (off-policy positions, as GKD mixes
on-policy samples with fixed sequences), through the scoring interface every teacher has (no generation):

* the first time a prompt is chosen its path is finished by the teacher alone, one token per round for all
  unfinished chosen prompts at once: the teacher scores teacher prompt + known prefix + a dummy token, and its
  top-1 in the dummy's row is the next token (:meth:`TeacherPaths.discover`; at most ``max_tokens`` calls);
* every scored completion is also checked as speculative decoding checks a draft: its longest prefix whose
  tokens are all the teacher's top-1, plus the teacher's top-1 where it first is not, is a prefix of the
  teacher's greedy answer (:meth:`TeacherPaths.observe`);
* each step adds one row per chosen prompt: the known path, then (if the path is not whole) the student's own
  sample from it (:meth:`TeacherPaths.rows_to_sample`).

A job saves the paths in its checkpoints (:meth:`TeacherPaths.to_tensor` / :meth:`load_tensor`), so a resumed
job samples what the uninterrupted one did. Pure Python except the two tensor converters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
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

    def discover(self, chosen: Sequence[int], max_tokens: int,
                 score_next: Callable[[list[tuple[int, list[int]]]], list[dict[int, float]]]) -> int:
        """Finish the paths of ``chosen`` with the teacher alone, one token per round for every unfinished path
        at once: ``score_next([(prompt, prefix), ...])`` returns the teacher's row for the token after each
        prefix. Ends when every path is whole or ``max_tokens`` long; returns the number of rounds (teacher calls).
        """
        rounds = 0
        while True:
            todo = [i for i in dict.fromkeys(chosen) if not self.complete(i) and len(self.paths[i]) < max_tokens]
            if not todo:
                return rounds
            rows = score_next([(i, self.prefix(i)) for i in todo])
            rounds += 1
            grew = False
            for i, row in zip(todo, rows):
                best = teacher_top1(row)
                if best is not None:
                    self.paths[i].append(best)
                    grew = True
            if not grew:
                return rounds
