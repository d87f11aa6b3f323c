"""Teacher scoring clients and the two registration probes.

A teacher scores token-ID prompts with ``prompt_logprobs`` (vLLM's numeric
protocol). :class:`RemoteTeacher` talks HTTP (redirects disabled, the bearer
read just before each request, the response streamed under a byte cap derived
from the identity's candidate ceiling, so an oversized answer is refused before
its payload is held); :class:`LocalTeacher` scores on this server's own engine
(no HTTP hop). Both return :class:`Scored` rows and the fingerprint the answer
carried; :func:`probe` runs the top-1 and max-K probes and checks the identity
against the student.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kiln.errors import Conflict, InvalidRequest, KilnError, PayloadTooLarge, Unavailable
from kiln.system.credentials import CredentialHandle
from kiln.teachers.identity import TeacherIdentityV1, row_width
from kiln.teachers.wire import MEDIA_TYPE as WIRE_MEDIA_TYPE

# Bytes one JSON candidate may take on the wire ("id": {"logprob", "rank", "decoded_token"}).
BYTES_PER_CANDIDATE = 256
# Fixed part of a scoring response (ids, usage, fingerprint ~ 1-2 KiB).
RESPONSE_OVERHEAD_BYTES = 64 * 1024
# Before the identity is known (the first, top-1 probe), the answer is tiny: cap it hard.
FIRST_PROBE_MAX_BYTES = 256 * 1024
PROBE_TEXT_IDS = 8  # token IDs in a probe prompt


class TeacherRefused(Conflict):
    """The teacher answered, but the answer breaks the identity contract (409, named mismatch)."""

    code = "teacher_refused"


class TeacherUnreachable(Unavailable):
    code = "teacher_unreachable"


@dataclass(frozen=True)
class Scored:
    """One scored prompt: ``rows[t]`` maps token ID -> logprob at position t (``rows[0]`` is None)."""

    rows: list[dict[int, float] | None]


@dataclass(frozen=True)
class ScoreResult:
    fingerprint: str
    model: str
    prompts: list[Scored]
    candidates: int


@dataclass(frozen=True)
class StudentFacts:
    vocab_size: int
    tokenizer_vocab_sha256: str
    probe_ids: tuple[int, ...]


def parse_rows(choice: dict[str, Any], *, vocab_size: int | None, top_k: int) -> tuple[Scored, int]:
    """Check and convert one choice's ``prompt_logprobs`` (numeric IDs in range, at most K+1 per row)."""
    raw = choice.get("prompt_logprobs")
    if not isinstance(raw, list) or not raw:
        raise TeacherRefused("the teacher's answer has no prompt_logprobs rows")
    rows: list[dict[int, float] | None] = []
    count = 0
    for t, row in enumerate(raw):
        if row is None:
            if t != 0:
                raise TeacherRefused(f"prompt_logprobs row {t} is null (only the first position may be)")
            rows.append(None)
            continue
        if not isinstance(row, dict) or len(row) > top_k + 1:
            raise TeacherRefused(f"prompt_logprobs row {t} has {len(row) if isinstance(row, dict) else '?'} "
                                 f"candidates, more than top_k + 1 = {top_k + 1}")
        out: dict[int, float] = {}
        for key, entry in row.items():
            if not (isinstance(key, str) and key.isdigit() and key == str(int(key))):
                raise TeacherRefused(f"prompt_logprobs row {t} key {key!r} is not a numeric token ID "
                                     "(the teacher must run with numeric token IDs)")
            tid = int(key)
            if vocab_size is not None and tid >= vocab_size:
                raise TeacherRefused(f"token ID {tid} at row {t} is outside the student's vocabulary width "
                                     f"{vocab_size}")
            lp = entry.get("logprob") if isinstance(entry, dict) else None
            if not isinstance(lp, (int, float)) or isinstance(lp, bool) or lp != lp or lp > 1e-6:
                raise TeacherRefused(f"prompt_logprobs row {t} token {tid}: logprob {lp!r} is not a log-probability")
            out[tid] = float(lp)
        count += len(out)
        rows.append(out)
    return Scored(rows), count


