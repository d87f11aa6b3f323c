"""Training data: safe dataset reading, chat tokenization with loss masks, batching.

SFT rows become ``(input_ids, loss_mask)`` where the mask marks assistant tokens
(found for any chat template, see :mod:`kiln.training.core.templates`). GRPO completions become
``prompt_ids + completion_ids + [eos]`` with a mask on the completion part.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from kiln.canonical import NotRegularFileError, open_regular, strict_json_loads
from kiln.errors import InvalidRequest, NotFound
from kiln.training.core.templates import assistant_tokens
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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _path_parts(root: Path, relative: str, label: str = "dataset_path") -> list[str]:
    """The components of ``relative`` below ``root``; refuses NUL bytes, absolute paths outside and ``..``."""
    if "\x00" in relative:
        raise TrainingDataError(f"{label} contains a NUL byte", code="invalid_dataset_path", param=label)
    candidate = Path(relative)
    if candidate.is_absolute():
        if not candidate.is_relative_to(root):
            raise _outside(relative, root, label)
        candidate = candidate.relative_to(root)
    parts = [p for p in candidate.parts if p != "."]
    if not parts or ".." in parts:
        raise _outside(relative, root, label)
    return parts


def _outside(relative: str, root: Path, label: str = "dataset_path") -> TrainingDataError:
    return TrainingDataError(
        f"{label} {relative!r} is outside the data directory",
        code="dataset_outside_data_dir", param=label,
        hint=f"put {'the JSONL file' if label == 'dataset_path' else 'it'} under {root} and pass its path relative to it",
    )


def _open_below(dir_fd: int, name: str, flags: int | None, relative: str, root: Path,
                label: str = "dataset_path") -> int:
    """``openat(dir_fd, name, flags)`` with every failure mapped to a 4xx training-data error; ``flags=None``
    opens the final file with :func:`kiln.canonical.open_regular` (a FIFO or device refused before it blocks)."""
    try:
        if flags is None:
            return open_regular(name, dir_fd=dir_fd)
        return os.open(name, flags, dir_fd=dir_fd)
    except NotRegularFileError as exc:
        if exc.errno != errno.ELOOP:
            raise TrainingDataError(f"{label} {relative!r} is not a regular file", code="dataset_not_file",
                                    param=label) from None
        raise TrainingDataError(
            f"{label} {relative!r} goes through a symlink ({name}); symlinks are refused",
            code="dataset_symlink", hint="copy the file into the data directory instead of linking it",
            param=label,
        ) from None
    except FileNotFoundError:
        raise TrainingDataError(
            f"{label} {relative!r} does not exist in the data directory",
            code="dataset_not_found", hint=f"files are looked up under {root}", param=label,
        ) from None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise TrainingDataError(f"{label} {relative!r} has a component that is too long",
                                    code="invalid_dataset_path", param=label) from None
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            try:
                link = stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
            except OSError:
                link = False
            if link:
                raise TrainingDataError(
                    f"{label} {relative!r} goes through a symlink ({name}); symlinks are refused",
                    code="dataset_symlink", hint="copy the file into the data directory instead of linking it",
                    param=label,
                ) from None
            raise TrainingDataError(f"{label} {relative!r}: {name} is not a directory",
                                    code="dataset_not_file", param=label) from None
        raise TrainingDataError(f"{label} {relative!r} cannot be opened: {exc.strerror}",
                                code="dataset_unreadable", param=label) from None


def open_dataset(data_dir: Path, relative: str) -> int:
    """Open a regular file strictly inside ``data_dir`` and return its descriptor.

    Each component is opened relative to the previous one's descriptor with
    ``O_NOFOLLOW`` (directories also with ``O_DIRECTORY``), so swapping any
    directory on the way for a symlink cannot redirect the open; the file is
    opened ``O_NONBLOCK`` (a FIFO cannot block the thread) and refused unless
    ``fstat`` says it is a regular file. Read the data from this descriptor.
    """
    root = Path(data_dir).resolve()
    parts = _path_parts(root, relative)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        raise TrainingDataError(f"the data directory {root} does not exist", code="dataset_not_found",
                                hint=f"create {root} and put the JSONL file in it") from None
    try:
        for part in parts[:-1]:
            nxt = _open_below(fd, part, _DIR_FLAGS, relative, root)
            os.close(fd)
            fd = nxt
        file_fd = _open_below(fd, parts[-1], None, relative, root)
    finally:
        os.close(fd)
    try:
        st = os.fstat(file_fd)
        if st.st_nlink > 1:  # a hard link may name a file outside the data directory: refused like a symlink
            raise TrainingDataError(f"dataset_path {relative!r} has {st.st_nlink} hard links; only files with one "
                                    "link are read (another link may be a file outside the data directory)",
                                    code="dataset_hard_link",
                                    hint="copy the file into the data directory instead of linking it")
    except BaseException:
        os.close(file_fd)
        raise
    return file_fd


def confined_data_dir(data_dir: Path, relative: str, *, label: str) -> Path:
    """The directory ``relative`` strictly inside ``data_dir``, walked component by component with
    ``O_NOFOLLOW | O_DIRECTORY`` as :func:`open_dataset` does (a symlink anywhere on the way is refused)."""
    root = Path(data_dir).resolve()
    parts = _path_parts(root, relative, label)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        raise TrainingDataError(f"the data directory {root} does not exist", code="dataset_not_found",
                                param=label) from None
    try:
        for part in parts:
            nxt = _open_below(fd, part, _DIR_FLAGS, relative, root, label)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)
    return root.joinpath(*parts)


def load_sft_dataset(data_dir: Path, relative: str, *, max_examples: int) -> tuple[list[SFTExample], str]:
    """Read ``relative`` (inside ``data_dir``, see :func:`open_dataset`); returns the examples and the
    SHA-256 of exactly the bytes they were parsed from."""
    fd = open_dataset(data_dir, relative)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > MAX_DATASET_BYTES:
            raise TrainingDataError(
                f"{relative} is {size} bytes; the limit is {MAX_DATASET_BYTES}", code="dataset_too_large",
                hint="split the dataset into several jobs",
            )
        data = f.read(MAX_DATASET_BYTES + 1)
    if len(data) > MAX_DATASET_BYTES:
        raise TrainingDataError(f"{relative} grew past {MAX_DATASET_BYTES} bytes", code="dataset_too_large")
    return parse_sft_jsonl(data, name=relative, max_examples=max_examples), hashlib.sha256(data).hexdigest()


def parse_sft_jsonl(data: bytes, *, name: str, max_examples: int) -> list[SFTExample]:
    """Parse JSONL ``{"messages": [...]}`` rows (bounded in line length and rows)."""
    examples: list[SFTExample] = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if len(raw) > MAX_DATASET_LINE_BYTES:
            raise TrainingDataError(f"{name} line {lineno} is longer than {MAX_DATASET_LINE_BYTES} bytes")
        if not raw.strip():
            continue
        if len(examples) >= max_examples:
            raise TrainingDataError(f"{name} has more than {max_examples} examples (training.max_examples)",
                                    code="dataset_too_large")
        try:
            examples.append(SFTExample.model_validate(strict_json_loads(raw)))
        except ValueError as exc:
            raise TrainingDataError(
                f"{name} line {lineno}: {exc}",
                hint='each line must be {"messages": [{"role": ..., "content": ...}, ...]}',
            ) from None
    if not examples:
        raise TrainingDataError(f"{name} holds no examples")
    return examples


# ---------------------------------------------------------------- tokenization


@dataclass(frozen=True)
class Row:
    """One training sequence; ``loss_mask`` marks the positions that carry loss."""

    input_ids: list[int]
    loss_mask: list[int]


def tokenize_sft(tokenizer: Any, examples: Sequence[SFTExample], *, max_seq_len: int,
                 end_ids: Iterable[int] = ()) -> list[Row]:
    """Tokenize chats; the mask covers the assistant's tokens (see :mod:`kiln.training.core.templates`)."""
    rows: list[Row] = []
    for i, ex in enumerate(examples):
        ids, mask = assistant_tokens(tokenizer, [m.model_dump() for m in ex.messages], end_ids=end_ids)
        if len(ids) > max_seq_len:
            raise TrainingDataError(
                f"example {i} is {len(ids)} tokens; max_seq_len is {max_seq_len}",
                code="example_too_long", hint="shorten the example or raise max_seq_len",
            )
        if sum(mask[1:]) == 0:
            raise TrainingDataError(f"example {i} has no assistant tokens to learn from",
                                    hint="give each example a non-empty assistant message")
        rows.append(Row(ids, mask))
    return rows


