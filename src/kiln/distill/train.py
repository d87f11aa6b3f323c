"""Student-only sparse-KD training over published shards, consumed through the ledger.

``train_sparse_kd(...)`` is a plain function (a future server job can call it):
it never loads a teacher. For every available shard of one run, in shard order:

1. open the shard's ledger (``<out>/ledgers/<transaction_id>.jsonl``);
2. skip a committed shard; if a reservation is open, either *reconcile* (the
   latest durable checkpoint already records this reservation: append exactly
   one commit, never retrain) or *release* it (crash before the checkpoint);
3. reserve, train one pass over the shard (CE on the target + coarse-tail
   forward KL, ``kiln.training.losses.kd.SparseKDLoss``), write a durable
   checkpoint (temp dir, fsync, one rename), commit with the checkpoint's SHA-256.

Training resumes from the latest checkpoint (trainable weights and optimizer
state), and batches are a deterministic function of the shard bytes, so an
interrupted run ends with the same weights as an uninterrupted one. At the end
the adapter (PEFT files) or the full model is published to ``<out>/adapter``.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from kiln.canonical import (
    atomic_publish_dir,
    atomic_write_bytes,
    canonical_json_bytes,
    sha256_file,
    sha256_hex,
    strict_json_loads,
)
from kiln.distill.contract import MAX_ARTIFACT_JSON_BYTES, Plan, ShardManifest
from kiln.distill.errors import ContractError, LedgerError
from kiln.distill.examples import available_shards, forward_windows, load_shard_examples
from kiln.distill.faults import fault
from kiln.distill.consumption import adopt_legacy_ledger, artifact_ledger, consumption_dir
from kiln.distill.ledger import MAX_LEDGER_BYTES
from kiln.distill.paths import read_bytes_nofollow
from kiln.training.losses.kd_batch import batch_tensors, kd_loss_split, kd_step_loss

__all__ = ["TRAIN_CONFIG_SCHEMA", "CHECKPOINT_SCHEMA", "train_sparse_kd"]

TRAIN_CONFIG_SCHEMA = "kiln.distill.train-config.v1"
CHECKPOINT_SCHEMA = "kiln.distill.kd-checkpoint.v1"
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


# ------------------------------------------------------------------- ledgers


def consumer_key(out: Path) -> str:
    """This training directory's name in shared ledgers: reservation IDs start with it."""
    return "kd-" + sha256_hex(os.path.realpath(out).encode())[:12]


def _owned(reservation_id: str, owner: str, out: Path, transaction_id: str) -> bool:
    """Whether an open reservation was made by this training directory (also in a ledger an older Kiln
    kept under ``out/ledgers``, whose IDs had no owner prefix)."""
    legacy = (out / "ledgers" / f"{transaction_id}.jsonl").is_file()
    return reservation_id.startswith(owner + ".") or (legacy and reservation_id.startswith(transaction_id + ".r"))


def _open_ledger(run_root, out: Path, shard_dir: Path, head: ShardManifest, plan: Plan):  # type: ignore[no-untyped-def]
    """The artifact's ledger beside the capture (``kiln.distill.consumption``), after adopting one an
    older Kiln kept in this training directory."""
    txn = head.transaction_id
    adopt_legacy_ledger(out / "ledgers" / f"{txn}.jsonl", consumption_dir(run_root) / f"{txn}.jsonl")
    return artifact_ledger(run_root, shard_dir, plan, txn)


# ----------------------------------------------------------------- checkpoints


def _checkpoint_dirs(out: Path) -> list[Path]:
    base = out / "checkpoints"
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if p.name.startswith("ckpt-") and p.is_dir())


def _checkpoint_record(ckpt: Path) -> tuple[dict[str, Any], str]:
    """(state, checkpoint_sha256) after re-hashing every file the checkpoint lists."""
    raw = read_bytes_nofollow(ckpt, "CHECKPOINT.json", max_bytes=MAX_ARTIFACT_JSON_BYTES)
    doc = strict_json_loads(raw)
    if doc.get("schema") != CHECKPOINT_SCHEMA:
        raise ContractError(f"{ckpt}: not a {CHECKPOINT_SCHEMA} checkpoint")
    for f in doc["files"]:
        digest, size = sha256_file(ckpt / f["path"])
        if (digest, size) != (f["sha256"], f["size"]):
            raise ContractError(f"{ckpt}/{f['path']} does not match its checkpoint record")
    return doc["state"], sha256_hex(raw)


