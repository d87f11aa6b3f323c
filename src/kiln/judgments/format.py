"""A judge adapter's training examples in the preference format (:mod:`kiln.evals.judge_format`).

Training shows every judgment in both orders (the preferred response once as ``A``, once as ``B``), so
the labels are balanced and the judge cannot learn the position. Asking also uses both orders and
averages them (:mod:`kiln.evals.judge_preference`).

Pure text; no torch.
"""

from __future__ import annotations

from typing import Any, Iterable

from kiln.canonical import canonical_sha256
from kiln.evals.judge_format import PREFERENCE_FORMAT, judge_messages


def training_examples(judgments: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """SFT examples for the non-tie ``judgments``: each in both orders, answered with the preferred letter."""
    out: list[dict[str, Any]] = []
    for j in judgments:
        if j["preferred"] == "tie":
            continue
        good, bad = (j["response_a"], j["response_b"]) if j["preferred"] == "a" else (j["response_b"], j["response_a"])
        for first, second, answer in ((good, bad, "A"), (bad, good, "B")):
            out.append({"messages": [*judge_messages(j["prompt"], first, second),
                                     {"role": "assistant", "content": answer}]})
    return out


def judgments_digest(judgments: Iterable[dict[str, Any]]) -> str:
    """SHA-256 over the trained judgments' IDs and contents, in order (recorded with the job)."""
    keep = ("id", "prompt", "response_a", "response_b", "preferred")
    return canonical_sha256({"format": PREFERENCE_FORMAT, "judgments": [{k: j[k] for k in keep} for j in judgments]})
