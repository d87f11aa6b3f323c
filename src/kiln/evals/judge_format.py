"""The preference prompt format (``kiln.judge-preference.v1``) a judge adapter is asked in and trained on.

The judge reads one user turn that shows the prompt and two responses labelled ``A`` and ``B`` and
answers with one letter. Asking uses both orders and averages them (:mod:`kiln.evals.judge_preference`);
training shows every judgment in both orders too (:mod:`kiln.judgments.format`), so the labels are
balanced and the judge cannot learn the position.

Pure text; no torch.
"""

from __future__ import annotations

PREFERENCE_FORMAT = "kiln.judge-preference.v1"
CHOICES = ("A", "B")
_HEAD = "Which response answers the prompt better?\n\n### Prompt\n"
_A = "\n\n### Response A\n"
_B = "\n\n### Response B\n"
_TAIL = "\n\nAnswer with one letter: A or B."


def judge_messages(prompt: str, first: str, second: str) -> list[dict[str, str]]:
    """The judge's chat turn for ``first`` shown as A and ``second`` as B (plain concatenation: text in a
    response is never read as a placeholder)."""
    return [{"role": "user", "content": _HEAD + prompt + _A + first + _B + second + _TAIL}]