def _write_checkpoint(out: Path, index: int, model, optimizer, state: dict[str, Any]) -> tuple[Path, str]:
    import torch
    from safetensors.torch import save_file

    base = out / "checkpoints"
    final = base / f"ckpt-{index:05d}"
    tmp = base / f".tmp-ckpt-{index:05d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    trainable = {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters() if p.requires_grad}
    save_file(trainable, str(tmp / "trainable.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    files = []
    for name in ("optimizer.pt", "trainable.safetensors"):
        digest, size = sha256_file(tmp / name)
        files.append({"path": name, "size": size, "sha256": digest})
    raw = canonical_json_bytes({"schema": CHECKPOINT_SCHEMA, "files": files, "state": state})
    atomic_write_bytes(tmp / "CHECKPOINT.json", raw)
    atomic_publish_dir(tmp, final)
    return final, sha256_hex(raw)


def _restore(ckpt: Path, model, optimizer) -> None:
    import torch
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "trainable.safetensors"))
    params = dict(model.named_parameters())
    if set(saved) != {n for n, p in params.items() if p.requires_grad}:
        raise ContractError(f"{ckpt} holds other trainable parameters than this model; use a new --out")
    with torch.no_grad():
        for name, value in saved.items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))


# ------------------------------------------------------------------- training


def _config_record(out: Path, config: dict[str, Any]) -> None:
    path = out / "train.json"
    data = canonical_json_bytes(config)
    if path.exists():
        if path.read_bytes() != data:
            raise ContractError(
                f"{path} records a different training configuration; resume with the same options or use a new --out"
            )
        return
    atomic_write_bytes(path, data)


def _publish_output(out: Path, model, lora: bool, ckpt_sha: str) -> Path:
    final = out / "adapter"
    marker = "kiln_kd_checkpoint.json"
    if final.is_dir() and (final / marker).is_file():
        if strict_json_loads((final / marker).read_bytes()).get("checkpoint_sha256") == ckpt_sha:
            return final
        shutil.move(str(final), str(out / f".old-adapter-{int(time.time() * 1000)}"))
    tmp = out / f".tmp-adapter-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    atomic_write_bytes(tmp / marker, canonical_json_bytes({"checkpoint_sha256": ckpt_sha, "lora": lora}))
    atomic_publish_dir(tmp, final)
    return final


def train_sparse_kd(
    run_root: str | os.PathLike[str],
    student: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    run_id: str = "kd",
    lora: bool = True,
    lora_r: int = 8,
    lora_alpha: int = 16,
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES,
    lr: float = 1e-3,
    batch_size: int = 8,
    ce_weight: float = 1.0,
    kd_weight: float = 1.0,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    epochs: int = 1,
    progress: bool = False,
) -> dict[str, Any]:
    """Consume every available shard of a run exactly once; return a summary dict.

    Returns ``{"adapter", "shards": [{"transaction_id", "action", ...}], "steps",
    "tokens", "checkpoint_sha256", "skipped"}`` where action is ``trained``,
    ``reconciled`` (commit appended from an existing checkpoint, no retraining)
    ``replayed`` (a further pass through a chained replay reservation) or
    ``already-committed``.

    ``epochs`` is the number of commits each shard should end with: 1 consumes
    every shard once; more replays teacher-expert shards through ``replay_of``
    reservations (only under ``replay: chained``; student-rollout shards are
    consume-once). It is a target, so a resumed or repeated call never trains a
    shard past it. It is not pinned in ``train.json``: raising it later continues.
    """
    import torch

    out = Path(out_dir)
    plan, todo, skipped = available_shards(run_root)
    info = _check_run(plan, student, epochs)
    _prepare_out(out, {
        "schema": TRAIN_CONFIG_SCHEMA,
        "plan_sha256": plan.digest(),
        "student_fingerprint_sha256": plan.student.digest(),
        "run_id": run_id,
        "lora": lora,
        "lora_r": lora_r,
        "lora_alpha": lora_alpha,
        "target_modules": sorted(target_modules),
        "lr": float(lr),
        "batch_size": batch_size,
        "ce_weight": float(ce_weight),
        "kd_weight": float(kd_weight),
        "seed": seed,
        "dtype": dtype,
    })
    torch.manual_seed(seed)
    loaded, model = _load_student(info, plan, device=device, dtype=dtype, lora=lora, lora_r=lora_r,
                                  lora_alpha=lora_alpha, target_modules=target_modules)
    trainer = _ShardTrainer(model, plan, loaded.device, lr=lr, batch_size=batch_size, ce_weight=ce_weight,
                            kd_weight=kd_weight, progress=progress)
    ckpt_sha = trainer.resume(out)
    report = []
    owner = consumer_key(out)
    for shard_dir, head in todo:
        ledger = _open_ledger(run_root, out, shard_dir, head, plan)
        action = _settle_open_reservation(ledger, trainer.consumed, ckpt_sha, owner, out, head.transaction_id)
        passes = 0
        while ledger.view.commits < epochs:
            rid = f"{owner}.{head.transaction_id}.r{len(ledger.view.reservation_ids)}"
            if ledger.view.commits:
                ledger.replay(run_id, rid)  # a chained replay: replay_of = the last commit event
                action = "replayed"
            else:
                ledger.reserve(run_id, rid)
                action = "trained"
            fault("train_after_reserve")
            passes += trainer.train_shard(shard_dir, head)
            ckpt_sha = trainer.checkpoint(out, head.transaction_id, ledger.artifact_sha256, rid)
            fault("train_after_checkpoint")
            ledger.commit(ckpt_sha)
            fault("train_after_commit")
        report.append({"transaction_id": head.transaction_id, "action": action, "steps": passes,
                       "commits": ledger.view.commits})
    if ckpt_sha is None:
        raise LedgerError(
            f"nothing was trained and no checkpoint exists: every shard of {run_root} was already consumed "
            f"(its ledgers are under {consumption_dir(run_root)}); a further pass is a chained replay (--epochs)"
        )
    adapter = _publish_output(out, trainer.model, lora, ckpt_sha)
    return {
        "adapter": str(adapter),
        "plan_sha256": plan.digest(),
        "shards": report,
        "steps": trainer.state["step"],
        "tokens": trainer.state["tokens"],
        "checkpoint_sha256": ckpt_sha,
        "skipped": skipped,
    }


