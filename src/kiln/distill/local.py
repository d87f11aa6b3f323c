"""Fingerprints of local checkpoints and tokenizers, and their checks against a plan.

A local Kiln checkpoint has no hub commit, so its immutable ``revision`` is the
loader's ``base_model_sha256`` (a 64-hex digest over its safetensors shards);
``config_sha256`` is SHA-256 of the exact ``config.json`` bytes; weight files
are every ``*.safetensors`` file with size and SHA-256. A tokenizer's revision
is the canonical hash of its file list. No torch import here: hashing only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from kiln.canonical import canonical_json_bytes, canonical_sha256, sha256_file, sha256_hex
from kiln.distill.contract import ModelFingerprint, Plan, TokenizerFingerprint
from kiln.distill.errors import ContractError

__all__ = [
    "TOKENIZER_FILES",
    "RENDERER_NAME",
    "model_fingerprint",
    "tokenizer_fingerprint",
    "check_model_dir",
    "check_tokenizer_dir",
    "quantization_identity",
    "chat_template_sha256",
    "check_renderer",
    "checkpoint_float_dtypes",
    "check_observed_dtypes",
]

# Tokenizer files bound by default when present (sorted).
TOKENIZER_FILES = ("chat_template.jinja", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")
RENDERER_NAME = "transformers"


def _file_digests(root: Path, names: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for name in sorted(names):
        digest, size = sha256_file(root / name)
        out.append({"path": name, "size": size, "sha256": digest})
    return out


def model_fingerprint(path: str | os.PathLike[str], model_id: str | None = None) -> ModelFingerprint:
    """The plan's ``teacher``/``student`` object for a local checkpoint (loader rules apply)."""
    from kiln.runtime.loader import inspect_model_dir

    info = inspect_model_dir(path)
    return ModelFingerprint.parse(
        {
            "model_id": model_id or f"local/{info.path.name}",
            "revision": info.base_model_sha256,
            "config_sha256": sha256_hex((info.path / "config.json").read_bytes()),
            "weight_files": [{"path": n, "size": s, "sha256": d} for n, s, d in info.safetensors],
        }
    )


def chat_template_sha256(template: str | None) -> str:
    return sha256_hex((template or "").encode("utf-8"))


def _chat_template_from_files(root: Path) -> str | None:
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text("utf-8")
    cfg = root / "tokenizer_config.json"
    if cfg.is_file():
        import json

        value = json.loads(cfg.read_text("utf-8")).get("chat_template")
        return value if isinstance(value, str) else None
    return None


def tokenizer_fingerprint(
    path: str | os.PathLike[str],
    *,
    vocab_size: int,
    tokenizer_id: str | None = None,
    renderer_version: str,
    files: Sequence[str] | None = None,
) -> TokenizerFingerprint:
    """The plan's shared ``tokenizer`` object from the tokenizer files in ``path``.

    ``vocab_size`` is the width of the model's output distribution (config
    ``vocab_size``), which is what a capture row's IDs index.
    """
    root = Path(path)
    names = list(files) if files is not None else [n for n in TOKENIZER_FILES if (root / n).is_file()]
    digests = _file_digests(root, names)
    return TokenizerFingerprint.parse(
        {
            "tokenizer_id": tokenizer_id or f"local/{root.name}-tokenizer",
            "revision": canonical_sha256(digests),
            "vocab_size": vocab_size,
            "files": digests,
            "chat_template_sha256": chat_template_sha256(_chat_template_from_files(root)),
            "renderer_name": RENDERER_NAME,
            "renderer_version": renderer_version,
        }
    )


def check_model_dir(expected: ModelFingerprint, path: str | os.PathLike[str], role: str) -> None:
    """Refuse unless ``path`` holds exactly the plan's config and weight files (and revision)."""
    found = model_fingerprint(path, expected.model_id)
    problems = [
        name
        for name, ok in (
            ("revision", found.revision == expected.revision),
            ("config_sha256", found.config_sha256 == expected.config_sha256),
            ("weight_files", found.weight_files == expected.weight_files),
        )
        if not ok
    ]
    if problems:
        raise ContractError(
            f"{role} checkpoint {path} differs from the plan's {role} in {', '.join(problems)}; "
            "a changed model is a new run: make a new plan"
        )


