"""Off-policy OPD: train on an identity-bound teacher JSONL instead of sampling the student.

The corpus is built from a registered teacher's ``off_policy_manifest`` (``GET /v1/teachers/{alias}``):
the teacher scores sequences (``/v1/completions`` with ``prompt_logprobs`` and numeric token IDs, as
the on-policy loop asks it) and each answer becomes one row. Layout (UTF-8 JSON lines, schema
:data:`TEACHER_JSONL_SCHEMA`):

* line 1, the header: ``{"schema": "kiln.opd-off-policy-teacher.v1", "manifest": <the exact
  off_policy_manifest>, "rows": <row count>}``;
* then one row per line: ``{"token_ids": [int, ...], "prompt_len": int, "prompt_logprobs": [null,
  {"<token id>": logprob, ...}, ...]}``: the whole sequence, how many of its leading tokens are the
  prompt (the rest is the completion the student is trained on), and the teacher's rows for every
  position, as vLLM answers them (first position ``null``).

The binding is checked before the job is queued, against the alias's pinned registry entry and the
served student: every manifest field (schema, alias, fingerprint, identity, identity revision,
protocol, vocabulary size, top-K ceiling) must equal the entry's (409 naming the field), and the
identity's ``tokenizer_vocab_sha256`` and ``vocab_size`` must equal the student's (409). Format errors
are 400 naming the line. The loss is OPD's ``forward``, ``tail`` or ``renormalized`` at the completion positions
(``sampled_token`` is an on-policy estimator and is refused).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from kiln.errors import Conflict
from kiln.training.core.data import MAX_DATASET_BYTES, MAX_DATASET_LINE_BYTES, TrainingDataError, open_dataset

TEACHER_JSONL_SCHEMA = "kiln.opd-off-policy-teacher.v1"
MAX_OFF_POLICY_ROWS = 100_000
PARAM = "teacher_jsonl"
# Manifest fields the corpus must carry exactly as the pinned registry entry's manifest has them.
BOUND_FIELDS = ("schema", "teacher_alias", "teacher_fingerprint", "identity_schema", "identity_revision",
                "identity", "protocol", "row_format", "max_top_k", "vocab_size")


@dataclass(frozen=True)
class OffPolicyRow:
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    teacher_rows: tuple[dict[int, float], ...]  # one per completion token


@dataclass(frozen=True)
class TeacherCorpus:
    rows: tuple[OffPolicyRow, ...]
    sha256: str  # of exactly the bytes parsed


def _bad(msg: str, code: str = "invalid_teacher_jsonl") -> TrainingDataError:
    return TrainingDataError(msg, code=code, param=PARAM,
                             hint="build the file from GET /v1/teachers/{alias}'s off_policy_manifest "
                                  "(docs/teachers.md, off-policy OPD)")


def check_binding(manifest: Any, entry: dict[str, Any], *, student_vocab: int, student_tokenizer_sha256: str) -> None:
    """The header's manifest equals the pinned entry's manifest field by field, and the identity's tokenizer
    and vocabulary are the student's; else :class:`Conflict` (409) naming the field."""
    from kiln.teachers.registry import public_entry

    if not isinstance(manifest, dict):
        raise _bad("the header's `manifest` must be the teacher's off_policy_manifest object")
    expected = public_entry(entry)["off_policy_manifest"]
    for name in BOUND_FIELDS:
        if manifest.get(name) != expected.get(name):
            raise Conflict(f"teacher_jsonl manifest.{name} does not match teacher {entry['alias']!r}'s "
                           f"off_policy_manifest: the corpus was built for another teacher, deployment or format",
                           code="off_policy_binding_mismatch", param=f"{PARAM}.manifest.{name}",
                           hint="rebuild the corpus from this alias's current off_policy_manifest")
    extra = sorted(set(manifest) - set(expected))
    if extra:
        raise _bad(f"the header's manifest has fields no off_policy_manifest has: {extra}")
    identity = manifest["identity"]
    if identity.get("tokenizer_vocab_sha256") != student_tokenizer_sha256:
        raise Conflict("teacher_jsonl manifest.identity.tokenizer_vocab_sha256 differs from the served student's "
                       "tokenizer: its token IDs mean other tokens here", code="off_policy_tokenizer_mismatch",
                       param=f"{PARAM}.manifest.identity.tokenizer_vocab_sha256")
    if identity.get("vocab_size") != student_vocab or manifest.get("vocab_size") != student_vocab:
        raise Conflict(f"teacher_jsonl manifest vocab_size {manifest.get('vocab_size')} differs from the student's "
                       f"{student_vocab}", code="off_policy_vocab_mismatch", param=f"{PARAM}.manifest.vocab_size")


