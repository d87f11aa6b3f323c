"""Fingerprint of the tokenized teacher dataset bound by a plan.

Each source file is kept by its exact source bytes (size + SHA-256) and also
normalized with soup-jsonl-c14n-v1; the dataset's ``normalized_sha256`` covers
the normalized bytes of all files concatenated in their listed order, so CRLF
or formatting-only variants of the same ordered rows share it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Sequence

from kiln.canonical import JSONL_C14N_ALGORITHM, JSONLNormalizationError, jsonl_c14n
from kiln.distill.contract import DatasetFingerprint, Plan, TokenizedTeacherExample
from kiln.distill.errors import ContractError
from kiln.distill.paths import read_bytes_nofollow

__all__ = ["MAX_DATASET_FILE_BYTES", "MAX_DATASET_ROWS", "DatasetSummary", "fingerprint_dataset", "check_dataset"]

MAX_DATASET_FILE_BYTES = 1 << 30
MAX_DATASET_ROWS = 10_000_000


@dataclass(frozen=True)
class DatasetSummary:
    fingerprint: DatasetFingerprint
    target_tokens: int
    max_token_id: int


def fingerprint_dataset(root: str | os.PathLike[str], paths: Sequence[str]) -> DatasetSummary:
    """Read ``paths`` (relative to ``root``, in order) and fingerprint them.

    Every row must be a ``soup.autodistill.tokenized-teacher-example.v1`` object
    and example IDs must be unique across all files.
    """
    files, seen = [], set()
    normalized = hashlib.sha256()
    rows = target_tokens = max_id = 0
    for rel in paths:
        raw = read_bytes_nofollow(root, rel, max_bytes=MAX_DATASET_FILE_BYTES)
        try:
            digest = jsonl_c14n(raw, max_rows=MAX_DATASET_ROWS - rows)
        except JSONLNormalizationError as exc:
            raise ContractError(f"dataset file {rel}: {exc}") from exc
        for obj in digest.objects():
            ex = TokenizedTeacherExample.parse(obj)
            if ex.example_id in seen:
                raise ContractError(f"dataset file {rel}: example_id {ex.example_id!r} appears twice")
            seen.add(ex.example_id)
            target_tokens += len(ex.target_token_ids)
            max_id = max(max_id, *ex.prompt_token_ids, *ex.target_token_ids)
        normalized.update(digest.normalized)
        rows += digest.rows
        files.append({"path": rel, "size": digest.source_bytes, "sha256": digest.source_sha256})
    fingerprint = DatasetFingerprint.parse(
        {
            "files": files,
            "rows": rows,
            "normalization": JSONL_C14N_ALGORITHM,
            "normalized_sha256": normalized.hexdigest(),
        }
    )
    return DatasetSummary(fingerprint=fingerprint, target_tokens=target_tokens, max_token_id=max_id)


def check_dataset(root: str | os.PathLike[str], plan: Plan) -> DatasetSummary:
    """Refuse unless the files under ``root`` are exactly the plan's dataset."""
    summary = fingerprint_dataset(root, [f.path for f in plan.dataset.files])
    if summary.fingerprint != plan.dataset:
        raise ContractError("dataset files differ from the plan's dataset fingerprint; this is a different run")
    # Teacher-expert captures every target token; rollout lengths come from the student.
    if plan.consumption.trajectory == "teacher-expert" and summary.target_tokens != plan.capture.planned_tokens:
        raise ContractError(
            f"dataset holds {summary.target_tokens} target tokens, the plan planned {plan.capture.planned_tokens}"
        )
    if summary.max_token_id >= plan.tokenizer.vocab_size:
        raise ContractError(f"dataset token ID {summary.max_token_id} is outside the tokenizer vocabulary")
    return summary