def _check_run(plan: Plan, student: str | os.PathLike[str], epochs: int) -> Any:
    """The student's model directory (``ModelDirInfo``), checked against the plan; ``epochs`` against its policy."""
    from kiln.distill.local import check_model_dir, check_tokenizer_dir
    from kiln.runtime.loader import inspect_model_dir

    if epochs < 1:
        raise ContractError("epochs must be at least 1")
    if epochs > 1 and plan.consumption.replay != "chained":
        raise LedgerError(
            f"epochs={epochs} needs replays, but this plan's consumption policy is replay "
            f"{plan.consumption.replay!r} ({plan.consumption.trajectory}); student rollouts are consume-once"
        )
    info = inspect_model_dir(student)
    check_model_dir(plan.student, info.path, "student")
    check_tokenizer_dir(plan.tokenizer, info.path, "student")
    return info


def _prepare_out(out: Path, config: dict[str, Any]) -> None:
    """Create ``out``, drop what a crash left before a rename, and record (or check) the training config."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob(".tmp-adapter-*")) + list((out / "checkpoints").glob(".tmp-ckpt-*")):
        shutil.rmtree(stale, ignore_errors=True)  # a crash before its rename; never referenced
    _config_record(out, config)


def _load_student(info: Any, plan: Plan, *, device: str, dtype: str, lora: bool, lora_r: int, lora_alpha: int,
                  target_modules: tuple[str, ...]) -> tuple[Any, Any]:
    """(the loaded student, the model to train: with a fresh LoRA unless ``lora`` is false); its output width
    must be the plan's vocabulary."""
    from kiln.runtime.loader import load_model

    loaded = load_model(info.path, device=device, dtype=dtype, info=info)
    model = loaded.model
    vocab = int(model.get_output_embeddings().weight.shape[0])
    if vocab != plan.tokenizer.vocab_size:
        raise ContractError(f"student output width {vocab} differs from the plan's vocab_size {plan.tokenizer.vocab_size}")
    if lora:
        from peft import LoraConfig

        from kiln.runtime.peft_wrap import get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=list(target_modules),
                       task_type="CAUSAL_LM"),
        )
    model.train()
    return loaded, model


def _settle_open_reservation(ledger: Any, consumed: set[tuple[str, str]], ckpt_sha: str | None, owner: str,
                             out: Path, transaction_id: str) -> str:
    """A reservation left open by a crash: commit it from the checkpoint that already records it (``reconciled``,
    never retrained) or release this consumer's own; another consumer's is refused. ``already-committed``
    otherwise (the pass loop then decides)."""
    if ledger.view.state != "reserved":
        return "already-committed"
    open_rid = ledger.view.open_reservation[1]
    if (ledger.artifact_sha256, open_rid) in consumed:
        ledger.reconcile(ckpt_sha)
        return "reconciled"
    if _owned(open_rid, owner, out, transaction_id):
        ledger.release()
        fault("train_after_release")
        return "already-committed"
    raise LedgerError(
        f"{transaction_id} is reserved by another consumer (run "
        f"{ledger.view.open_reservation[0]!r}, reservation {open_rid!r}); consumption state is shared "
        "by every trainer of this capture, and only that consumer may release or commit it"
    )


