"""Validation of PEFT LoRA files against a base model, without loading either model.

Shapes come from safetensors headers (parsed here with the standard library);
finiteness is checked on the raw bit patterns with numpy, so publication needs
neither torch nor transformers and stays fast in a fresh process.

Patterns from adapter configs (``target_modules`` as a string, ``exclude_modules``,
``rank_pattern``/``alpha_pattern`` keys) are never run on a backtracking engine:
lists follow PEFT's rule (exact module name, or a suffix after a ``.``), and
string patterns run on RE2 (linear time) under a size limit. Validation has a
deadline, and :func:`normalize_adapter_config` rewrites the stored config so
that PEFT, which evaluates those fields with Python's ``re`` when it loads the
adapter, only ever sees exact, escaped module names.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kiln.adapters.errors import AdapterUnavailable, InvalidAdapter
from kiln.adapters.manifest import MAX_LORA_RANK, read_store_file, shorten
from kiln.canonical import CanonicalJSONError, NotRegularFileError, open_regular, strict_json_loads

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_ADAPTER_CONFIG_BYTES = 1024 * 1024
MAX_SAFETENSORS_HEADER_BYTES = 32 * 1024 * 1024
MAX_ADAPTER_WEIGHTS_BYTES = 32 * 1024**3
MAX_PATTERN_CHARS = 1024  # one target_modules / exclude_modules / rank_pattern pattern
MAX_PATTERN_ENTRIES = 256  # list entries or pattern keys per field
RE2_MAX_MEM = 8 << 20  # compiled-program memory per pattern
VALIDATION_DEADLINE_S = 60.0
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
    try:
        fd = open_regular(path)  # a FIFO or device in its place is refused before anything blocks
    except NotRegularFileError:
        raise InvalidAdapter(f"{path.name} is not a regular file") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > max_file_bytes:
            raise InvalidAdapter(f"{path.name} is {size} bytes; the limit is {max_file_bytes}")
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
            raise InvalidAdapter(f"{path.name}: malformed header entry for {shorten(key)}") from exc
        if dtype not in _DTYPE_BYTES or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise InvalidAdapter(f"{path.name}: tensor {shorten(key)} has unsupported dtype {dtype!r} or bad shape")
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
            raise InvalidAdapter(f"{path.name}: tensor {shorten(key)} has bad data offsets")
        if hi - lo != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise InvalidAdapter(f"{path.name}: tensor {shorten(key)} byte length does not match its shape")
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
                raise InvalidAdapter(f"{path.name}: LoRA tensor {shorten(key)} has non-float dtype {t.dtype}")
            if t.end == t.start:
                continue
            view_dtype, mask = _FLOAT_BITS[t.dtype]
            bits: Any = data[t.start:t.end].view(view_dtype)
            bad = np.count_nonzero((bits & mask) == mask)
            if bad:
                raise InvalidAdapter(
                    f"{path.name}: tensor {shorten(key)} has {bad} non-finite values (NaN/Inf)",
                    hint="Training diverged; lower the learning rate or check the data, then train again.",
                )
    finally:
        del data


def read_adapter_config(path: Path) -> dict[str, Any]:
    try:
        cfg = strict_json_loads(read_store_file(path, limit=MAX_ADAPTER_CONFIG_BYTES, error=InvalidAdapter))
    except (FileNotFoundError, NotADirectoryError):
        raise InvalidAdapter(f"{path.name} is missing") from None
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
    if not isinstance(tm, str):
        _name_list(tm, "target_modules")
    return cfg


def compile_pattern(pattern: object, field: str) -> Any:
    """Compile an uploaded pattern with RE2 (linear-time matching); malformed or too large -> 400."""
    if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_CHARS:
        raise InvalidAdapter(f"{CONFIG_FILE}: {field} pattern must be a string of 1-{MAX_PATTERN_CHARS} characters",
                             param=field)
    import re2

    options = re2.Options()
    options.max_mem = RE2_MAX_MEM
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        raise InvalidAdapter(
            f"{CONFIG_FILE}: {field} {shorten(pattern)} is not a valid pattern: {shorten(str(exc), 120)}",
            hint="Use a plain regular expression (RE2 syntax: no backreferences or lookaround), or list the "
            "module names.",
            param=field,
        ) from exc


def _name_list(value: object, field: str) -> list[str]:
    if not (isinstance(value, list) and value and len(value) <= MAX_PATTERN_ENTRIES
            and all(isinstance(m, str) and 0 < len(m) <= MAX_PATTERN_CHARS for m in value)):
        raise InvalidAdapter(f"{CONFIG_FILE}: {field} must be a pattern string or a list of 1-{MAX_PATTERN_ENTRIES} "
                             "module names", param=field)
    return value


def module_matcher(spec: object, field: str) -> Callable[[str], bool]:
    """PEFT's module selection without a backtracking regex.

    A list selects a module whose name equals an entry or ends with ``.<entry>``;
    a string is a pattern that must match the whole module name (run on RE2).
    """
    if isinstance(spec, str):
        compiled = compile_pattern(spec, field)
        return lambda module: compiled.fullmatch(module) is not None
    names = frozenset(_name_list(spec, field))
    return lambda module: module in names or any(module.endswith("." + n) for n in names)


def _pattern_values(spec: object, field: str, modules: list[str], default: Any) -> dict[str, Any]:
    r"""Resolve PEFT's ``rank_pattern``/``alpha_pattern`` (first key ``k`` with ``(.*\.)?(k)$`` matching wins)."""
    if not spec:
        return {m: default for m in modules}
    if not isinstance(spec, dict) or len(spec) > MAX_PATTERN_ENTRIES:
        raise InvalidAdapter(f"{CONFIG_FILE}: {field} must be an object of at most {MAX_PATTERN_ENTRIES} entries",
                             param=field)
    compiled = []
    for key, value in spec.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise InvalidAdapter(f"{CONFIG_FILE}: {field} values must be positive numbers", param=field)
        compile_pattern(key, field)  # reports bad syntax against the key itself
        compiled.append((compile_pattern(rf"(?:.*\.)?(?:{key})", field), value))
    return {m: next((v for c, v in compiled if c.fullmatch(m) is not None), default) for m in modules}