def check_tokenizer_dir(expected: TokenizerFingerprint, path: str | os.PathLike[str], role: str) -> None:
    """Refuse unless every tokenizer file the plan binds is byte-identical under ``path``."""
    root = Path(path)
    missing = [f.path for f in expected.files if not (root / f.path).is_file()]
    if missing:
        raise ContractError(f"{role} tokenizer at {root} lacks {missing}; v1 needs the plan's exact tokenizer")
    found = _file_digests(root, [f.path for f in expected.files])
    if found != [f.to_obj() for f in expected.files]:
        raise ContractError(
            f"{role} tokenizer files at {root} differ from the plan's tokenizer fingerprint; "
            "v1 requires one shared tokenizer (no cross-tokenizer ID matching)"
        )
    if chat_template_sha256(_chat_template_from_files(root)) != expected.chat_template_sha256:
        raise ContractError(f"{role} chat template at {root} differs from the plan's chat_template_sha256")


def quantization_identity(config: dict[str, Any]) -> str:
    """``none``, or ``config-sha256:<hash of the active quantization fields>`` (spec rule)."""
    active = {k: config[k] for k in ("quantization", "quantization_config") if config.get(k) is not None}
    if not active:
        return "none"
    return "config-sha256:" + sha256_hex(canonical_json_bytes(active))


def check_capture_settings(plan: Plan, *, backend: str, backend_version: str, quantization: str) -> None:
    cap = plan.capture
    problems = [
        f"{name}: plan {want!r}, found {got!r}"
        for name, want, got in (
            ("backend", cap.backend, backend),
            ("backend_version", cap.backend_version, backend_version),
            ("quantization", cap.quantization, quantization),
        )
        if want != got
    ]
    if problems:
        raise ContractError("capture settings differ from the plan: " + "; ".join(problems))


def check_renderer(plan: Plan, version: str) -> None:
    """The plan's tokenizer renderer must be the one this worker renders with: ``transformers`` at
    ``version`` (the installed distribution). The spec: renderer name and version "must match the
    plan before publication"."""
    tok = plan.tokenizer
    if (tok.renderer_name, tok.renderer_version) != (RENDERER_NAME, version):
        raise ContractError(
            f"the plan's tokenizer renderer is {tok.renderer_name}@{tok.renderer_version}, this worker renders "
            f"with {RENDERER_NAME}@{version}; a changed renderer is a new run: make a new plan"
        )


# safetensors dtype codes of floating tensors -> torch dtype names (integer codes are quantized storage)
_SAFETENSORS_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def checkpoint_float_dtypes(info) -> list[str]:
    """Floating dtypes of the tensors as stored in the checkpoint's safetensors files (headers only):
    what loading exposes before any cast to the plan's dtype."""
    from safetensors import safe_open

    found = set()
    for name, _size, _digest in info.safetensors:
        with safe_open(str(info.path / name), framework="pt") as f:
            for key in f.keys():
                code = f.get_slice(key).get_dtype()
                if code in _SAFETENSORS_FLOATS:
                    found.add(_SAFETENSORS_FLOATS[code])
                elif code.startswith("F"):
                    found.add(code.lower())  # an unknown float format: never the declared dtype
    return sorted(found)


def check_observed_dtypes(observed: list[str], declared: str, quantization: str) -> None:
    """The spec's rule: unquantized exposes exactly ``declared``; quantized exposes ``declared`` and may
    add float32 auxiliaries; any other floating dtype fails closed."""
    allowed = {declared} | ({"float32"} if quantization != "none" else set())
    if quantization == "none" and observed != [declared]:
        raise ContractError(f"teacher parameters are {observed}, the plan declares {declared!r}; an "
                            "unquantized checkpoint must expose exactly the declared dtype (no cast)")
    if not set(observed) <= allowed or declared not in observed:
        raise ContractError(f"teacher parameters are {observed}; undeclared dtype for {declared!r}")
