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
    from tqdm import tqdm

    from kiln.distill.local import check_model_dir, check_tokenizer_dir
    from kiln.runtime.loader import inspect_model_dir, load_model
    from kiln.training.losses.kd import SparseKDLoss

    out = Path(out_dir)
    plan, todo, skipped = available_shards(run_root)
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
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob(".tmp-adapter-*")) + list((out / "checkpoints").glob(".tmp-ckpt-*")):
        shutil.rmtree(stale, ignore_errors=True)  # a crash before its rename; never referenced
    _config_record(
        out,
        {
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
        },
    )
    torch.manual_seed(seed)
    loaded = load_model(info.path, device=device, dtype=dtype, info=info)
    model = loaded.model
    vocab = int(model.get_output_embeddings().weight.shape[0])
    if vocab != plan.tokenizer.vocab_size:
        raise ContractError(f"student output width {vocab} differs from the plan's vocab_size {plan.tokenizer.vocab_size}")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=list(target_modules),
                       task_type="CAUSAL_LM"),
        )
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    loss_fn = SparseKDLoss(ce_weight=ce_weight, kd_weight=kd_weight, temperature=plan.probability.temperature)
    use_ce = plan.consumption.trajectory == "teacher-expert"
    split = kd_loss_split(model)

    ckpts = _checkpoint_dirs(out)
    state: dict[str, Any] = {"step": 0, "tokens": 0, "consumed": []}
    ckpt_sha = None
    if ckpts:
        state, ckpt_sha = _checkpoint_record(ckpts[-1])
        _restore(ckpts[-1], model, optimizer)
    consumed = {(c["artifact_sha256"], c["reservation_id"]) for c in state["consumed"]}
    k, limit = plan.probability.top_k, plan.capture.max_sequence_length
    report = []
    owner = consumer_key(out)
    for shard_dir, head in todo:
        ledger = _open_ledger(run_root, out, shard_dir, head, plan)
        action = "already-committed"
        if ledger.view.state == "reserved":
            open_rid = ledger.view.open_reservation[1]  # type: ignore[index]
            if (ledger.artifact_sha256, open_rid) in consumed:
                ledger.reconcile(ckpt_sha)  # type: ignore[arg-type]
                action = "reconciled"
            elif _owned(open_rid, owner, out, head.transaction_id):
                ledger.release()
                fault("train_after_release")
            else:
                raise LedgerError(
                    f"{head.transaction_id} is reserved by another consumer (run "
                    f"{ledger.view.open_reservation[0]!r}, reservation {open_rid!r}); consumption state is shared "  # type: ignore[index]
                    "by every trainer of this capture, and only that consumer may release or commit it"
                )
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
            examples = load_shard_examples(shard_dir, head, plan)
            windows = forward_windows(examples, limit)
            with tqdm(total=head.tokens, unit="tok", desc=head.shard_id, disable=not progress, file=sys.stderr) as bar:
                for b0 in range(0, len(windows), batch_size):
                    batch = windows[b0 : b0 + batch_size]
                    ids, att, rows, offs, sel, lp, mask, tail, target = batch_tensors(
                        batch, examples, k, vocab, loaded.device, use_ce
                    )
                    loss, _parts = kd_step_loss(model, split, loss_fn, ids, att, rows, offs, sel, lp, mask, tail,
                                                target)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    passes += 1
                    state["step"] += 1
                    state["tokens"] += int(rows.numel())
                    bar.update(int(rows.numel()))
                    fault("train_mid_shard")
            state["consumed"].append(
                {"transaction_id": head.transaction_id, "artifact_sha256": ledger.artifact_sha256, "reservation_id": rid}
            )
            consumed.add((ledger.artifact_sha256, rid))
            _path, ckpt_sha = _write_checkpoint(out, len(_checkpoint_dirs(out)) + 1, model, optimizer, state)
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
    adapter = _publish_output(out, model, lora, ckpt_sha)
    return {
        "adapter": str(adapter),
        "plan_sha256": plan.digest(),
        "shards": report,
        "steps": state["step"],
        "tokens": state["tokens"],
        "checkpoint_sha256": ckpt_sha,
        "skipped": skipped,
    }


def ledger_status(base: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Consumption state per ledger file in ``base`` (a capture's ``.consumption``, or a legacy
    ``<train dir>/ledgers``); no model import."""
    out = []
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