def grpo_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The chat template's prompt for ``messages`` with the generation prompt appended."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def grpo_row(tokenizer: Any, prompt: list[int], text: str, *, max_seq_len: int) -> Row:
    """``prompt + completion_ids + [eos]`` with the mask on the completion part."""
    comp = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = prompt + comp
    if len(ids) > max_seq_len:
        raise TrainingDataError(
            f"a completion makes a {len(ids)}-token sequence; max_seq_len is {max_seq_len}",
            code="example_too_long", hint="shorten the completion or raise max_seq_len",
        )
    return Row(ids, [0] * len(prompt) + [1] * len(comp))


def tokenize_grpo_group(tokenizer: Any, group: GRPOGroup, *, max_seq_len: int) -> list[Row]:
    prompt = grpo_prompt_ids(tokenizer, [m.model_dump() for m in group.messages])
    return [grpo_row(tokenizer, prompt, c.text, max_seq_len=max_seq_len) for c in group.completions]


# -------------------------------------------------------------------- batching


def collate(rows: Sequence[Row], pad_id: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-pad rows into ``input_ids``, ``attention_mask``, ``loss_mask`` (all ``[B, T]``, on ``device``)."""
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        attn[i, :n] = 1
        loss[i, :n] = torch.tensor(r.loss_mask)
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device), "loss_mask": loss.to(device)}


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



# --------------------------------------------------------------------- packing


def pack_bins(lengths: Sequence[int]) -> list[list[int]]:
    """Group row indices into bins no wider than the longest row (first-fit decreasing, deterministic).

    A batch's rows are never split and never leave their batch, so a step trains on
    exactly the rows it would train on unpacked; only the padding goes away.
    """
    width = max(lengths)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(width - lengths[i])
    return [sorted(b) for b in bins]


def collate_packed(rows: Sequence[Row], pad_id: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Rows packed into fewer sequences when that removes padding, else :func:`collate`.

    Packed, the batch also has ``position_ids`` (``[N, W]``) that restart at 0 for each
    row: transformers reads a restart as a sequence boundary and builds a block-diagonal
    causal mask (``masking_utils.find_packed_sequence_indices``), and the rotary embedding
    sees each row at its own positions, so every row's logits are those of the unpacked
    row. Each row's first position carries no loss (it has no predecessor in its row),
    as unpacked. Padding at the end of a bin continues the last row's positions, so it
    is part of that row's block and, being after it, cannot change it.
    ``rows_per_sequence`` records how many rows each packed sequence holds.
    """
    bins = pack_bins([len(r.input_ids) for r in rows])
    if len(bins) == len(rows):
        return collate(rows, pad_id, device)
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(bins), width), dtype=torch.long)
    attn = torch.zeros((len(bins), width), dtype=torch.long)
    loss = torch.zeros((len(bins), width), dtype=torch.long)
    for b, members in enumerate(bins):
        at = 0
        for i in members:
            r = rows[i]
            n = len(r.input_ids)
            ids[b, at:at + n] = torch.tensor(r.input_ids)
            pos[b, at:at + n] = torch.arange(n)
            attn[b, at:at + n] = 1
            loss[b, at + 1:at + n] = torch.tensor(r.loss_mask[1:])
            at += n
        pos[b, at:] = torch.arange(pos[b, at - 1] + 1, pos[b, at - 1] + 1 + width - at)
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device), "loss_mask": loss.to(device),
            "position_ids": pos.to(device), "rows_per_sequence": torch.tensor([len(b) for b in bins])}