class RemoteTeacher:
    """An HTTP teacher (vLLM launched by `kiln teacher launch`, or another Kiln server)."""

    def __init__(self, url: str, model_id: str, *, credential: CredentialHandle | None, timeout_s: float,
                 transport: Any = None):
        self.url, self.model_id, self.credential, self.timeout_s = url.rstrip("/"), model_id, credential, timeout_s
        self._transport = transport

    def score(self, prompts: Sequence[Sequence[int]], top_k: int, *, max_bytes: int,
              vocab_size: int | None, score_from: Sequence[int] | None = None) -> ScoreResult:
        """Score every prompt in one request (a list of token-ID prompts, as vLLM and Kiln accept).
        ``score_from`` (the positions each caller needs rows from) is a hint a local teacher uses; over
        HTTP every position is scored."""
        many = len(prompts) > 1
        body = self._post({"model": self.model_id, "prompt": [list(p) for p in prompts] if many else list(prompts[0]),
                           "max_tokens": 1, "temperature": 0, "prompt_logprobs": top_k}, max_bytes)
        if "binary" in body:
            return self._binary(body["binary"], prompts, top_k, vocab_size)
        model = body.get("model")
        choices = body.get("choices")
        if not isinstance(choices, list) or len(choices) != len(prompts) or \
                not all(isinstance(c, dict) for c in choices):
            raise TeacherRefused(f"the teacher answered {len(choices) if isinstance(choices, list) else 'no'} "
                                 f"choices for {len(prompts)} prompts")
        by_index = sorted(choices, key=lambda c: c.get("index", 0))
        results: list[Scored] = []
        total = 0
        for ids, choice in zip(prompts, by_index):
            scored, n = parse_rows(choice, vocab_size=vocab_size, top_k=top_k)
            if len(scored.rows) != len(ids):
                raise TeacherRefused(f"the teacher returned {len(scored.rows)} prompt_logprobs rows for a "
                                     f"{len(ids)}-token prompt")
            results.append(scored)
            total += n
        fp = body.get("system_fingerprint")
        return ScoreResult(fp if isinstance(fp, str) else "", model if isinstance(model, str) else "", results, total)

    @staticmethod
    def _binary(data: bytes, prompts: Sequence[Sequence[int]], top_k: int, vocab_size: int | None) -> ScoreResult:
        from kiln.teachers.wire import WireError, decode

        try:
            fp, model, rows = decode(data, vocab_size=vocab_size, top_k=top_k)
        except WireError as exc:
            raise TeacherRefused(f"the teacher's binary answer is invalid: {exc}") from None
        if len(rows) != len(prompts) or any(len(r) != len(p) for r, p in zip(rows, prompts)):
            raise TeacherRefused("the teacher's binary answer does not match the prompts it was asked to score")
        for t_rows in rows:
            for t, row in enumerate(t_rows):
                if (row is None) != (t == 0):
                    raise TeacherRefused(f"prompt_logprobs row {t} is {'null' if row is None else 'present'}")
                if row and (max(row.values()) > 1e-6 or any(v != v for v in row.values())):
                    raise TeacherRefused(f"prompt_logprobs row {t} holds a value that is not a log-probability")
        total = sum(len(r) for p in rows for r in p if r)
        return ScoreResult(fp, model, [Scored(r) for r in rows], total)

    def _post(self, payload: dict[str, Any], max_bytes: int) -> dict[str, Any]:
        import httpx

        # A Kiln teacher answers in the compact binary layout (kiln.teachers.wire); vLLM answers JSON.
        headers = {"Content-Type": "application/json", "Accept": f"{WIRE_MEDIA_TYPE}, application/json;q=0.5"}
        if self.credential is not None:
            headers.update(self.credential.bearer())
        where = f"{self.url}/v1/completions"
        try:
            with httpx.Client(timeout=self.timeout_s, follow_redirects=False, transport=self._transport,
                              trust_env=False) as client:
                with client.stream("POST", where, content=json.dumps(payload), headers=headers) as r:
                    if 300 <= r.status_code < 400:
                        raise TeacherRefused(f"the teacher answered {r.status_code} (a redirect); redirects are "
                                             "disabled: register the exact URL the teacher serves on")
                    declared = r.headers.get("content-length")
                    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                        raise PayloadTooLarge(
                            f"the teacher's answer declares {declared} bytes, more than the {max_bytes} its "
                            "identity's candidate ceiling allows; refused before reading it",
                            code="teacher_response_too_large")
                    buf = bytearray()
                    for chunk in r.iter_bytes():
                        buf += chunk
                        if len(buf) > max_bytes:
                            raise PayloadTooLarge(
                                f"the teacher's answer exceeds {max_bytes} bytes, more than its identity's "
                                "candidate ceiling allows; refused before reading the rest",
                                code="teacher_response_too_large")
                    status = r.status_code
                    binary = r.headers.get("content-type", "").startswith(WIRE_MEDIA_TYPE)
        except httpx.HTTPError as exc:
            raise TeacherUnreachable(f"cannot reach the teacher at {self.url}: {type(exc).__name__}",
                                     hint="check that the teacher is running and the URL is right") from None
        if status >= 400:
            # Authenticated error bodies are redacted: only the status is reported.
            detail = "" if self.credential is not None else f": {bytes(buf[:300]).decode('utf-8', 'replace')}"
            raise TeacherUnreachable(f"the teacher answered HTTP {status}{detail}")
        if binary:
            return {"binary": bytes(buf)}
        try:
            body = json.loads(bytes(buf))
        except ValueError:
            raise TeacherRefused("the teacher's answer is not JSON") from None
        if not isinstance(body, dict):
            raise TeacherRefused("the teacher's answer is not a JSON object")
        return body


