"""Teacher-only capture worker (autodistill v1, Milestone B).

``capture(...)`` is the controller: it writes a request (teacher, tokenizer,
dataset and publication roots; there is no student field), runs
``python -m kiln.distill.capture REQUEST`` as a fresh child process, waits for
it to exit, reopens every shard's available manifest and only then writes the
final receipt. The child verifies dataset, tokenizer and teacher bytes against
the plan before loading, refuses a dtype/quantization/backend mismatch, scores
with a ``TeacherScorer`` and publishes shards through the write-last protocol
of ``shards.py``. Process exit is the memory-isolation gate.

Sharding is deterministic: shard ``i`` holds examples ``[i*E, (i+1)*E)`` and
its payloads hold ``P`` whole examples each. A transaction is
``<shard_id>.t<NNN>``; a restart applies the resume table to the newest
transaction of every shard (see docs/distill.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from kiln.canonical import atomic_write_bytes, canonical_json_bytes, jsonl_c14n, sha256_hex, strict_json_loads
from kiln.distill import shards
from kiln.distill.binary import PACKED_SUFFIX, PackedExample, check_packable, encode_packed
from kiln.distill.contract import MAX_ARTIFACT_JSON_BYTES, Plan, TokenizedTeacherExample
from kiln.distill.dataset import MAX_DATASET_FILE_BYTES, check_dataset
from kiln.distill.errors import ContractError, DistillError, ShardError
from kiln.distill.faults import fault
from kiln.distill.paths import read_bytes_nofollow, read_file_nofollow
from kiln.errors import KilnError

__all__ = [
    "REQUEST_SCHEMA",
    "CHILD_RECEIPT_SCHEMA",
    "RECEIPT_SCHEMA",
    "RECEIPTS_DIR",
    "TeacherScorer",
    "LocalTeacherScorer",
    "CaptureRequest",
    "capture",
    "run_capture_child",
    "refuse_foreign_root",
    "shard_status",
    "load_examples",
]

REQUEST_SCHEMA = "kiln.distill.capture-request.v1"
CHILD_RECEIPT_SCHEMA = "kiln.distill.capture-child-receipt.v1"
RECEIPT_SCHEMA = "kiln.distill.capture-receipt.v1"
RECEIPTS_DIR = ".receipts"
BACKEND = "transformers"
_MAX_SCORE_ELEMENTS = 1 << 24  # rows x vocab handled at once in float64


# ------------------------------------------------------------------- scorers


class TeacherScorer(Protocol):
    """Scores whole example trajectories; one implementation per teacher kind.

    ``LocalTeacherScorer`` runs a local transformers checkpoint in this process;
    ``kiln.distill.remote.RemoteTeacherScorer`` scores through a registered remote
    teacher's ``prompt_logprobs``. Both return exact log-probabilities of every
    top-k and forced ID, the tail, the full entropy, and their identity receipt.
    """

    vocab_size: int

    def receipt(self) -> dict[str, Any]:
        """Identity bound into the child receipt (backend, version, dtypes, quantization)."""

    def score(self, items: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> list[PackedExample]:
        """(example_id, position-0 context, forced tokens) -> the example's packed columns."""


def _float_dtypes(model) -> list[str]:
    return sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.dtype.is_floating_point})