def _row(obj: Any, lineno: int, *, vocab: int, max_top_k: int, max_len: int) -> OffPolicyRow:
    where = f"teacher_jsonl line {lineno}"
    if not isinstance(obj, dict) or set(obj) != {"token_ids", "prompt_len", "prompt_logprobs"}:
        raise _bad(f"{where}: a row is exactly {{token_ids, prompt_len, prompt_logprobs}}")
    ids, plen, lps = obj["token_ids"], obj["prompt_len"], obj["prompt_logprobs"]
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise _bad(f"{where}: token_ids must be integers in [0, {vocab})")
    if len(ids) > max_len:
        raise _bad(f"{where}: {len(ids)} tokens exceed the limit of {max_len}", code="sequence_too_long")
    if type(plen) is not int or not 1 <= plen < len(ids):
        raise _bad(f"{where}: prompt_len must be an integer in [1, len(token_ids) - 1] (a non-empty completion)")
    if not isinstance(lps, list) or len(lps) != len(ids) or lps[0] is not None:
        raise _bad(f"{where}: prompt_logprobs needs one entry per token, the first null")
    rows: list[dict[int, float]] = []
    for pos in range(plen, len(ids)):
        raw = lps[pos]
        if not isinstance(raw, dict) or not 1 <= len(raw) <= max_top_k + 1:
            raise _bad(f"{where}: prompt_logprobs[{pos}] must be an object of 1 to {max_top_k + 1} candidates")
        row: dict[int, float] = {}
        for key, lp in raw.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) < vocab):
                raise _bad(f"{where}: prompt_logprobs[{pos}] key {key!r} is not a token ID below {vocab}")
            if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-6:
                raise _bad(f"{where}: prompt_logprobs[{pos}][{key!r}] must be a finite log-probability <= 0")
            row[int(key)] = min(float(lp), 0.0)
        if sum(math.exp(v) for v in row.values()) > 1.0 + 1e-4:
            raise _bad(f"{where}: prompt_logprobs[{pos}] holds more than probability 1")
        rows.append(row)
    return OffPolicyRow(tuple(ids[:plen]), tuple(ids[plen:]), tuple(rows))


def load_teacher_jsonl(data_dir: Path, relative: str, entry: dict[str, Any], *, student_vocab: int,
                       student_tokenizer_sha256: str, max_len: int) -> TeacherCorpus:
    """Read, bound, bind-check and parse a teacher JSONL inside ``data_dir`` (confined like ``dataset_path``)."""
    from kiln.canonical import strict_json_loads

    fd = open_dataset(data_dir, relative)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(fd).st_size > MAX_DATASET_BYTES:
            raise _bad(f"{relative} is larger than {MAX_DATASET_BYTES} bytes", code="dataset_too_large")
        data = f.read(MAX_DATASET_BYTES + 1)
    if len(data) > MAX_DATASET_BYTES:
        raise _bad(f"{relative} grew past {MAX_DATASET_BYTES} bytes", code="dataset_too_large")
    lines = [(i, raw) for i, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]
    if not lines:
        raise _bad(f"{relative} is empty")
    parsed = []
    for lineno, raw in lines:
        if len(raw) > MAX_DATASET_LINE_BYTES:
            raise _bad(f"teacher_jsonl line {lineno} is longer than {MAX_DATASET_LINE_BYTES} bytes")
        try:
            parsed.append((lineno, strict_json_loads(raw)))
        except ValueError as exc:
            raise _bad(f"teacher_jsonl line {lineno}: {exc}") from None
    header = parsed[0][1]
    if not isinstance(header, dict) or header.get("schema") != TEACHER_JSONL_SCHEMA \
            or set(header) != {"schema", "manifest", "rows"}:
        raise _bad(f"line 1 must be the header {{\"schema\": \"{TEACHER_JSONL_SCHEMA}\", \"manifest\", \"rows\"}}")
    check_binding(header["manifest"], entry, student_vocab=student_vocab,
                  student_tokenizer_sha256=student_tokenizer_sha256)
    body = parsed[1:]
    if type(header["rows"]) is not int or header["rows"] != len(body):
        raise _bad(f"the header says rows={header['rows']!r} but the file holds {len(body)} rows (truncated?)")
    if not body:
        raise _bad(f"{relative} holds no rows")
    if len(body) > MAX_OFF_POLICY_ROWS:
        raise _bad(f"{len(body)} rows exceed the limit of {MAX_OFF_POLICY_ROWS}", code="dataset_too_large")
    max_top_k = int(header["manifest"]["max_top_k"])
    rows = tuple(_row(obj, lineno, vocab=student_vocab, max_top_k=max_top_k, max_len=max_len)
                 for lineno, obj in body)
    return TeacherCorpus(rows, hashlib.sha256(data).hexdigest())


def run_opd_offline(peft_model: Any, name: str, data: Any, corpus: Sequence[OffPolicyRow], plan: Any, *,
                    hooks: Any, resume: Any, pad_id: int) -> Any:
    """Off-policy OPD: each step takes ``batch_size`` corpus rows in order (wrapping) and runs the same
    update as the on-policy loop (:func:`kiln.training.opd.step.opd_loss`) on their completions, under exclusive
    ownership. Nothing is sampled and the teacher is not asked: its rows are in the corpus."""
    from kiln.training.core.loop import StepInput, TrainLoop
    from kiln.training.losses.chunked import split_causal_lm
    from kiln.training.opd.step import opd_loss, opd_pieces

    loop = TrainLoop(peft_model, name, plan, hooks, data.total_steps, resume)
    split = split_causal_lm(peft_model)
    n = len(corpus)
    loop.stats.setdefault("step_s", 0.0)
    loop.stats["training_mode"] = "off_policy"

    def timed() -> None:
        loop.stats["step_s"] = round(loop.stats["step_s"] + loop.last_step_s, 4)

    def steps() -> Iterator[StepInput]:
        while True:
            chosen = [corpus[(loop.step * plan.batch_size + j) % n] for j in range(min(plan.batch_size, n))]
            pairs = [(r.prompt_ids, r.completion_ids) for r in chosen]
            rows = [t for r in chosen for t in r.teacher_rows]
            sampled = [t for r in chosen for t in r.completion_ids]
            yield StepInput((pairs, rows, sampled), len(sampled), after=timed)

    loop.train(steps(), lambda b: opd_loss(peft_model, split, data, b[0], b[1], b[2], [], pad_id=pad_id,
                                           device=loop.device),  # b: (pairs, rows, sampled); no gold rows off policy
               slicer=lambda b, limit: opd_pieces(peft_model, split, data, (*b, []), limit, pad_id=pad_id,
                                                  device=loop.device))
    return loop.report()
