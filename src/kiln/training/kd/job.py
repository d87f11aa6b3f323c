"""Sparse-KD jobs on the server: train the served model's LoRA adapter from an offline capture run.

``POST /v1/train/kd`` names a capture run root (``kiln distill capture --out``)
under the server's data dir. :func:`prepare_kd` validates it before queueing:
every shard is verified (:func:`kiln.distill.examples.available_shards`), the
capture plan's ``student`` must be the served checkpoint and its ``tokenizer``
the served tokenizer (the same checks ``train_sparse_kd`` makes), and its
``vocab_size`` the model's output width. The worker then consumes each shard
through the consumption ledger, as :func:`kiln.distill.train.train_sparse_kd`
does: reserve -> train one pass (each optimizer step under exclusive ownership)
-> durable checkpoint -> commit with the checkpoint's SHA-256. The adapter is
published with manifest kind ``kd``, its config binding ``capture_plan_sha256``.

Ledgers live beside the capture (``<run>/.consumption/``, :mod:`kiln.distill.consumption`), shared
with ``kiln distill train`` and every adapter: consumption follows the artifact and its rows, so a
shard is consumed once whoever trains on it. A second job for the same run is refused (409
``capture_consumed``) unless it sets ``replay`` (a chained replay, only under ``replay: chained``);
shards captured since the last job are trained alone. Ledgers an older Kiln kept under
``<home>/training/kd/<capture plan sha256>/<adapter>/`` are adopted on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.canonical import canonical_json_bytes, sha256_file, sha256_hex
from kiln.errors import Conflict, InvalidRequest
from kiln.training.core.plan import JobPlan, PrepareContext, anchor_fields, decay_fields, lora_fields, seal_plan
from kiln.training.core.recipe import TrainingRecipe

if TYPE_CHECKING:
    from kiln.training.kd.schemas import KDRequest


@dataclass(frozen=True)
class KDShard:
    transaction_id: str
    shard_dir: Path
    artifact_sha256: str
    steps_per_pass: int


@dataclass(frozen=True)
class KDData:
    run_root: Path
    capture_plan: Any  # kiln.distill.contract.Plan
    shards: tuple[KDShard, ...]
    ledger_root: Path  # where an older Kiln kept this adapter's ledgers (adopted in prepare)
    passes: int  # passes over each shard this job makes (request.epochs)
    replay: bool
    ce_weight: float
    kd_weight: float
    total_steps: int


def checkpoint_digest(path: Path) -> str:
    """SHA-256 of a checkpoint directory: the canonical list of its files (path, size, SHA-256)."""
    files = []
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        digest, size = sha256_file(f)
        files.append({"path": f.name, "size": size, "sha256": digest})
    return sha256_hex(canonical_json_bytes({"schema": "kiln.kd-job-checkpoint.v1", "files": files}))


def _ledger(run_root: Path, shard: KDShard, capture_plan: Any, legacy_root: Path | None = None) -> Any:
    from kiln.distill.consumption import adopt_legacy_ledger, artifact_ledger, consumption_dir

    if legacy_root is not None:
        name = f"{shard.transaction_id}.jsonl"
        adopt_legacy_ledger(legacy_root / name, consumption_dir(run_root) / name)
    return artifact_ledger(run_root, shard.shard_dir, capture_plan, shard.transaction_id)


def _check_binding(ctx: PrepareContext, plan: Any) -> None:
    """The capture plan must bind the served checkpoint, tokenizer and vocabulary (409 naming the field)."""
    from kiln.distill.errors import ContractError
    from kiln.distill.local import check_model_dir, check_tokenizer_dir

    path = ctx.model.path
    if plan.student.revision != ctx.model.base_model_sha256:
        raise Conflict(f"the capture plan's student.revision {plan.student.revision} is not the served model "
                       f"({ctx.model.base_model_sha256})", code="capture_student_mismatch",
                       param="student.revision", hint="capture with a plan whose student is the served model")
    try:
        check_model_dir(plan.student, path, "student")
    except ContractError as exc:
        raise Conflict(str(exc), code="capture_student_mismatch", param="student") from None
    try:
        check_tokenizer_dir(plan.tokenizer, path, "student")
    except ContractError as exc:
        raise Conflict(str(exc), code="capture_tokenizer_mismatch", param="tokenizer") from None
    head = ctx.model.model.get_output_embeddings()
    width = int(head.weight.shape[0]) if head is not None else None
    if width != plan.tokenizer.vocab_size:
        raise Conflict(f"the served model's output width {width} differs from the capture plan's "
                       f"tokenizer.vocab_size {plan.tokenizer.vocab_size}", code="capture_vocab_mismatch",
                       param="tokenizer.vocab_size")


def _check_not_in_use(ctx: PrepareContext, capture_sha: str, adapter: str) -> None:
    if ctx.jobs is None:  # no queue (kiln train run): nothing else consumes it here
        return
    for job in ctx.jobs.active():
        if job.kind == "kd" and job.adapter == adapter and job.request.get("capture_plan_sha256") == capture_sha:
            raise Conflict(f"job {job.id} is already consuming this capture for adapter {adapter!r}",
                           code="capture_in_use", hint="wait for it to finish")


def _check_open_reservation(ctx: PrepareContext, ledger: Any, resume_from: str | None) -> None:
    """A reservation left open by a failed job whose checkpoint holds its training: only resuming it may
    close it (reconcile); one made before a durable checkpoint is released by the next job."""
    from kiln.errors import NotFound
    from kiln.training.core.checkpoints import list_checkpoints
    from kiln.training.core.checkpoints import load_checkpoint as _load

    run_id, rid = ledger.view.open_reservation
    if run_id == resume_from or ctx.jobs is None:
        return
    try:
        owner = ctx.jobs.get(run_id)
    except NotFound:  # not a job of this server: another consumer of the capture (kiln distill train)
        raise Conflict(f"a shard is reserved by another consumer of this capture (run {run_id!r}, reservation "
                       f"{rid!r}); consumption state is shared, only that consumer may release it",
                       code="capture_reserved", hint="wait for it to finish") from None
    found = list_checkpoints(ctx.checkpoint_root(owner.id))
    if not found:
        return
    ckpt = _load(found[-1], plan_sha256=owner.request.get("plan_sha256", ""))
    if any(c["reservation_id"] == rid for c in ckpt.stats.get("extra", {}).get("kd_commits", [])):
        raise Conflict(f"a shard is reserved by job {owner.id}, whose checkpoint holds its training",
                       code="capture_reserved", hint=f"resubmit with resume_from_job={owner.id!r}")


def prepare_kd(ctx: PrepareContext, request: KDRequest) -> JobPlan[KDData]:
    """Validate a KD request against the capture run, the served model and the ledgers; return its plan."""
    from kiln.distill.errors import DistillError
    from kiln.distill.examples import available_shards, forward_windows, load_shard_examples
    from kiln.training.core.data import TrainingDataError, confined_data_dir
    from kiln.training.core.loop import Plan

    ctx.check_adapter_name(request.adapter)
    root = confined_data_dir(ctx.settings.data_path, request.run, label="run")
    try:
        plan, todo, _skipped = available_shards(root)
    except DistillError as exc:
        raise TrainingDataError(f"run {request.run!r}: {exc}", code="invalid_capture", param="run") from None
    _check_binding(ctx, plan)
    limit = ctx.max_seq_len_limit
    if limit is not None and plan.capture.max_sequence_length > limit:
        raise InvalidRequest(f"the capture's max_sequence_length {plan.capture.max_sequence_length} exceeds the "
                             f"served model's limit {limit}", code="sequence_too_long", param="run")
    passes = request.epochs or 1
    if (passes > 1 or request.replay) and plan.consumption.replay != "chained":
        raise Conflict(f"this capture's consumption policy is replay {plan.consumption.replay!r} "
                       f"({plan.consumption.trajectory}); epochs > 1 and replay need 'chained'",
                       code="replay_forbidden", param="replay")
    parent = ctx.parent_of(request)
    lora = ctx.lora_shape(request, parent)
    capture_sha = plan.digest()
    _check_not_in_use(ctx, capture_sha, request.adapter)
    legacy_root = ctx.root / "kd" / capture_sha / request.adapter
    shards, fresh_steps = [], 0
    for shard_dir, head in todo:
        try:
            examples = load_shard_examples(shard_dir, head, plan)
            windows = len(forward_windows(examples, plan.capture.max_sequence_length))
            data_shard = KDShard(head.transaction_id, shard_dir, head.digest(),
                                 math.ceil(windows / request.batch_size))
            ledger = _ledger(root, data_shard, plan, legacy_root)
        except DistillError as exc:
            raise TrainingDataError(f"run {request.run!r}: {exc}", code="invalid_capture", param="run") from None
        if ledger.view.state == "reserved":
            _check_open_reservation(ctx, ledger, request.resume_from_job)
        shards.append(data_shard)
        fresh_steps += data_shard.steps_per_pass if ledger.view.commits == 0 else 0
    if not fresh_steps and not request.replay and request.resume_from_job is None:
        raise Conflict(f"every shard of run {request.run!r} was already consumed (consumption follows the "
                       "capture, whichever adapter or trainer consumed it)",
                       code="capture_consumed", param="replay",
                       hint="set replay=true for a chained replay, or capture new shards")
    total = passes * max(1, sum(s.steps_per_pass for s in shards) if request.replay else fresh_steps)
    eff = request.model_dump(mode="json")
    eff.update(epochs=passes, capture_plan_sha256=capture_sha, capture_trajectory=plan.consumption.trajectory,
               **lora_fields(lora, parent), **anchor_fields(request, default_weight=0.0), **decay_fields(request))
    inputs = {"capture_plan_sha256": capture_sha, "shards": sorted(s.artifact_sha256 for s in shards)}
    inputs_sha, plan_sha = seal_plan("kd", eff, inputs, ctx.model.base_model_sha256)
    if request.resume_from_job is not None:
        ctx.check_resumable(request.resume_from_job, plan_sha)
    data = KDData(root, plan, tuple(shards), legacy_root, passes, request.replay, request.ce_weight,
                  request.kd_weight, total)
    loop = Plan(request.learning_rate, passes, request.batch_size, request.seed, 0, max_steps=None,
                weight_decay=eff["weight_decay"])
    return JobPlan("kd", request.adapter, eff, inputs_sha, plan_sha, lora, loop, data, parent,
                   request.auto_load, request.resume_from_job)


# ------------------------------------------------------------------------- the loop


def run_kd(peft_model: Any, name: str, data: KDData, plan: Any, *, hooks: Any, resume: Any, job_id: str,
           anchor: Any = None, pad_id: int = 0) -> Any:
    """Consume each shard through its ledger: reserve (or chained replay) -> train a pass, one optimizer step
    per batch under exclusive ownership -> durable checkpoint -> commit with the checkpoint's SHA-256.

    The steps run on :class:`~kiln.training.core.loop.TrainLoop`'s pieces (ownership, cancel, progress); its
    checkpoints are the ledger's, one per pass, instead of every ``checkpoint_interval`` steps."""
    from kiln.training.core.loop import TrainLoop

    loop = TrainLoop(peft_model, name, plan, hooks, data.total_steps, resume)
    loop.stats.setdefault("kd_commits", [])
    loop.stats.setdefault("first_loss", None)
    step = _KDStep(peft_model, data, loop, anchor=anchor, pad_id=pad_id)
    resume_digest = None if resume is None else checkpoint_digest(resume.path)
    actions: dict[str, str] = {}
    with loop.running():
        for shard in data.shards:
            ledger = _ledger(data.run_root, shard, data.capture_plan)
            mine = [c for c in loop.stats["kd_commits"] if c["transaction_id"] == shard.transaction_id]
            if ledger.view.state == "reserved":
                if any(c["reservation_id"] == ledger.view.open_reservation[1] for c in mine):
                    ledger.reconcile(resume_digest)  # crash after the checkpoint, before the commit
                    actions[shard.transaction_id] = "reconciled"
                else:
                    ledger.release()  # reserved before any durable checkpoint: nothing was consumed
            if ledger.view.commits > len(mine) and not data.replay:
                actions.setdefault(shard.transaction_id, "already-committed")
                continue
            while len(mine) < data.passes:
                loop.check_cancel()
                mine.append(_consume_pass(loop, step, ledger, shard, len(mine), job_id, actions))
        if loop.step == 0:
            raise Conflict("nothing left to consume: every shard was committed before this job ran",
                           code="capture_consumed")
        loop.hooks.on_progress(loop.progress())
    report = loop.report()
    report.extra["shards"] = [{"transaction_id": s.transaction_id, "action": actions.get(s.transaction_id)}
                              for s in data.shards]
    return report


