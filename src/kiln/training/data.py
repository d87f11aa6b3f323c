"""Training data: safe dataset reading, chat tokenization with loss masks, batching.

SFT rows become ``(input_ids, loss_mask)`` where the mask marks assistant tokens
(from the chat template's ``{% generation %}`` markers). GRPO completions become
``prompt_ids + completion_ids + [eos]`` with a mask on the completion part.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from kiln.canonical import strict_json_loads
from kiln.errors import InvalidRequest, NotFound
from kiln.training.schemas import GRPOGroup, SFTExample

MAX_DATASET_BYTES = 256 * 1024 * 1024
MAX_DATASET_LINE_BYTES = 4 * 1024 * 1024


_NOT_FOUND_CODES = frozenset({"dataset_not_found"})


class TrainingDataError(InvalidRequest, ValueError):
    """Training input is unusable (400; 404 when the dataset file does not exist)."""

    code = "invalid_training_data"

    def __init__(self, message: str, *, code: str = "invalid_training_data", hint: str = "",
                 param: str | None = None):
        super().__init__(message, code=code, hint=hint, param=param)
        if code in _NOT_FOUND_CODES:
            self.status = NotFound.status


# ------------------------------------------------------------------ dataset file


def resolve_dataset_path(data_dir: Path, relative: str) -> Path:
    """Map a caller-supplied path to a regular file strictly inside ``data_dir``.

    Absolute paths, ``..`` escapes and symlinks anywhere on the way are refused.
    """
    root = Path(data_dir).resolve()
    candidate: Path | None = Path(relative)
    if candidate.is_absolute():
        candidate = candidate.relative_to(root) if candidate.is_relative_to(root) else None
    resolved = (root / candidate).resolve() if candidate is not None else None
    if resolved is None or os.path.commonpath([root, resolved]) != str(root) or resolved == root:
        raise TrainingDataError(
            f"dataset_path {relative!r} is outside the data directory",
            code="dataset_outside_data_dir",
            hint=f"put the JSONL file under {root} and pass its path relative to it",
        )
    full = root / candidate
    walk = root
    for part in candidate.parts:
        walk = walk / part
        try:
            st = os.lstat(walk)
        except FileNotFoundError:
            raise TrainingDataError(
                f"dataset_path {relative!r} does not exist in the data directory",
                code="dataset_not_found",
                hint=f"files are looked up under {root}",
            ) from None
        if stat.S_ISLNK(st.st_mode):
            raise TrainingDataError(
                f"dataset_path {relative!r} goes through a symlink ({walk.name}); symlinks are refused",
                code="dataset_symlink",
                hint="copy the file into the data directory instead of linking it",
            )
    if not stat.S_ISREG(os.lstat(full).st_mode):
        raise TrainingDataError(f"dataset_path {relative!r} is not a regular file", code="dataset_not_file")
    return full


def read_sft_dataset(path: Path, *, max_examples: int) -> list[SFTExample]:
    """Parse a JSONL file of ``{"messages": [...]}`` rows (bounded in bytes and rows)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # no symlink swapped in since the check
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > MAX_DATASET_BYTES:
            raise TrainingDataError(
                f"{path.name} is {size} bytes; the limit is {MAX_DATASET_BYTES}", code="dataset_too_large",
                hint="split the dataset into several jobs",
            )
        examples: list[SFTExample] = []
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_DATASET_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_DATASET_LINE_BYTES:
                raise TrainingDataError(f"{path.name} line {lineno} is longer than {MAX_DATASET_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            if len(examples) >= max_examples:
                raise TrainingDataError(
                    f"{path.name} has more than {max_examples} examples (training.max_examples)",
                    code="dataset_too_large",
                )
            try:
                examples.append(SFTExample.model_validate(strict_json_loads(raw)))
            except ValueError as exc:
                raise TrainingDataError(
                    f"{path.name} line {lineno}: {exc}",
                    hint='each line must be {"messages": [{"role": ..., "content": ...}, ...]}',
                ) from None
    if not examples:
        raise TrainingDataError(f"{path.name} holds no examples")
    return examples


# ---------------------------------------------------------------- tokenization


@dataclass(frozen=True)
class Row:
    """One training sequence; ``loss_mask`` marks the positions that carry loss."""

    input_ids: list[int]
    loss_mask: list[int]


def tokenize_sft(tokenizer: Any, examples: Sequence[SFTExample], *, max_seq_len: int) -> list[Row]:
    rows: list[Row] = []
    for i, ex in enumerate(examples):
        enc = tokenizer.apply_chat_template(
            [m.model_dump() for m in ex.messages],
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids = list(enc["input_ids"])
        mask = [int(x) for x in enc["assistant_masks"]]
        if len(ids) > max_seq_len:
            raise TrainingDataError(
                f"example {i} is {len(ids)} tokens; max_seq_len is {max_seq_len}",
                code="example_too_long", hint="shorten the example or raise max_seq_len",
            )
        if sum(mask[1:]) == 0:
            raise TrainingDataError(
                f"example {i} has no assistant tokens to learn from",
                hint="the chat template must mark assistant turns with {% generation %}",
            )
        rows.append(Row(ids, mask))
    return rows


def tokenize_grpo_group(tokenizer: Any, group: GRPOGroup, *, max_seq_len: int) -> list[Row]:
    prompt = tokenizer.apply_chat_template(
        [m.model_dump() for m in group.messages], tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    prompt = list(prompt)
    rows = []
    for c in group.completions:
        comp = tokenizer(c.text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = prompt + comp
        if len(ids) > max_seq_len:
            raise TrainingDataError(
                f"a completion makes a {len(ids)}-token sequence; max_seq_len is {max_seq_len}",
                code="example_too_long", hint="shorten the completion or raise max_seq_len",
            )
        rows.append(Row(ids, [0] * len(prompt) + [1] * len(comp)))
    return rows


# -------------------------------------------------------------------- batching


def collate(rows: Sequence[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows into ``input_ids``, ``attention_mask``, ``loss_mask`` (all ``[B, T]``)."""
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        attn[i, :n] = 1
        loss[i, :n] = torch.tensor(r.loss_mask)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}


def epoch_order(n_items: int, *, seed: int, epoch: int) -> list[int]:
    """The item order of one epoch: a pure function of (seed, epoch), so a resumed
    job walks the same batches as an uninterrupted one."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_items, generator=gen).tolist()


def batches_per_epoch(n_items: int, batch_size: int) -> int:
    return math.ceil(n_items / batch_size)


def default_epochs(n_items: int, batch_size: int, *, min_steps: int, max_epochs: int) -> int:
    """Enough epochs to reach ``min_steps`` optimizer steps, at most ``max_epochs``."""
    return max(1, min(max_epochs, math.ceil(min_steps / batches_per_epoch(n_items, batch_size))))