def normalize_adapter_config(cfg: dict[str, Any], modules: dict[str, tuple[int, int, int]],
                             base_model_id: str) -> dict[str, Any] | None:
    """The config to store instead of ``cfg``, or None when it needs no change.

    * ``base_model_name_or_path`` holding a filesystem path (which would leak the
      publisher's home directory and change the revision with it) becomes
      ``base_model_id``; Hub-style IDs (``org/name``) are kept.
    * Pattern fields PEFT evaluates with Python's ``re`` at load time become exact:
      a string ``target_modules`` (or any ``exclude_modules``/``layers_pattern``/
      ``layers_to_transform``) becomes the sorted list of adapted module names, and
      ``rank_pattern``/``alpha_pattern`` keys become escaped module names.
    """
    out = dict(cfg)
    ref = cfg.get("base_model_name_or_path")
    if isinstance(ref, str) and _looks_like_path(ref):
        out["base_model_name_or_path"] = base_model_id
    if isinstance(cfg["target_modules"], str) or any(
        cfg.get(k) not in (None, [], "") for k in ("exclude_modules", "layers_pattern", "layers_to_transform")
    ):
        out["target_modules"] = sorted(modules)
        for k in ("exclude_modules", "layers_pattern", "layers_to_transform"):
            if k in out:
                out[k] = None
    if cfg.get("rank_pattern"):
        out["rank_pattern"] = {re.escape(m): rank for m, (rank, _i, _o) in sorted(modules.items()) if rank != cfg["r"]}
    if cfg.get("alpha_pattern"):
        alphas = _pattern_values(cfg["alpha_pattern"], "alpha_pattern", sorted(modules), cfg["lora_alpha"])
        out["alpha_pattern"] = {re.escape(m): a for m, a in alphas.items() if a != cfg["lora_alpha"]}
    return None if out == cfg else out


def _looks_like_path(ref: str) -> bool:
    return ref.startswith(("/", "~", ".")) or "\\" in ref or ref.count("/") > 1 or (len(ref) > 1 and ref[1] == ":")


def write_adapter_config(path: Path, cfg: dict[str, Any]) -> None:
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def base_weight_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` over every safetensors shard of a base model directory."""
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        for key, t in read_safetensors_header(shard, max_file_bytes=1 << 62).items():
            shapes[key] = t.shape
    return shapes


def validate_lora_dir(directory: Path, base_shapes: dict[str, tuple[int, ...]], *,
                      deadline_s: float = VALIDATION_DEADLINE_S) -> LoraSummary:
    """Check a flat PEFT LoRA directory against the base model's weight shapes (within ``deadline_s``)."""
    deadline = time.monotonic() + deadline_s

    def in_time() -> None:
        if time.monotonic() > deadline:
            raise AdapterUnavailable(f"adapter validation took longer than {deadline_s:g} s", retry_after=30)

    cfg = read_adapter_config(directory / CONFIG_FILE)
    targeted = module_matcher(cfg["target_modules"], "target_modules")
    excluded = module_matcher(cfg["exclude_modules"], "exclude_modules") if cfg.get("exclude_modules") else None
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
                f"{WEIGHTS_FILE}: unexpected tensor {shorten(key)}",
                hint="Only LoRA A/B matrices (base_model.model.<module>.lora_A/B.weight) are accepted.",
            )
        if len(t.shape) != 2:
            raise InvalidAdapter(f"{WEIGHTS_FILE}: tensor {shorten(key)} is not a matrix")
        pairs.setdefault(m["module"], {})[m["ab"]] = t.shape
    in_time()
    ranks = _pattern_values(cfg.get("rank_pattern"), "rank_pattern", sorted(pairs), cfg["r"])
    _pattern_values(cfg.get("alpha_pattern"), "alpha_pattern", [], cfg["lora_alpha"])  # shape and syntax
    modules: dict[str, tuple[int, int, int]] = {}
    for module, ab in sorted(pairs.items()):
        in_time()
        if set(ab) != {"A", "B"}:
            raise InvalidAdapter(f"{WEIGHTS_FILE}: module {module} lacks its lora_A or lora_B matrix")
        (r_a, fan_in), (fan_out, r_b) = ab["A"], ab["B"]
        if r_a != r_b or r_a != ranks[module] or not 1 <= r_a <= MAX_LORA_RANK:
            raise InvalidAdapter(f"{WEIGHTS_FILE}: module {module} has rank {r_a}/{r_b}, config says r={ranks[module]}")
        if not targeted(module) or (excluded is not None and excluded(module)):
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
    in_time()
    check_finite(weights, tensors)
    in_time()
    return LoraSummary(config=cfg, modules=modules)