class _KDStep:
    """One sparse-KD optimizer step on a batch of a shard's windows (:mod:`kiln.training.losses.kd_batch`)."""

    def __init__(self, peft_model: Any, data: KDData, loop: Any, *, anchor: Any = None, pad_id: int = 0):
        from kiln.training.losses.kd_batch import kd_loss_split
        from kiln.training.losses.kd import SparseKDLoss

        cplan = data.capture_plan
        self.peft_model, self.loop, self.cplan = peft_model, loop, cplan
        self.anchor, self.pad_id = anchor, pad_id  # the KL-to-base anchor (kiln.training.core.anchor), opt-in
        self.loss_fn = SparseKDLoss(ce_weight=data.ce_weight, kd_weight=data.kd_weight,
                                    temperature=cplan.probability.temperature)
        self.use_ce = cplan.consumption.trajectory == "teacher-expert"
        self.split = kd_loss_split(peft_model)

    def train_pass(self, shard: KDShard, pass_index: int) -> None:
        """Every batch of ``shard``'s windows, in order: one optimizer step each (sliced into groups of windows
        and the anchor rows while serving waits: :meth:`pieces`)."""
        from kiln.distill.examples import forward_windows, load_shard_examples
        from kiln.training.core.loop import StepInput

        loop, cplan, batch_size = self.loop, self.cplan, self.loop.plan.batch_size
        self.examples = load_shard_examples(shard.shard_dir, _head(shard), cplan)
        windows = forward_windows(self.examples, cplan.capture.max_sequence_length)
        for b0 in range(0, len(windows), batch_size):
            loop.check_cancel()
            batch = windows[b0:b0 + batch_size]
            loop.update(StepInput(batch, sum(len(places) for _w, places in batch)), self.loss, slicer=self.pieces)
            if loop.stats["first_loss"] is None:
                loop.stats["first_loss"] = round(loop.loss, 6)
            loop.after_step(pass_index, b0 // batch_size + 1)


    def windows_loss(self, batch: list[Any]) -> Any:
        """The sparse-KD loss of a batch of windows (a mean over their captured positions)."""
        from kiln.training.losses.kd_batch import batch_tensors, kd_step_loss

        k, vocab = self.cplan.probability.top_k, self.cplan.tokenizer.vocab_size
        ids, att, rows, offs, sel, lp, mask, tail, target = batch_tensors(batch, self.examples, k, vocab,
                                                                           self.loop.device, self.use_ce)
        loss, _parts = kd_step_loss(self.peft_model, self.split, self.loss_fn, ids, att, rows, offs, sel, lp,
                                    mask, tail, target)
        return loss

    def loss(self, batch: list[Any]) -> Any:
        """One step's loss: the windows', plus the anchor's term."""
        from kiln.training.core.anchor import anchor_term

        loss = self.windows_loss(batch)
        if self.anchor is not None:
            loss = loss + anchor_term(self.anchor, self.peft_model, self.split, self.loop, self.pad_id)
        return loss

    def pieces(self, batch: list[Any], limit: int) -> list[Any]:
        """Groups of windows within ``limit`` tokens, each weighted by its share of the captured positions (both
        the KD and the CE term are means over them), then the anchor rows."""
        from functools import partial

        from kiln.training.core.anchor import anchor_piece
        from kiln.training.core.loop import Piece, row_groups

        total = sum(len(places) for _w, places in batch)
        out = []
        for g in row_groups([len(w) for w, _p in batch], limit):
            part = batch[g.start:g.stop]
            n = sum(len(places) for _w, places in part)
            if n:
                out.append(Piece(partial(self.windows_loss, part), n / total, sum(len(w) for w, _p in part)))
        if self.anchor is not None:
            out.append(anchor_piece(self.anchor, self.peft_model, self.split, self.loop, self.pad_id))
        return out


def _consume_pass(loop: Any, step: _KDStep, ledger: Any, shard: KDShard, done: int, job_id: str,
                  actions: dict[str, str]) -> dict[str, Any]:
    """Pass ``done + 1`` over ``shard``: reserve (or replay) -> train -> durable checkpoint -> commit; returns
    its ``kd_commits`` entry. A failure before the checkpoint gives the shard back."""
    from kiln.distill.faults import fault

    rid = f"{job_id}.{shard.transaction_id}.r{len(ledger.view.reservation_ids)}"
    if ledger.view.commits:
        ledger.replay(job_id, rid)
        actions[shard.transaction_id] = "replayed"
    else:
        ledger.reserve(job_id, rid)
        actions[shard.transaction_id] = "trained"
    fault("kd_job_after_reserve")
    checkpointed = False
    try:
        step.train_pass(shard, done)
        entry = {"transaction_id": shard.transaction_id, "artifact_sha256": ledger.artifact_sha256,
                 "reservation_id": rid}
        extra = loop.stats | {"kd_commits": loop.stats["kd_commits"] + [entry]}
        with loop.step_ownership():
            path = loop.save(done + 1, 0, extra=extra, step_options=False)
        checkpointed = True
        loop.stats["kd_commits"] = extra["kd_commits"]
    except BaseException:
        if not checkpointed and ledger.view.state == "reserved":
            ledger.release()  # no durable checkpoint holds this pass: give the shard back
        raise
    fault("kd_job_after_checkpoint")  # crash tests: durable checkpoint, no commit yet
    digest = checkpoint_digest(path)
    ledger.commit(digest)
    entry["checkpoint_sha256"] = digest
    loop.checkpoint_step = loop.step
    return entry


def _head(shard: KDShard) -> Any:
    from kiln.distill import shards as shardlib

    head = shardlib.read_manifest_chain(shard.shard_dir)[-1]
    if head.digest() != shard.artifact_sha256:
        raise Conflict(f"shard {shard.transaction_id} changed since the job was submitted", code="capture_changed")
    return head


# ------------------------------------------------------------------------- the recipe


class KDRecipe(TrainingRecipe):
    """A KD job: setup -> train (ledger-consumed shards) -> save -> publish (kind ``kd``) -> activate."""

    plan: JobPlan[KDData]

    def receipt_teacher(self) -> dict[str, Any] | None:
        teacher = self.plan.data.capture_plan.teacher  # the capture plan's teacher fingerprint
        return {"model_id": teacher.model_id, "revision": teacher.revision, "fingerprint_sha256": teacher.digest()}

    def train(self, resume: Any) -> Any:
        tok = self.ctx.model.tokenizer
        report = run_kd(self.peft_model, self.private, self.plan.data, self.plan.loop, hooks=self.ctx.hooks,
                        resume=resume, job_id=self.job_id, anchor=self.anchor([]),
                        pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
        self._phase("train")
        return report