class _ShardTrainer:
    """The student, its optimizer and loss, and the training state a checkpoint records
    (``{"step", "tokens", "consumed": [{transaction_id, artifact_sha256, reservation_id}]}``)."""

    def __init__(self, model: Any, plan: Plan, device: Any, *, lr: float, batch_size: int, ce_weight: float,
                 kd_weight: float, progress: bool):
        import torch

        from kiln.training.losses.kd import SparseKDLoss

        self.model, self.plan, self.device, self.batch_size, self.progress = model, plan, device, batch_size, progress
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        self.loss_fn = SparseKDLoss(ce_weight=ce_weight, kd_weight=kd_weight, temperature=plan.probability.temperature)
        self.use_ce = plan.consumption.trajectory == "teacher-expert"
        self.split = kd_loss_split(model)
        self.vocab = plan.tokenizer.vocab_size
        self.state: dict[str, Any] = {"step": 0, "tokens": 0, "consumed": []}
        self.consumed: set[tuple[str, str]] = set()  # (artifact_sha256, reservation_id) the weights include

    def resume(self, out: Path) -> str | None:
        """Restore the latest checkpoint under ``out`` (weights, optimizer, state); its SHA-256, or None."""
        ckpts = _checkpoint_dirs(out)
        ckpt_sha = None
        if ckpts:
            self.state, ckpt_sha = _checkpoint_record(ckpts[-1])
            _restore(ckpts[-1], self.model, self.optimizer)
        self.consumed = {(c["artifact_sha256"], c["reservation_id"]) for c in self.state["consumed"]}
        return ckpt_sha

    def train_shard(self, shard_dir: Path, head: ShardManifest) -> int:
        """One pass over the shard's windows, one optimizer step per batch; the number of steps."""
        from tqdm import tqdm

        plan, steps = self.plan, 0
        examples = load_shard_examples(shard_dir, head, plan)
        windows = forward_windows(examples, plan.capture.max_sequence_length)
        with tqdm(total=head.tokens, unit="tok", desc=head.shard_id, disable=not self.progress, file=sys.stderr) as bar:
            for b0 in range(0, len(windows), self.batch_size):
                ids, att, rows, offs, sel, lp, mask, tail, target = batch_tensors(
                    windows[b0 : b0 + self.batch_size], examples, plan.probability.top_k, self.vocab, self.device,
                    self.use_ce)
                loss, _parts = kd_step_loss(self.model, self.split, self.loss_fn, ids, att, rows, offs, sel, lp, mask,
                                            tail, target)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                steps += 1
                self.state["step"] += 1
                self.state["tokens"] += int(rows.numel())
                bar.update(int(rows.numel()))
                fault("train_mid_shard")
        return steps

    def checkpoint(self, out: Path, transaction_id: str, artifact_sha256: str, reservation_id: str) -> str:
        """Record the reservation as consumed and write a durable checkpoint; its SHA-256 (what the commit names)."""
        self.state["consumed"].append(
            {"transaction_id": transaction_id, "artifact_sha256": artifact_sha256, "reservation_id": reservation_id})
        self.consumed.add((artifact_sha256, reservation_id))
        _path, ckpt_sha = _write_checkpoint(out, len(_checkpoint_dirs(out)) + 1, self.model, self.optimizer,
                                            self.state)
        return ckpt_sha


def ledger_status(base: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Consumption state per ledger file in ``base`` (a capture's ``.consumption``, or a legacy
    ``<train dir>/ledgers``); no model import."""
    out: list[dict[str, Any]] = []
    base = Path(base)
    if not base.is_dir():
        return out
    for path in sorted(base.glob("*.jsonl")):
        from kiln.distill.contract import ConsumptionEvent

        raw = read_bytes_nofollow(base, path.name, max_bytes=MAX_LEDGER_BYTES)
        events = [ConsumptionEvent.parse(line) for line in raw.splitlines() if line]
        last = events[-1] if events else None
        out.append(
            {
                "transaction_id": path.stem,
                "state": last.next_state if last else "available",
                "events": len(events),
                "commits": sum(1 for e in events if e.action == "commit"),
                "checkpoint_sha256": next((e.checkpoint_sha256 for e in reversed(events) if e.checkpoint_sha256), None),
            }
        )
    return out


__all__ += ["ledger_status"]