def pad_windows(batch, device):
    """Right-padded ``input_ids`` and ``attention_mask`` (``[rows, longest]``) for windows
    ``(example index, tokens, positions)``, on ``device``."""
    import torch

    width = max(len(w) for _n, w, _p in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    att = torch.zeros((len(batch), width), dtype=torch.long)
    for r, (_n, w, _p) in enumerate(batch):
        ids[r, : len(w)] = torch.tensor(w)
        att[r, : len(w)] = 1
    return ids.to(device), att.to(device)


class LocalTeacherScorer:
    """A local transformers teacher, loaded with Kiln's loader rules (safetensors only)."""

    def __init__(self, plan: Plan, teacher_dir: str | os.PathLike[str], *, device: str = "auto", batch_size: int = 8):
        import torch
        import transformers

        from kiln.distill.local import (
            check_capture_settings,
            check_model_dir,
            check_observed_dtypes,
            checkpoint_float_dtypes,
            quantization_identity,
        )
        from kiln.runtime.loader import inspect_model_dir, load_model

        self.plan = plan
        self.batch_size = max(1, int(batch_size))
        info = inspect_model_dir(teacher_dir)
        check_model_dir(plan.teacher, info.path, "teacher")
        self.quantization = quantization_identity(info.config)
        check_capture_settings(
            plan, backend=BACKEND, backend_version=transformers.__version__, quantization=self.quantization
        )
        declared = plan.capture.dtype
        if not hasattr(torch, declared) or not isinstance(getattr(torch, declared), torch.dtype):
            raise ContractError(f"plan capture.dtype {declared!r} is not a torch dtype")
        # The observed dtypes are what the checkpoint holds, read before loading: the load below casts
        # to the declared dtype, so the loaded parameters alone could never disagree with the plan.
        self.observed_dtypes = checkpoint_float_dtypes(info)
        check_observed_dtypes(self.observed_dtypes, declared, self.quantization)
        loaded = load_model(info.path, device=device, dtype=declared, info=info)
        self.model, self.device = loaded.model, loaded.device
        check_observed_dtypes(_float_dtypes(self.model), declared, self.quantization)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        import inspect

        self._keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        if self.vocab_size != plan.tokenizer.vocab_size:
            raise ContractError(
                f"teacher output width {self.vocab_size} differs from the plan's vocab_size {plan.tokenizer.vocab_size}"
            )
        self._receipt = {
            "backend": BACKEND,
            "backend_version": transformers.__version__,
            "torch_version": torch.__version__,
            "declared_dtype": declared,
            "observed_dtypes": self.observed_dtypes,
            "quantization": self.quantization,
            "device": self.device,
            "teacher_fingerprint_sha256": plan.teacher.digest(),
        }

    def receipt(self) -> dict[str, Any]:
        return dict(self._receipt)

    # (example index, window tokens, list of (window offset, position)) per forward row
    def _windows(self, items):
        cap = self.plan.capture
        limit = cap.max_sequence_length
        out = []
        for n, (_eid, ctx, forced) in enumerate(items):
            ctx, forced = list(ctx), list(forced)
            full = ctx + forced[:-1]
            if len(full) <= limit:
                out.append((n, full, [(len(ctx) - 1 + i, i) for i in range(len(forced))]))
                continue
            if cap.truncation != "left":
                raise ContractError("right truncation cannot capture positions past max_sequence_length")
            seq = list(ctx)
            for i in range(len(forced)):
                window = seq[-limit:]
                out.append((n, window, [(len(window) - 1, i)]))
                seq.append(forced[i])
        return out

    def score(self, items):
        import numpy as np
        import torch

        prob = self.plan.probability
        k, temp, v = prob.top_k, prob.temperature, self.vocab_size
        windows = self._windows(items)
        host_parts: list[list] = []
        where_parts: list = []
        chunk = max(1, _MAX_SCORE_ELEMENTS // v)
        for start in range(0, len(windows), self.batch_size):
            batch = windows[start : start + self.batch_size]
            # (row, window offset, example index, position, forced token) of every captured position
            meta = np.array([(r, o, n, i, items[n][2][i]) for r, (n, _w, p) in enumerate(batch) for o, i in p],
                            dtype=np.int64)
            # The LM head runs only at captured offsets (the prompt's other positions, and all but the
            # last position of a truncated window, are never scored).
            keep, col = np.unique(meta[:, 1], return_inverse=True)
            ids, att = pad_windows(batch, self.device)
            flat_np = meta[:, 0] * len(keep) + col
            dense = len(flat_np) == len(batch) * len(keep) and bool((flat_np == np.arange(len(flat_np))).all())
            flat = torch.from_numpy(flat_np).to(self.device)
            forced = torch.from_numpy(meta[:, 4].copy()).to(self.device)
            with torch.inference_mode():
                kwargs = {"logits_to_keep": torch.from_numpy(keep).to(self.device)} if self._keep else {}
                logits = self.model(input_ids=ids, attention_mask=att, **kwargs).logits
                if not self._keep:  # a model without logits_to_keep: full logits, picked here
                    logits = logits[:, torch.from_numpy(keep).to(self.device)]
                picked = logits.reshape(-1, v)  # [R, V]: every kept logit row is a captured position ...
                if not dense:
                    picked = picked.index_select(0, flat)  # ... or only some (unequal prompts, padding)
                del logits
                for c0 in range(0, picked.shape[0], chunk):
                    host_parts.append(self._select(picked[c0 : c0 + chunk], forced[c0 : c0 + chunk], k, temp, v))
            where_parts.append(meta[:, 2:4])
        cols = [np.concatenate([h[j] for h in host_parts]) for j in range(5)]
        where = np.concatenate(where_parts)
        order = np.lexsort((where[:, 1], where[:, 0]))  # by example, then position
        cols = [c[order] for c in cols]
        bounds = np.cumsum([0] + [len(forced) for _e, _c, forced in items])
        limit = self.plan.capture.max_sequence_length
        return [
            PackedExample(
                example_id=eid,
                context=list(ctx)[-limit:],
                forced=list(forced),
                top_ids=cols[0][bounds[n] : bounds[n + 1]],
                top_logprobs=cols[1][bounds[n] : bounds[n + 1]],
                forced_logprobs=cols[2][bounds[n] : bounds[n + 1]],
                tail=cols[3][bounds[n] : bounds[n + 1]],
                entropy=cols[4][bounds[n] : bounds[n + 1]],
            )
            for n, (eid, ctx, forced) in enumerate(items)
        ]

    @staticmethod
    def _select(logits, forced, k: int, temp: float, v: int) -> list:
        """Host columns (top ids, top log p, forced log p or NaN, tail, entropy) for ``[R, V]`` logits."""
        import torch

        z = logits.float()
        if temp != 1.0:
            z = z / temp
        # One fused softmax pass; the normalizer is read back in float64 from the
        # argmax (lse = z_max - log p_max, error ~1e-7), so stored log p, tail and
        # entropy meet the contract's 1e-6 tolerances without a float64 [rows, V] copy.
        p = torch.softmax(z, dim=-1)
        # torch.topk: on the shared 2-core machine 12.7 vs 30.8 ms of CPU per 896 rows of 4,096 logits at
        # K = 32 (one thread; 16 vs 41 ms on two) against the numpy introselect used before (docs/distill.md)
        top_z, top_ids = torch.topk(z, k, dim=-1)
        p_max = p.gather(-1, top_ids[:, :1])[:, 0].double()
        lse = top_z[:, 0].double() - p_max.log()
        f_z = z.gather(-1, forced[:, None])[:, 0]
        in_top = (top_ids == forced[:, None]).any(-1)
        entropy = lse - torch.linalg.vecdot(p, z).double()  # H = lse - sum(p z); vs float64 2e-5 (the einsum before: 3.5e-5)
        top_lp32 = (top_z.double() - lse[:, None]).float().clamp(max=0.0)
        f_lp32 = (f_z.double() - lse).float().clamp(max=0.0)
        # Tail from the exact stored (float32) values, never renormalized.
        mass = top_lp32.double().exp().sum(-1) + torch.where(in_top, 0.0, f_lp32.double().exp())
        tail = (1.0 - mass).clamp(min=0.0)
        if k == v:
            tail = torch.zeros_like(tail)
        f_store = torch.where(in_top, torch.full_like(f_lp32, float("nan")), f_lp32)
        return [t.cpu().numpy() for t in (top_ids, top_lp32, f_store, tail, entropy)]


# ------------------------------------------------------------------- dataset


def load_examples(dataset_root: str | os.PathLike[str], plan: Plan) -> list[TokenizedTeacherExample]:
    """Verify the dataset against the plan, then return its examples in order."""
    check_dataset(dataset_root, plan)
    out = []
    for f in plan.dataset.files:
        raw = read_bytes_nofollow(dataset_root, f.path, max_bytes=MAX_DATASET_FILE_BYTES)
        out += [TokenizedTeacherExample.parse(obj) for obj in jsonl_c14n(raw).objects()]
    return out


# ------------------------------------------------------------------ requests


@dataclass(frozen=True)
class CaptureRequest:
    """What the teacher-only child may touch. There is deliberately no student field."""

    plan: str
    teacher: str
    tokenizer: str
    dataset_root: str
    out: str
    device: str = "auto"
    examples_per_shard: int = 64
    examples_per_payload: int = 16
    batch_size: int = 8
    layout: str = "packed"  # or "jsonl"
    progress: bool = False
    # A registered remote teacher pinned by the controller (kiln.distill.remote.pinned_teacher_spec);
    # ``teacher`` is then only its label and ``tokenizer`` the plan's tokenizer files.
    teacher_remote: dict[str, Any] | None = None

    def to_obj(self) -> dict[str, Any]:
        return {"schema": REQUEST_SCHEMA, **self.__dict__}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> "CaptureRequest":
        obj = dict(obj)
        if obj.pop("schema", None) != REQUEST_SCHEMA:
            raise ContractError(f"capture request schema must be {REQUEST_SCHEMA!r}")
        unknown = set(obj) - set(cls.__dataclass_fields__)
        if unknown:  # e.g. a "student" key: the teacher-only worker never accepts one
            raise ContractError(f"capture request has unknown fields {sorted(unknown)}")
        return cls(**obj)


def _shard_id(i: int) -> str:
    return f"shard-{i:05d}"


def _txn_id(shard_id: str, attempt: int) -> str:
    return f"{shard_id}.t{attempt:03d}"


def _transactions(root: Path, shard_id: str) -> list[tuple[int, Path]]:
    """Every transaction directory of ``shard_id`` (published or staging), oldest first."""
    found = []
    for base in (root, root / shards.STAGING_DIRNAME):
        if not base.is_dir():
            continue
        for entry in base.iterdir():
            name = entry.name
            if name.startswith(shard_id + ".t") and name[len(shard_id) + 2 :].isdigit() and entry.is_dir():
                found.append((int(name[len(shard_id) + 2 :]), entry))
    return sorted(found)


def _payload_name(j: int, layout: str) -> str:
    return f"rows-{j:05d}" + (PACKED_SUFFIX if layout == "packed" else ".jsonl")


def _staged_prefix_ok(txn: Path, plan: Plan, chunks: list[list[TokenizedTeacherExample]], layout: str) -> int | None:
    """Number of whole payloads already staged if they are exactly the expected prefix, else None."""
    names = [n for n in sorted(os.listdir(txn / shards.PAYLOAD_DIR)) if not n.startswith(".")]
    for j, name in enumerate(names):
        if j >= len(chunks) or name != _payload_name(j, layout):
            return None
        raw = read_bytes_nofollow(txn, f"{shards.PAYLOAD_DIR}/{name}", max_bytes=shards.MAX_PAYLOAD_BYTES)
        try:
            rows, _r, _t = shards.parse_any_payload(raw, name, plan)
        except DistillError:
            return None
        want = [(e.example_id, t) for e in chunks[j] for t in e.target_token_ids]
        if [(r.example_id, r.forced_token_id) for r in rows] != want:
            return None
    return len(names)


def _encode(plan: Plan, examples: list[PackedExample], layout: str) -> bytes:
    data = encode_packed(plan, examples)
    if layout == "packed":
        return data
    from kiln.distill.binary import decode_packed_rows

    _h, rows = decode_packed_rows(data, "capture")
    return b"".join(r.canonical_bytes() + b"\n" for r in rows)


def _capture_shard(req, plan, scorer, root: Path, shard_id: str, examples, dataset, bar) -> dict[str, Any]:
    """Apply the resume table to one shard and finish it; return its status record.

    ``examples`` is this shard's range; ``dataset`` every example of the plan by ID. Each
    trajectory must be a dataset example, whole, and the shard must hold exactly its range
    (a shard captured under another ``--examples-per-shard`` is mismatched: quarantined, recaptured).
    """
    chunks = [examples[j : j + req.examples_per_payload] for j in range(0, len(examples), req.examples_per_payload)]
    mine = {"examples": dataset, "shard_range": [e.example_id for e in examples]}
    txns = _transactions(root, shard_id)
    attempt = txns[-1][0] + 1 if txns else 0
    decision, txn, done = "new", None, 0
    if txns:
        _n, latest = txns[-1]
        verdict = shards.verify_shard(latest, expected_plan_sha256=plan.digest(), **mine)
        decision = verdict.decision
        if decision == shards.FOREIGN_RUN:
            raise ShardError(f"{latest} belongs to another plan; use a new --out for this run")
        if decision == "resume-staging":
            decision, txn = shards.resume(latest, root, plan, **mine)
            done = _staged_prefix_ok(txn, plan, chunks, req.layout)
            if done is None:
                shards.quarantine(txn, "staged payloads are not the expected prefix of this shard's examples")
                decision, txn, done = "quarantine-and-restart", None, 0
        elif decision in ("reuse", "publish", "verify-then-publish"):
            decision, final = shards.resume(latest, root, plan, **mine)
            bar.update(sum(len(e.target_token_ids) for e in examples))
            return {"shard_id": shard_id, "transaction_id": final.name, "decision": decision}
        else:  # quarantined (refused for reuse) or corrupt: a new transaction
            if decision == "quarantine-and-restart":
                shards.resume(latest, root, plan, **mine)
    if txn is None:
        txn = shards.begin(root, plan, shard_id, _txn_id(shard_id, attempt))
        fault("capture_after_begin")
    bar.update(sum(len(e.target_token_ids) for c in chunks[:done] for e in c))
    for j in range(done, len(chunks)):
        scored = scorer.score([(e.example_id, e.prompt_token_ids, e.target_token_ids) for e in chunks[j]])
        data = _encode(plan, scored, req.layout)
        if os.environ.get("KILN_DISTILL_FAULT") == "capture_torn_payload" and j == 1:
            frag = txn / shards.PAYLOAD_DIR / f".{_payload_name(j, req.layout)}.torn.tmp"
            frag.write_bytes(data[: len(data) // 2])
            fault("capture_torn_payload")
        shards.write_payload_bytes(txn, _payload_name(j, req.layout), data)
        bar.update(sum(len(e.target_token_ids) for e in chunks[j]))
        fault("capture_after_payload")
    shards.mark_complete(txn, **mine)
    fault("capture_after_complete")
    shards.mark_verified(txn, **mine)
    fault("capture_after_verified")
    final = shards.publish(txn, root)
    fault("capture_after_available")
    return {"shard_id": shard_id, "transaction_id": final.name, "decision": decision}


def _quarantine_outside_layout(root: Path, n_shards: int, per_shard: int) -> None:
    """Quarantine the newest live transaction of every shard index this run's layout does not have:
    after a resume with more examples per shard, its examples now belong to a lower shard, and two
    available shards must never hold one example."""
    for base in (root, root / shards.STAGING_DIRNAME):
        if not base.is_dir():
            continue
        for entry in sorted(base.iterdir()):
            name = entry.name
            if not (name.startswith("shard-") and ".t" in name) or entry.is_symlink() or not entry.is_dir():
                continue
            index = name[len("shard-") : name.index(".t")]
            if not index.isdigit() or int(index) < n_shards:
                continue
            try:
                state = shards.read_manifest_chain(entry)[-1].state
            except (DistillError, OSError):
                continue  # unreadable: never reused or consumed anyway
            if state != "quarantined":
                shards.quarantine(entry, f"outside this run's shard layout: with {per_shard} examples per shard the "
                                         f"run has {n_shards} shard(s); its examples are captured in a lower shard")


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", unit_scale=True, desc="capture", disable=not enabled, file=sys.stderr)


def _read_plan(path: str) -> Plan:
    return Plan.parse(read_file_nofollow(path, max_bytes=MAX_ARTIFACT_JSON_BYTES))


def refuse_foreign_root(root: Path, plan: Plan) -> None:
    """Refuse, before writing anything, a publication root that holds another plan's run.

    Another plan's shard transactions, or receipts that name another plan, make the root
    another run's: capturing into it would overwrite that run's request and receipts. The
    spec's threat model: a mixed run "refuse[s] resume/consumption and create[s] a new run".
    """
    digest = plan.digest()
    foreign = shards.foreign_transactions(root, digest)
    for name in ("capture.json", "capture-child.json"):
        path = root / RECEIPTS_DIR / name
        if path.is_file() and not path.is_symlink():
            try:
                named = strict_json_loads(read_bytes_nofollow(root / RECEIPTS_DIR, name, max_bytes=1 << 20))
            except (ValueError, OSError):
                continue
            if isinstance(named, dict) and named.get("plan_sha256") not in (None, digest):
                foreign.append(f"{RECEIPTS_DIR}/{name}")
    if foreign:
        raise ShardError(
            f"{root} holds another plan's run ({', '.join(foreign[:5])}); a changed plan is a new run: "
            "use a new --out (nothing was written)"
        )


def run_capture_child(req: CaptureRequest) -> dict[str, Any]:
    """The teacher-only child body: verify, load, score, publish; write the child receipt."""
    from kiln.distill.local import check_renderer, check_tokenizer_dir

    started = time.monotonic()
    plan = _read_plan(req.plan)
    refuse_foreign_root(Path(req.out), plan)
    if req.layout not in ("packed", "jsonl"):
        raise ContractError(f"layout must be 'packed' or 'jsonl', not {req.layout!r}")
    check_packable(plan)  # the capture encodes packed columns first, for either layout
    if plan.capture.max_forced_ids < 1:
        raise ContractError("max_forced_ids must be at least 1")
    examples = load_examples(req.dataset_root, plan)
    check_tokenizer_dir(plan.tokenizer, req.tokenizer, "teacher")
    import transformers

    check_renderer(plan, transformers.__version__)
    root = Path(req.out)
    root.mkdir(parents=True, exist_ok=True)
    if req.teacher_remote is not None:
        from kiln.distill.remote import RemoteTeacherScorer

        scorer: TeacherScorer = RemoteTeacherScorer(plan, req.teacher_remote, req.tokenizer)
    else:
        scorer = LocalTeacherScorer(plan, req.teacher, device=req.device, batch_size=req.batch_size)
    e = max(1, req.examples_per_shard)
    groups = [examples[i : i + e] for i in range(0, len(examples), e)]
    total = sum(len(x.target_token_ids) for x in examples)
    records = []
    dataset = {x.example_id: x for x in examples}
    with _progress(total, req.progress) as bar:
        for i, group in enumerate(groups):
            records.append(_capture_shard(req, plan, scorer, root, _shard_id(i), group, dataset, bar))
    _quarantine_outside_layout(root, len(groups), e)
    receipt = {
        "schema": CHILD_RECEIPT_SCHEMA,
        "plan_sha256": plan.digest(),
        "pid": os.getpid(),
        "tokens": total,
        "seconds": round(time.monotonic() - started, 3),
        "shards": records,
        **scorer.receipt(),
    }
    receipt["seconds"] = float(receipt["seconds"])
    (root / RECEIPTS_DIR).mkdir(exist_ok=True)
    atomic_write_bytes(root / RECEIPTS_DIR / "capture-child.json", canonical_json_bytes(receipt))
    return receipt


def capture(req: CaptureRequest, *, timeout: float | None = None) -> dict[str, Any]:
    """Controller: run the child in a fresh process, then reopen manifests and write the receipt."""
    root = Path(req.out)
    refuse_foreign_root(root, _read_plan(req.plan))
    root.mkdir(parents=True, exist_ok=True)
    (root / RECEIPTS_DIR).mkdir(exist_ok=True)
    request_path = root / RECEIPTS_DIR / "capture-request.json"
    atomic_write_bytes(request_path, canonical_json_bytes(req.to_obj()))
    child_receipt = root / RECEIPTS_DIR / "capture-child.json"
    child_receipt.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.distill.capture", str(request_path)],
        stdout=subprocess.PIPE,
        stderr=None if req.progress else subprocess.PIPE,
        timeout=timeout,
    )
    if proc.returncode != 0:
        tail = (proc.stdout or b"").decode("utf-8", "replace").strip().splitlines()
        err = _child_error(tail[-1] if tail else "")
        raise ShardError(f"capture child exited with {proc.returncode}: {err}")
    raw = child_receipt.read_bytes()
    child = strict_json_loads(raw)
    plan = _read_plan(req.plan)
    shards.check_run_complete(root, plan)
    reopened, verdicts = [], []
    for rec in child["shards"]:
        verdict = shards.verify_shard(root / rec["transaction_id"], expected_plan_sha256=plan.digest())
        if not verdict.ok or verdict.state != "available":
            raise ShardError(f"{rec['transaction_id']} is not an intact available shard after capture: {verdict.problems}")
        verdicts.append(verdict)
        reopened.append({**rec, "manifest_sha256": verdict.manifest_sha256, "tokens": verdict.tokens,
                         "payload_bytes": verdict.payload_bytes, "bytes_per_token": shards.bytes_per_token(verdict)})
    receipt = {
        "schema": RECEIPT_SCHEMA,
        "plan_sha256": plan.digest(),
        "child_receipt_sha256": sha256_hex(raw),
        "child_exit_code": proc.returncode,
        "shards": reopened,
        "tokens": sum(r["tokens"] for r in reopened),
        "payload_bytes": sum(r["payload_bytes"] for r in reopened),
        # The spec: "Actual output must report both planned and observed bytes/token."
        "bytes_per_token": shards.run_bytes_per_token(verdicts)["bytes_per_token"],
        "dtype": child["declared_dtype"],
        "quantization": child["quantization"],
        "seconds": child["seconds"],
    }
    atomic_write_bytes(root / RECEIPTS_DIR / "capture.json", canonical_json_bytes(receipt))
    return receipt


def _child_error(line: str) -> str:
    try:
        obj = json.loads(line)
        return f"{obj['error']['code']}: {obj['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return line[-2000:] or "no output"


def shard_status(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Per-transaction state of a capture root (published and staging), with resume decisions."""
    root = Path(root)
    out = []
    for base, where in ((root, "published"), (root / shards.STAGING_DIRNAME, "staging-area")):
        if not base.is_dir():
            continue
        for entry in sorted(base.iterdir()):
            if entry.name.startswith(".") or not entry.is_dir() or entry.is_symlink():
                continue
            try:
                chain = shards.read_manifest_chain(entry)
                head = chain[-1]
                state, rows, tokens = head.state, head.rows, head.tokens
                shard_id, reason = head.shard_id, head.quarantine_reason
            except (DistillError, OSError) as exc:
                state, rows, tokens, shard_id, reason = None, None, None, None, str(exc)
            out.append(
                {"transaction_id": entry.name, "shard_id": shard_id, "location": where, "state": state,
                 "rows": rows, "tokens": tokens, "note": reason}
            )
    counts: dict[str, int] = {}
    for r in out:
        counts[str(r["state"])] = counts.get(str(r["state"]), 0) + 1
    return {"root": str(root), "transactions": out, "states": counts}


def _main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print(json.dumps({"error": {"code": "usage_error", "message": "usage: python -m kiln.distill.capture REQUEST"}}))
        return 2
    try:
        req = CaptureRequest.from_obj(strict_json_loads(read_file_nofollow(argv[0], max_bytes=1 << 20)))
        receipt = run_capture_child(req)
    except DistillError as exc:
        print(json.dumps({"error": {"code": exc.code, "message": str(exc)}}))
        return 2
    except KilnError as exc:  # a remote teacher's refusal (fingerprint changed, unreachable, too large)
        print(json.dumps({"error": {"code": exc.code, "message": str(exc)}}))
        return 2
    except Exception as exc:  # noqa: BLE001 - one JSON line for the controller
        print(json.dumps({"error": {"code": "capture_failed", "message": f"{type(exc).__name__}: {exc}"}}))
        return 2
    print(json.dumps({"ok": True, "tokens": receipt["tokens"], "shards": len(receipt["shards"])}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
