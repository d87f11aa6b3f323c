"""Validation of PEFT LoRA files against a base model, without loading either model.

Shapes come from safetensors headers (parsed here with the standard library);
finiteness is checked on the raw bit patterns with numpy, so publication needs
neither torch nor transformers and stays fast in a fresh process.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.adapters.errors import InvalidAdapter
from kiln.canonical import CanonicalJSONError, strict_json_loads

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_ADAPTER_CONFIG_BYTES = 1024 * 1024
MAX_SAFETENSORS_HEADER_BYTES = 32 * 1024 * 1024
MAX_ADAPTER_WEIGHTS_BYTES = 32 * 1024**3
MAX_LORA_RANK = 4096
PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"base_model\.model\.(?P<module>[A-Za-z0-9_.]+)\.lora_(?P<ab>[AB])\.weight")

# Exponent masks: a float is non-finite exactly when all exponent bits are set.
_FLOAT_BITS = {
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
    "F32": ("<u4", 0x7F800000),
    "F64": ("<u8", 0x7FF0000000000000),
}
_DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


@dataclass(frozen=True)
class LoraSummary:
    """What a validated adapter holds: its config and, per module, (rank, in, out)."""

    config: dict[str, Any]
    modules: dict[str, tuple[int, int, int]]


def read_safetensors_header(path: Path, *, max_file_bytes: int = MAX_ADAPTER_WEIGHTS_BYTES) -> dict[str, TensorInfo]:
    """Parse a safetensors header (bounded) and check that offsets tile the data section."""
    size = path.stat().st_size
    if size > max_file_bytes:
        raise InvalidAdapter(f"{path.name} is {size} bytes; the limit is {max_file_bytes}")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise InvalidAdapter(f"{path.name} is too short to be safetensors")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_SAFETENSORS_HEADER_BYTES or n + 8 > size:
            raise InvalidAdapter(f"{path.name}: safetensors header length {n} is out of bounds")
        raw = f.read(n)
    try:
        header = strict_json_loads(raw)
    except CanonicalJSONError as exc:
        raise InvalidAdapter(f"{path.name}: safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise InvalidAdapter(f"{path.name}: safetensors header is not an object")
    header.pop("__metadata__", None)
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for key, meta in header.items():
        try:
            dtype, shape, (lo, hi) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise InvalidAdapter(f"{path.name}: malformed header entry for {key!r}") from exc
        if dtype not in _DTYPE_BYTES or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise InvalidAdapter(f"{path.name}: tensor {key!r} has unsupported dtype {dtype!r} or bad shape")
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
            raise InvalidAdapter(f"{path.name}: tensor {key!r} has bad data offsets")
        if hi - lo != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise InvalidAdapter(f"{path.name}: tensor {key!r} byte length does not match its shape")
        tensors[key] = TensorInfo(dtype, shape, data_start + lo, data_start + hi)
        spans.append((lo, hi))
    spans.sort()
    pos = 0
    for lo, hi in spans:
        if lo != pos:
            raise InvalidAdapter(f"{path.name}: tensor data overlaps or leaves gaps")
        pos = hi
    if data_start + pos > size:
        raise InvalidAdapter(f"{path.name}: tensor data runs past the end of the file (truncated?)")
    if data_start + pos < size:
        raise InvalidAdapter(f"{path.name}: {size - data_start - pos} trailing bytes after tensor data")
    return tensors


def check_finite(path: Path, tensors: dict[str, TensorInfo]) -> None:
    """Raise if any floating-point tensor holds NaN or +-Inf."""
    import numpy as np

    if not tensors:
        return
    data = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        for key, t in tensors.items():
            if t.dtype not in _FLOAT_BITS:
                raise InvalidAdapter(f"{path.name}: LoRA tensor {key!r} has non-float dtype {t.dtype}")
            if t.end == t.start:
                continue
            view_dtype, mask = _FLOAT_BITS[t.dtype]
            bits = data[t.start:t.end].view(view_dtype)
            bad = np.count_nonzero((bits & mask) == mask)
            if bad:
                raise InvalidAdapter(
                    f"{path.name}: tensor {key!r} has {bad} non-finite values (NaN/Inf)",
                    hint="Training diverged; lower the learning rate or check the data, then train again.",
                )
    finally:
        del data


def read_adapter_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise InvalidAdapter(f"{path.name} is missing")
    if path.stat().st_size > MAX_ADAPTER_CONFIG_BYTES:
        raise InvalidAdapter(f"{path.name} is larger than {MAX_ADAPTER_CONFIG_BYTES} bytes")
    try:
        cfg = strict_json_loads(path.read_bytes())
    except CanonicalJSONError as exc:
        raise InvalidAdapter(f"{path.name} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise InvalidAdapter(f"{path.name} must hold a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise InvalidAdapter(f"{path.name}: peft_type is {cfg.get('peft_type')!r}; Kiln stores LoRA adapters only")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_LORA_RANK:
        raise InvalidAdapter(f"{path.name}: r must be an integer in 1..{MAX_LORA_RANK}")
    alpha = cfg.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise InvalidAdapter(f"{path.name}: lora_alpha must be a positive number")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save") or cfg.get("use_dora"):
        raise InvalidAdapter(
            f"{path.name}: bias training, modules_to_save and DoRA are not supported",
            hint="Train a plain LoRA (bias='none', no modules_to_save, use_dora=False).",
        )
    tm = cfg.get("target_modules")
    if not (isinstance(tm, str) or (isinstance(tm, list) and tm and all(isinstance(m, str) for m in tm))):
        raise InvalidAdapter(f"{path.name}: target_modules must be a non-empty list of names or a regex string")
    return cfg


def _targeted(module: str, target_modules: str | list[str]) -> bool:
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    return module.rsplit(".", 1)[-1] in target_modules or module in target_modules


def base_weight_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` over every safetensors shard of a base model directory."""
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        for key, t in read_safetensors_header(shard, max_file_bytes=1 << 62).items():
            shapes[key] = t.shape
    return shapes


