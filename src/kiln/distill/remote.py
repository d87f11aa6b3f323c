"""Capture from a registered remote teacher (a second ``kiln serve``, or vLLM launched by ``kiln teacher launch``).

:class:`RemoteTeacherScorer` implements the capture worker's ``TeacherScorer``
protocol over ``prompt_logprobs`` on ``/v1/completions`` (token-ID prompts,
several per request; the compact binary answer of :mod:`kiln.teachers.wire`
when the teacher is Kiln, JSON from vLLM). Every answer's fingerprint must equal
the one pinned at registration (:func:`kiln.teachers.probe.check_answer`).

What a prompt-logprobs row gives, and how each stored quantity is exact:

* the scored sequence is ``context + forced``; the row at index
  ``len(context) + i`` is the teacher's distribution for position ``i`` given
  exactly the recorded context. A prompt-logprobs row always carries the
  *actual* token of the sequence at that index, which is ``forced[i]`` (the gold
  target, or the student's sampled token): the forced ID is covered by
  construction, whatever K is;
* the top-K IDs and their log p are in the same row, so S = top-K ∪ forced has
  one exact teacher log p per ID, and the tail ``1 - sum(exp(log p_i))`` over S
  follows without renormalising;
* the **full entropy** is not in a top-K row. v1 rows always store it, so the
  scorer asks for the whole row (``prompt_logprobs = vocab_size``) and refuses
  a teacher whose ``max_top_k`` is below the vocabulary (Kiln:
  ``limits.max_prompt_logprobs``; vLLM: ``--max-logprobs``). With the whole row,
  temperature scaling is exact too (``log p_T = lp/T - logsumexp(lp/T)``).

Binding to the plan (refused otherwise, before any scoring): the teacher's
``base_model_sha256`` is the plan's ``teacher.revision`` (both are the loader's
safetensors digest), no adapter (the plan's teacher fingerprint cannot name
one), ``vocab_size`` equal, ``tokenizer_vocab_sha256`` equal to the digest of the
plan's tokenizer files (given as ``--tokenizer``), ``max_model_len`` at least
``max_sequence_length + 1``, ``capture.backend`` = ``remote-<provider>`` and
``capture.backend_version`` = the identity's ``implementation``, and the plan's
``teacher.config_sha256`` equal to the ``config.json`` digest that the teacher
manifest (``--teacher-manifest``) proves against the pinned fingerprint (refused
without one: the fingerprint binds the config only inside
``inference_config_sha256``). A remote
teacher's dtype and quantization cannot be observed over the wire: the plan's
declared values are repeated in the child receipt together with the pinned
fingerprint, whose ``inference_config_sha256`` binds the teacher's dtype and
``config.json`` digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.canonical import base_model_digest
from kiln.distill.contract import Plan
from kiln.distill.errors import ContractError

__all__ = ["REMOTE_BACKEND_PREFIX", "RemoteTeacherScorer", "pinned_teacher_spec"]

REMOTE_BACKEND_PREFIX = "remote-"
DEFAULT_POSITIONS_PER_REQUEST = 256


def pinned_teacher_spec(entry: dict[str, Any], credentials: dict[str, Any]) -> dict[str, Any]:
    """What the capture child needs of a registry entry (no secret: a credential names its variable)."""
    if entry.get("kind") != "remote":
        raise ContractError(f"teacher {entry.get('alias')!r} is a local (in-server) teacher; capture takes a "
                            "remote registered teacher or a local checkpoint directory (--teacher)")
    if not entry.get("usable"):
        raise ContractError(f"teacher {entry.get('alias')!r} is not usable: {entry.get('reason')}")
    cid = entry.get("credential_id")
    cred = None
    if cid is not None:
        if cid not in credentials:
            raise ContractError(f"teacher {entry['alias']!r} names credential {cid!r}, which kiln.toml lacks")
        value = credentials[cid]
        cred = value.model_dump(mode="json") if hasattr(value, "model_dump") else dict(value)
    return {"alias": entry["alias"], "provider": entry["provider"], "url": entry["url"],
            "model_id": entry["model_id"], "fingerprint": entry["fingerprint"], "credential_id": cid,
            "credential": cred}


def _config_problems(plan: Plan, spec: dict[str, Any], ident: Any) -> list[str]:
    """The plan's ``teacher.config_sha256`` against the config the pinned identity binds, proven by the teacher
    manifest (:mod:`kiln.teachers.inference_proof`); without a manifest the digest cannot be seen, so fail closed."""
    from kiln.teachers.inference_proof import TeacherManifest, TeacherManifestError, verified_model_config

    raw = spec.get("manifest")
    if raw is None:
        return ["teacher.config_sha256: the fingerprint binds config.json only inside inference_config_sha256, so "
                "it cannot be checked over the wire; pass --teacher-manifest FILE (`kiln teacher launch "
                "--manifest-only` output, or GET /v1/teacher/manifest of a Kiln teacher)"]
    try:
        served = verified_model_config(TeacherManifest(raw["system_fingerprint"], raw["inference_config"]), ident,
                                       spec["fingerprint"])
    except TeacherManifestError as exc:
        return [f"teacher manifest: {exc}"]
    if served != plan.teacher.config_sha256:
        return [f"teacher.config_sha256: plan {plan.teacher.config_sha256}, the teacher serves config.json "
                f"{served}"]
    return []


class RemoteTeacherScorer:
    """``TeacherScorer`` over a pinned remote teacher's ``prompt_logprobs`` (full rows; see the module doc)."""

    def __init__(self, plan: Plan, spec: dict[str, Any], tokenizer_dir: str, *, timeout_s: float = 300.0,
                 positions_per_request: int = DEFAULT_POSITIONS_PER_REQUEST, transport: Any = None):
        from kiln.teachers.kiln_identity import identity_from_fingerprint
        from kiln.teachers.probe import RemoteTeacher

        self.plan, self.spec = plan, spec
        try:
            self.identity = identity_from_fingerprint(spec["fingerprint"])
        except ValueError as exc:
            raise ContractError(f"teacher {spec['alias']!r}: its pinned fingerprint is invalid: {exc}") from None
        ident, cap, v = self.identity, plan.capture, plan.tokenizer.vocab_size
        problems = []
        if cap.backend != REMOTE_BACKEND_PREFIX + spec["provider"]:
            problems.append(f"capture.backend: plan {cap.backend!r}, remote teacher "
                            f"{REMOTE_BACKEND_PREFIX + spec['provider']!r}")
        if cap.backend_version != ident.implementation:
            problems.append(f"capture.backend_version: plan {cap.backend_version!r}, teacher {ident.implementation!r}")
        if ident.base_model_sha256 != plan.teacher.revision:
            problems.append(f"teacher.revision: plan {plan.teacher.revision}, teacher serves "
                            f"base_model_sha256 {ident.base_model_sha256}")
        listed = base_model_digest((f.sha256, f.size) for f in plan.teacher.weight_files)
        if listed != ident.base_model_sha256:
            # Every listed teacher weight is verified before use: the served digest must be the one the
            # plan's weight_files (size + SHA-256 each) compute, not only the revision string.
            problems.append(f"teacher.weight_files: the listed weights digest to base_model_sha256 {listed}, the "
                            f"teacher serves {ident.base_model_sha256}")
        problems.extend(_config_problems(plan, spec, ident))
        if ident.adapter is not None:
            problems.append("the teacher serves an adapter, which the plan's teacher fingerprint cannot bind")
        if ident.vocab_size != v:
            problems.append(f"vocab_size: plan {v}, teacher {ident.vocab_size}")
        if ident.max_model_len < cap.max_sequence_length + 1:
            problems.append(f"the teacher's max_model_len {ident.max_model_len} is below max_sequence_length + 1 "
                            f"= {cap.max_sequence_length + 1} (the context plus the scored token)")
        if problems:
            raise ContractError(f"remote teacher {spec['alias']!r} does not match the plan: " + "; ".join(problems))
        if ident.max_top_k < v:
            raise ContractError(
                f"remote teacher {spec['alias']!r} returns at most {ident.max_top_k} prompt logprobs per position, "
                f"fewer than the vocabulary ({v}). Its rows (top-K plus the actual token) cover S = top-K ∪ forced "
                "exactly, but v1 rows also store the teacher's full entropy, which a top-K row cannot give. "
                f"Serve the teacher with max_top_k >= {v} (Kiln: limits.max_prompt_logprobs, at most 1000; vLLM: "
                "--max-logprobs) and register it again, or capture from a local checkpoint (--teacher DIR)")
        self._check_tokenizer(tokenizer_dir)
        cred = None
        if spec.get("credential") is not None:
            from kiln.system.credentials import resolve_credential

            cred = resolve_credential({spec["credential_id"]: spec["credential"]}, spec["credential_id"])
        self.client = RemoteTeacher(spec["url"], spec["model_id"], credential=cred, timeout_s=timeout_s,
                                    transport=transport)
        self.vocab_size = v
        width = min(ident.max_top_k, v)
        self.request_k = width
        self.positions_per_request = max(1, min(positions_per_request,
                                                ident.max_prompt_logprob_candidates // max(1, width)))
        self.requests = 0
        self.answer_bytes = 0

    def _check_tokenizer(self, tokenizer_dir: str) -> None:
        from transformers import AutoTokenizer

        from kiln.teachers.kiln_identity import tokenizer_digests

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        vocab_sha, _config_sha = tokenizer_digests(tok, self.identity.vocab_size)
        if vocab_sha != self.identity.tokenizer_vocab_sha256:
            raise ContractError(f"remote teacher {self.spec['alias']!r}: its tokenizer_vocab_sha256 differs from the "
                                "plan's tokenizer; v1 needs one shared tokenizer (no cross-tokenizer ID matching)")

    def receipt(self) -> dict[str, Any]:
        import transformers

        return {
            "backend": self.plan.capture.backend,
            "backend_version": self.identity.implementation,
            "transformers_version": transformers.__version__,
            "declared_dtype": self.plan.capture.dtype,
            "observed_dtypes": None,  # not observable over the wire; bound by the pinned fingerprint
            "quantization": self.plan.capture.quantization,
            "teacher_alias": self.spec["alias"],
            "teacher_url": self.spec["url"],
            "teacher_model_id": self.spec["model_id"],
            "teacher_fingerprint": self.spec["fingerprint"],
            "inference_config_sha256": self.identity.inference_config_sha256,
            "prompt_logprobs_k": self.request_k,
            "requests": self.requests,
            "answer_bytes": self.answer_bytes,
            "teacher_fingerprint_sha256": self.plan.teacher.digest(),
        }

    # (example index, scored sequence, [(row index, position)])
    def _sequences(self, items):
        limit = self.plan.capture.max_sequence_length
        out = []
        for n, (_eid, ctx, forced) in enumerate(items):
            ctx, forced = list(ctx), list(forced)
            if len(ctx) + len(forced) - 1 <= limit:
                out.append((n, ctx + forced, [(len(ctx) + i, i) for i in range(len(forced))]))
                continue
            if self.plan.capture.truncation != "left":
                raise ContractError("right truncation cannot capture positions past max_sequence_length")
            seq = list(ctx)
            for i in range(len(forced)):
                window = seq[-limit:]
                out.append((n, window + [forced[i]], [(len(window), i)]))
                seq.append(forced[i])
        return out

    def _score(self, seqs: list[list[int]]):
        from kiln.teachers.probe import check_answer, check_request_fits, response_cap

        check_request_fits(self.identity, seqs, self.request_k)
        cap = response_cap(self.identity, sum(len(s) for s in seqs), self.request_k)
        result = self.client.score(seqs, self.request_k, max_bytes=cap, vocab_size=self.vocab_size)
        # Every answer: the pinned fingerprint, the pinned model ID.
        check_answer(result, model_id=self.spec["model_id"], pinned=self.spec["fingerprint"])
        self.requests += 1
        return result.prompts

    def score(self, items: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> list:
        import numpy as np

        from kiln.distill.binary import PackedExample

        v = self.vocab_size
        seqs = self._sequences(items)
        total = sum(len(p) for _n, _s, p in seqs)
        dense = np.empty((total, v), dtype=np.float32)
        forced = np.empty(total, dtype=np.int64)
        where = np.empty((total, 2), dtype=np.int64)
        r = 0
        batch: list = []
        used = 0

        def flush():
            nonlocal r
            answers = self._score([s for _n, s, _p in batch])
            for (n, seq, places), scored in zip(batch, answers):
                for row_index, i in places:
                    row = scored.rows[row_index]
                    if row is None or len(row) != v:
                        raise ContractError(f"remote teacher {self.spec['alias']!r} returned "
                                            f"{0 if row is None else len(row)} candidates at a position, not the "
                                            f"whole vocabulary ({v}) it was asked for")
                    ids = np.fromiter(row.keys(), dtype=np.int64, count=v)
                    dense[r, ids] = np.fromiter(row.values(), dtype=np.float32, count=v)
                    forced[r] = seq[row_index]
                    where[r] = (n, i)
                    r += 1
            batch.clear()

        for s in seqs:
            if batch and used + len(s[1]) > self.positions_per_request:
                flush()
                used = 0
            batch.append(s)
            used += len(s[1])
        if batch:
            flush()
        cols = self._columns(dense, forced)
        order = np.lexsort((where[:, 1], where[:, 0]))
        cols = [c[order] for c in cols]
        bounds = np.cumsum([0] + [len(f) for _e, _c, f in items])
        limit = self.plan.capture.max_sequence_length
        return [
            PackedExample(example_id=eid, context=list(ctx)[-limit:], forced=list(fz),
                          top_ids=cols[0][bounds[n]:bounds[n + 1]], top_logprobs=cols[1][bounds[n]:bounds[n + 1]],
                          forced_logprobs=cols[2][bounds[n]:bounds[n + 1]], tail=cols[3][bounds[n]:bounds[n + 1]],
                          entropy=cols[4][bounds[n]:bounds[n + 1]])
            for n, (eid, ctx, fz) in enumerate(items)
        ]

    def _columns(self, lp32, forced):
        """(top ids, top log p, forced log p or NaN, tail, entropy) from whole rows of teacher log p ``[R, V]``."""
        import numpy as np

        k, temp, v = self.plan.probability.top_k, self.plan.probability.temperature, self.vocab_size
        lp = lp32.astype(np.float64)
        if temp != 1.0:
            z = lp / temp
            zmax = z.max(-1, keepdims=True)
            lp = z - (zmax + np.log(np.exp(z - zmax).sum(-1, keepdims=True)))
            lp32 = lp.astype(np.float32)
        # top-K by log p, ties by lower ID (a stable sort of -log p)
        top_ids = np.argsort(-lp32, axis=-1, kind="stable")[:, :k]
        rows = np.arange(len(lp32))[:, None]
        top_lp = np.minimum(lp32[rows, top_ids], 0.0)
        f_lp = np.minimum(lp32[rows[:, 0], forced], 0.0)
        in_top = (top_ids == forced[:, None]).any(-1)
        p = np.exp(lp)
        entropy = -(p * lp).sum(-1)
        mass = np.exp(top_lp.astype(np.float64)).sum(-1) + np.where(in_top, 0.0, np.exp(f_lp.astype(np.float64)))
        tail = np.zeros(len(lp32)) if k >= v else np.maximum(1.0 - mass, 0.0)
        f_store = np.where(in_top, np.float32(np.nan), f_lp).astype(np.float32)
        return [top_ids, top_lp.astype(np.float32), f_store, tail, entropy]