class LocalTeacher:
    """This server's own model (optionally an adapter) as a teacher: scoring on the engine, no HTTP."""

    def __init__(self, engine: Any, model_id: str, *, adapter: str | None, fingerprint: Callable[[], str]):
        self.engine, self.model_id, self.adapter, self._fingerprint = engine, model_id, adapter, fingerprint

    def score(self, prompts: Sequence[Sequence[int]], top_k: int, *, max_bytes: int,
              vocab_size: int | None, score_from: Sequence[int] | None = None,
              base_rows: Sequence[bool] | None = None) -> ScoreResult:
        """``score_from[i]``: prompt ``i``'s rows before it may be ``None`` (the engine reuses cached prompt
        blocks, :meth:`kiln.runtime.engine.Engine.score_prompt`); ``base_rows[i]``: score prompt ``i`` with the
        base model (a scoped teacher adapter's prompt outside its corrections, answered by the base when served)."""
        starts = list(score_from) if score_from is not None else [0] * len(prompts)
        base = list(base_rows) if base_rows is not None else [False] * len(prompts)
        futures = [self.engine.score_prompt(list(ids), top_k, adapter=None if b else self.adapter, score_from=s)
                   for ids, s, b in zip(prompts, starts, base)]
        out, total = [], 0
        for fut in futures:
            rows = fut.result()
            conv: list[dict[int, float] | None] = [None if r is None else {e.token_id: e.logprob for e in r}
                                                   for r in rows]
            total += sum(len(r) for r in conv if r)
            out.append(Scored(conv))
        return ScoreResult(self._fingerprint(), self.model_id, out, total)


def response_cap(identity: TeacherIdentityV1 | None, positions: int, top_k: int) -> int:
    if identity is None:
        return FIRST_PROBE_MAX_BYTES
    return min(identity.max_prompt_logprob_candidates, positions * row_width(top_k, identity.vocab_size)) \
        * BYTES_PER_CANDIDATE + RESPONSE_OVERHEAD_BYTES


