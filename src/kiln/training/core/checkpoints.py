"""Training checkpoints for exact resume.

A checkpoint is a directory ``step-<NNNNNNNN>`` holding everything the loop
needs to continue bit-for-bit: the private adapter's weights, the optimizer
state, the RNG state, the data cursor and any per-job tensors (GRPO's reference
log-probabilities). It is written into a sibling temp dir and published with
one rename, so a crash leaves either the whole checkpoint or none.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kiln.canonical import atomic_publish_dir, atomic_write_json, open_regular, read_regular_file, strict_json_loads

CHECKPOINT_SCHEMA = "kiln.training-checkpoint.v1"
KEEP_CHECKPOINTS = 2
MAX_STATE_JSON_BYTES = 1024 * 1024
_PREFIX = "step-"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or belongs to a different plan."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    epoch: int
    batch: int  # next batch index within ``epoch``
    plan_sha256: str
    adapter_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_state: torch.Tensor
    tensors: dict[str, torch.Tensor]
    stats: dict[str, Any]


def save_checkpoint(
    root: Path,
    *,
    step: int,
    epoch: int,
    batch: int,
    plan_sha256: str,
    adapter_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    tensors: dict[str, torch.Tensor] | None = None,
    stats: dict[str, Any] | None = None,
) -> Path:
    """Publish ``root/step-<step>`` atomically and prune all but the newest ``KEEP_CHECKPOINTS``."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:08d}"
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in adapter_state.items()}, staging / "adapter.safetensors")
        torch.save(optimizer_state, staging / "optimizer.pt")
        torch.save(torch.get_rng_state(), staging / "rng.pt")
        if tensors:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, staging / "tensors.safetensors")
        atomic_write_json(
            staging / "state.json",
            {
                "schema": CHECKPOINT_SCHEMA,
                "step": step,
                "epoch": epoch,
                "batch": batch,
                "plan_sha256": plan_sha256,
                "stats": stats or {},
            },
        )
        if final.exists():
            shutil.rmtree(final)
        atomic_publish_dir(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temp dirs are ignored)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def load_checkpoint(path: Path, *, plan_sha256: str) -> Checkpoint:
    """Load one checkpoint, refusing one written for a different training plan."""
    state_file = path / "state.json"
    try:
        state = strict_json_loads(read_regular_file(state_file, MAX_STATE_JSON_BYTES))
        for name in ("adapter.safetensors", "optimizer.pt", "rng.pt"):  # never a FIFO handed to a blocking load
            os.close(open_regular(path / name))
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} is not a complete checkpoint (no {Path(exc.filename or '').name})") from None
    except OSError as exc:  # NotRegularFileError, FileTooLargeError
        raise CheckpointError(f"{path} is not a usable checkpoint: {exc.strerror or exc}") from None
    if state.get("schema") != CHECKPOINT_SCHEMA:
        raise CheckpointError(f"{state_file}: unknown schema {state.get('schema')!r}")
    if state["plan_sha256"] != plan_sha256:
        raise CheckpointError(
            f"checkpoint {path.name} was written for a different training plan; resume needs the identical "
            "request (same data, model, adapter and hyperparameters)"
        )
    tensors_file = path / "tensors.safetensors"
    return Checkpoint(
        path=path,
        step=int(state["step"]),
        epoch=int(state["epoch"]),
        batch=int(state["batch"]),
        plan_sha256=state["plan_sha256"],
        adapter_state=load_file(path / "adapter.safetensors"),
        optimizer_state=torch.load(path / "optimizer.pt", weights_only=True),
        rng_state=torch.load(path / "rng.pt", weights_only=True),
        tensors=load_file(tensors_file) if tensors_file.is_file() else {},
        stats=dict(state.get("stats") or {}),
    )


def latest_checkpoint(root: Path, *, plan_sha256: str) -> Checkpoint | None:
    found = list_checkpoints(root)
    return load_checkpoint(found[-1], plan_sha256=plan_sha256) if found else None
