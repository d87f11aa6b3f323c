"""Sequential corrections: an adapter keeps the corrections it was trained on, and a job continuing it replays them.

Each SFT job with inline examples records ``corrections`` in its effective request, which goes into the
published revision's manifest config: the examples of the parent revision that are kept, then the job's own.
A job continuing ``base_adapter`` (``kiln train sft --base-adapter``, the dashboard's correct-an-answer flow on an
existing adapter) trains on both unless ``replay_corrections`` is false, so ten corrections made one after
another are all still answered (docs/training.md, "Sequential corrections"). A new correction of the same
conversation (the same messages before the last assistant turn) replaces the stored one. The stored list is
bounded by :data:`~kiln.training.schemas.MAX_CORRECTION_BYTES` of canonical JSON; the oldest are dropped first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.canonical import canonical_json_bytes
from kiln.training.schemas import MAX_CORRECTION_BYTES, SFTExample

if TYPE_CHECKING:
    from kiln.adapters.store import AdapterRecord

CORRECTIONS_KEY = "corrections"  # manifest config key: the corrections a revision was trained on


def _question(example: dict[str, Any]) -> bytes:
    """What a correction answers: its messages up to (not including) the last assistant turn."""
    msgs = example["messages"]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return canonical_json_bytes(msgs[:last])


def stored_corrections(parent: AdapterRecord | None) -> list[dict[str, Any]]:
    """The corrections recorded with ``parent``'s revision (none for another kind or an older revision)."""
    if parent is None:
        return []
    stored = parent.manifest.config.get(CORRECTIONS_KEY)
    return [e for e in stored if isinstance(e, dict)] if isinstance(stored, list) else []


def bounded(corrections: list[dict[str, Any]], limit: int = MAX_CORRECTION_BYTES) -> list[dict[str, Any]]:
    """The newest corrections whose canonical JSON fits in ``limit`` bytes, oldest first."""
    kept: list[dict[str, Any]] = []
    size = 2
    for e in reversed(corrections):
        size += len(canonical_json_bytes(e)) + 1
        if size > limit:
            break
        kept.append(e)
    return kept[::-1]


def with_corrections(parent: AdapterRecord | None, examples: list[SFTExample], *, replay: bool
                     ) -> tuple[list[SFTExample], list[dict[str, Any]], int]:
    """``(examples to train on, corrections to record, how many were replayed)`` for a job continuing
    ``parent`` with ``examples``: with ``replay`` the parent's corrections not answered again here come first."""
    own = [e.model_dump(mode="json") for e in examples]
    asked = {_question(e) for e in own}
    earlier = [e for e in stored_corrections(parent) if _question(e) not in asked] if replay else []
    record = bounded(earlier + own)
    replayed = [SFTExample.model_validate(e) for e in earlier if e in record]
    return replayed + list(examples), record, len(replayed)