def check_request_fits(identity: TeacherIdentityV1, prompts: Sequence[Sequence[int]], top_k: int) -> None:
    if top_k > identity.max_top_k:
        raise InvalidRequest(f"top_k={top_k} exceeds the teacher's max_top_k={identity.max_top_k}",
                             code="top_k_too_large", hint=f"use top_k <= {identity.max_top_k}")
    width = row_width(top_k, identity.vocab_size)
    for ids in prompts:
        if len(ids) > identity.max_model_len:
            raise InvalidRequest(f"a {len(ids)}-token sequence exceeds the teacher's max_model_len "
                                 f"{identity.max_model_len}", code="teacher_context_exceeded")
        if len(ids) * width > identity.max_prompt_logprob_candidates:
            raise InvalidRequest(f"scoring {len(ids)} positions at top_k={top_k} would exceed the teacher's "
                                 f"candidate ceiling {identity.max_prompt_logprob_candidates}",
                                 code="teacher_ceiling_exceeded", hint="use shorter sequences or a smaller top_k")


def check_answer(result: ScoreResult, *, model_id: str, pinned: str | None) -> TeacherIdentityV1:
    """The answer's fingerprint decodes to a valid identity for ``model_id`` (and equals ``pinned``)."""
    from kiln.teachers.kiln_identity import identity_from_fingerprint

    if pinned is not None and result.fingerprint != pinned:
        raise TeacherRefused("the teacher's fingerprint differs from the pinned one: the deployment changed "
                             "(model, tokenizer, runtime or options); delete and re-register the alias",
                             code="teacher_fingerprint_changed")
    try:
        identity = identity_from_fingerprint(result.fingerprint)
    except ValueError as exc:
        raise TeacherRefused(str(exc), code="teacher_fingerprint_invalid") from None
    if result.model != model_id:
        raise TeacherRefused(f"the teacher answered as model {result.model!r}, not the requested {model_id!r}",
                             code="teacher_model_mismatch")
    if identity.served_model_id != model_id:
        raise TeacherRefused(f"the teacher's identity serves {identity.served_model_id!r}, not the requested "
                             f"{model_id!r}", code="teacher_model_mismatch")
    return identity


def check_student(identity: TeacherIdentityV1, student: StudentFacts) -> None:
    if identity.vocab_size != student.vocab_size:
        raise TeacherRefused(f"vocabulary width mismatch: teacher {identity.vocab_size}, student "
                             f"{student.vocab_size}", code="teacher_vocab_mismatch",
                             hint="distillation needs a teacher with the student's tokenizer and vocabulary")
    if identity.tokenizer_vocab_sha256 != student.tokenizer_vocab_sha256:
        raise TeacherRefused("numeric token IDs mismatch: the teacher's tokenizer_vocab_sha256 differs from the "
                             "student's", code="teacher_tokenizer_mismatch",
                             hint="distillation needs a teacher with the student's tokenizer and vocabulary")


@dataclass(frozen=True)
class ProbeReport:
    identity: TeacherIdentityV1
    fingerprint: str
    top1_candidates: int
    max_k: int
    max_k_candidates: int


def probe(teacher: RemoteTeacher | LocalTeacher, student: StudentFacts, *, model_id: str,
          pinned: str | None = None) -> ProbeReport:
    """One top-1 probe, then one at the identity's max K; both must carry the same canonical fingerprint."""
    ids = list(student.probe_ids)
    first = teacher.score([ids], 1, max_bytes=response_cap(None, len(ids), 1), vocab_size=student.vocab_size)
    identity = check_answer(first, model_id=model_id, pinned=pinned)
    check_student(identity, student)
    max_k = identity.max_top_k
    width = row_width(max_k, identity.vocab_size)
    n = max(2, min(len(ids), identity.max_prompt_logprob_candidates // width))
    ids_k = ids[:n]
    check_request_fits(identity, [ids_k], max_k)
    second = teacher.score([ids_k], max_k, max_bytes=response_cap(identity, len(ids_k), max_k),
                           vocab_size=student.vocab_size)
    if second.fingerprint != first.fingerprint:
        raise TeacherRefused("the top-1 and max-K probes carried different fingerprints",
                             code="teacher_fingerprint_changed")
    check_answer(second, model_id=model_id, pinned=first.fingerprint)
    return ProbeReport(identity, first.fingerprint, first.candidates, max_k, second.candidates)


def is_kiln_error(exc: BaseException) -> bool:
    return isinstance(exc, KilnError)
