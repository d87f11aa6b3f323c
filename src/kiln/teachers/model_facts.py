"""Model, tokenizer and adapter facts of a (staged or source) tree, from its manifest.

File digests come from the snapshot manifest (already hashed under the shared
read limiter); small JSON files are re-read with a size bound through the same
limiter. The tokenizer is fingerprinted with Transformers, imported lazily, from
the same tree; the bytes it may read (every top-level file except the weights)
are charged to the limiter too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.canonical import base_model_digest, sha256_hex
from kiln.teachers.identity import (
    TeacherIdentityError,
    adapter_max_rank,
    adapter_weights_digest,
    model_vocab_width,
    parse_json_object,
    tokenizer_config_digest,
    tokenizer_vocab_digest,
)
from kiln.system.provenance_io import ReadLimiter, read_small_file
from kiln.system.snapshot import Manifest

MAX_JSON_CONFIG_BYTES = 4 << 20
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
REMOTE_CODE_KEYS = ("auto_map",)
JSON_READ_HERE = ("config.json", "tokenizer_config.json")  # charged when read, not again for the tokenizer


def read_json_bounded(path: Path, limiter: ReadLimiter, expected_sha256: str) -> dict[str, Any]:
    """A small JSON object whose bytes must still hash to its manifest digest."""
    data = read_small_file(path, MAX_JSON_CONFIG_BYTES, limiter, "config file")
    if sha256_hex(data) != expected_sha256:
        raise TeacherIdentityError(f"{path} changed after it was hashed into the snapshot manifest")
    return parse_json_object(data, path)


def _refuse_remote_code(obj: dict[str, Any], where: Path) -> None:
    for key in REMOTE_CODE_KEYS:
        if key in obj:
            raise TeacherIdentityError(f"{where} declares {key!r} (remote code); trust_remote_code models are refused")


@dataclass(frozen=True)
class ModelFacts:
    base_model_sha256: str
    model_config_sha256: str
    vocab_size: int
    tokenizer_vocab_sha256: str
    tokenizer_config_sha256: str


def model_facts(model_dir: Path, manifest: Manifest, limiter: ReadLimiter, prefix: str = "model") -> ModelFacts:
    """Facts of the model tree whose manifest paths start with ``prefix/``."""
    top = {p[len(prefix) + 1 :]: (s, d) for p, s, d in manifest.files if p.startswith(prefix + "/") and p.count("/") == 1}
    if "config.json" not in top:
        raise TeacherIdentityError(f"{model_dir} has no config.json; pass a Hugging Face model directory")
    shards = [(d, s) for name, (s, d) in top.items() if name.endswith(".safetensors")]
    if not shards:
        raise TeacherIdentityError(f"{model_dir} has no *.safetensors base weights; the launcher loads safetensors only")
    config = read_json_bounded(model_dir / "config.json", limiter, top["config.json"][1])
    _refuse_remote_code(config, model_dir / "config.json")
    if "tokenizer_config.json" in top:
        tok_config = read_json_bounded(model_dir / "tokenizer_config.json", limiter, top["tokenizer_config.json"][1])
        _refuse_remote_code(tok_config, model_dir / "tokenizer_config.json")
    width = model_vocab_width(config)
    vocab_sha, config_sha = tokenizer_digests(model_dir, width)
    limiter.consume(
        sum(size for name, (size, _d) in top.items() if name not in JSON_READ_HERE and not name.endswith(".safetensors"))
    )
    return ModelFacts(
        base_model_sha256=base_model_digest(shards),
        model_config_sha256=top["config.json"][1],
        vocab_size=width,
        tokenizer_vocab_sha256=vocab_sha,
        tokenizer_config_sha256=config_sha,
    )


def tokenizer_digests(model_dir: Path, model_width: int) -> tuple[str, str]:
    """(tokenizer_vocab_sha256, tokenizer_config_sha256) of the directory's fast tokenizer."""
    from transformers import AutoTokenizer  # lazy: only a real launch fingerprints a tokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many types for unusable tokenizers
        raise TeacherIdentityError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise TeacherIdentityError(f"{model_dir} has no fast (tokenizer.json) tokenizer; the identity needs one")
    vocab_sha = tokenizer_vocab_digest(
        tok.get_vocab(), reported_size=backend.get_vocab_size(with_added_tokens=True), model_width=model_width
    )
    return vocab_sha, tokenizer_config_digest(backend.to_str())


@dataclass(frozen=True)
class AdapterFacts:
    weights_file: str
    weights_sha256: str
    config_sha256: str
    max_rank: int

    def identity_object(self) -> dict[str, str]:
        return {"weights_sha256": self.weights_sha256, "config_sha256": self.config_sha256}


def check_adapter_layout(adapter_dir: Path) -> str:
    """The single weight file of a PEFT adapter directory (refuses none or both)."""
    present = [n for n in ADAPTER_WEIGHT_FILES if os.path.lexists(adapter_dir / n)]
    if not os.path.lexists(adapter_dir / ADAPTER_CONFIG):
        raise TeacherIdentityError(f"{adapter_dir} has no {ADAPTER_CONFIG}; pass a PEFT adapter directory")
    if len(present) != 1:
        raise TeacherIdentityError(
            f"{adapter_dir} must hold exactly one of {', '.join(ADAPTER_WEIGHT_FILES)} (found {present or 'none'}); "
            "remove the ambiguous one (prefer safetensors)"
        )
    return present[0]


def adapter_facts(adapter_dir: Path, manifest: Manifest, limiter: ReadLimiter, prefix: str = "adapter") -> AdapterFacts:
    weights = check_adapter_layout(adapter_dir)
    files = {p: (s, d) for p, s, d in manifest.files}
    size, digest = files[f"{prefix}/{weights}"]
    config = read_json_bounded(adapter_dir / ADAPTER_CONFIG, limiter, files[f"{prefix}/{ADAPTER_CONFIG}"][1])
    _refuse_remote_code(config, adapter_dir / ADAPTER_CONFIG)
    return AdapterFacts(
        weights_file=weights,
        weights_sha256=adapter_weights_digest(weights, size, digest),
        config_sha256=files[f"{prefix}/{ADAPTER_CONFIG}"][1],
        max_rank=adapter_max_rank(config),
    )