def validate_lora_dir(directory: Path, base_shapes: dict[str, tuple[int, ...]]) -> LoraSummary:
    """Check a flat PEFT LoRA directory against the base model's weight shapes."""
    cfg = read_adapter_config(directory / CONFIG_FILE)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise InvalidAdapter(f"{WEIGHTS_FILE} is missing", hint="Save with safetensors (the PEFT default).")
    tensors = read_safetensors_header(weights)
    if not tensors:
        raise InvalidAdapter(f"{WEIGHTS_FILE} holds no tensors")
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, t in tensors.items():
        m = _LORA_KEY.fullmatch(key)
        if m is None:
            raise InvalidAdapter(
                f"{WEIGHTS_FILE}: unexpected tensor {key!r}",
                hint="Only LoRA A/B matrices (base_model.model.<module>.lora_A/B.weight) are accepted.",
            )
        if len(t.shape) != 2:
            raise InvalidAdapter(f"{WEIGHTS_FILE}: tensor {key!r} is not a matrix")
        pairs.setdefault(m["module"], {})[m["ab"]] = t.shape
    rank_pattern = cfg.get("rank_pattern") or {}
    modules: dict[str, tuple[int, int, int]] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise InvalidAdapter(f"{WEIGHTS_FILE}: module {module} lacks its lora_A or lora_B matrix")
        (r_a, fan_in), (fan_out, r_b) = ab["A"], ab["B"]
        if r_a != r_b or (not rank_pattern and r_a != cfg["r"]):
            raise InvalidAdapter(f"{WEIGHTS_FILE}: module {module} has rank {r_a}/{r_b}, config r={cfg['r']}")
        if not _targeted(module, cfg["target_modules"]):
            raise InvalidAdapter(f"{WEIGHTS_FILE}: module {module} is not covered by target_modules")
        base = base_shapes.get(module + ".weight")
        if base is None:
            raise InvalidAdapter(
                f"module {module} does not exist in the base model",
                hint="The adapter was trained for a different architecture; use the matching base model.",
            )
        if tuple(base) != (fan_out, fan_in):
            raise InvalidAdapter(
                f"module {module}: LoRA maps {fan_in}->{fan_out} but the base weight is {list(base)}",
                hint="The adapter was trained for a different base model.",
            )
        modules[module] = (r_a, fan_in, fan_out)
    check_finite(weights, tensors)
    return LoraSummary(config=cfg, modules=modules)

