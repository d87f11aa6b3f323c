"""Model directory verification and loading.

Kiln loads only local, fully materialized Hugging Face directories with
safetensors weights. ``inspect_model_dir`` checks a directory without importing
torch and computes ``base_model_sha256`` (see :func:`kiln.canonical.base_model_digest`);
``load_model`` then loads tokenizer and weights with transformers.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.canonical import base_model_digest, sha256_file
from kiln.errors import InvalidRequest

MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_TREE_FILES = 100_000
MAX_TREE_DEPTH = 32


class ModelLoadError(InvalidRequest, ValueError):
    """A model directory cannot be served; the message says what to do."""


class QuantizationRefused(ModelLoadError):
    """``model.quantize`` measured a probe KL above ``model.quantize_max_kl`` (kiln.runtime.quantize)."""


@dataclass(frozen=True)
class ModelDirInfo:
    path: Path
    config: dict[str, Any]
    safetensors: tuple[tuple[str, int, str], ...]  # (relative name, bytes, sha256)
    base_model_sha256: str

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "unknown"))

    @property
    def max_position_embeddings(self) -> int | None:
        """The longest sequence the model supports, from ``config.json`` (None when it does not say)."""
        text = self.config.get("text_config")
        cfg = text if isinstance(text, dict) else self.config
        value = cfg.get("max_position_embeddings")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def effective_max_model_len(self, configured: int) -> int:
        """``min(configured, max_position_embeddings)``: serving and training never go past the model."""
        limit = self.max_position_embeddings
        return configured if limit is None else min(configured, limit)


@dataclass
class LoadedModel:
    """A model ready for the engine: weights on ``device`` in ``dtype``."""

    model: Any
    tokenizer: Any
    info: ModelDirInfo
    model_id: str
    device: str
    dtype: str
    extra: dict[str, Any] = field(default_factory=dict)
    family: Any = None  # kiln.runtime.model_family.ModelFamily (None for models not loaded by load_model)
    quantization: Any = None  # kiln.runtime.quantize.QuantizationReport once model.quantize ran (None: not run)
    linear_kernels: Any = None  # a hybrid's kiln.runtime.linear_kernels.LinearKernels (None: no Gated DeltaNet layer)

    @property
    def base_model_sha256(self) -> str:
        return self.info.base_model_sha256

    @property
    def path(self) -> Path:
        return self.info.path

    @property
    def max_model_len(self) -> int | None:
        """The model's own sequence limit (``max_position_embeddings``), if its config gives one."""
        return self.info.max_position_embeddings


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def inspect_model_dir(spec: str | os.PathLike[str]) -> ModelDirInfo:
    """Verify a model directory and compute its identity. Imports no torch."""
    raw = os.fspath(spec)
    path = Path(raw).expanduser()
    if not path.exists():
        if _looks_like_hub_id(raw):
            raise ModelLoadError(
                f"{raw!r} looks like a Hugging Face Hub ID; Kiln never downloads at run time. "
                f"Download it first (e.g. `hf download {raw} --local-dir ./models/{raw.split('/')[1]}`) "
                "and pass that directory."
            )
        raise ModelLoadError(f"model directory {raw!r} does not exist")
    if path.is_symlink():
        raise ModelLoadError(f"{path} is a symlink; pass the real, fully materialized directory")
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a directory; pass a local Hugging Face model directory")
    path = path.resolve()

    count = 0
    for dirpath, dirnames, filenames in os.walk(path):
        rel_depth = len(Path(dirpath).relative_to(path).parts)
        if rel_depth > MAX_TREE_DEPTH:
            raise ModelLoadError(f"{dirpath}: directory tree deeper than {MAX_TREE_DEPTH} levels")
        for name in dirnames + filenames:
            count += 1
            if count > MAX_TREE_FILES:
                raise ModelLoadError(f"{path}: more than {MAX_TREE_FILES} entries")
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                raise ModelLoadError(
                    f"{full} is a symlink; Kiln serves only fully materialized directories "
                    "(for a Hugging Face cache checkout, copy it with `cp -rL` or download with --local-dir)"
                )
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                raise ModelLoadError(f"{full} is not a regular file or directory")

    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path} has no config.json; it is not a Hugging Face model directory")
    if cfg_path.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelLoadError(f"{cfg_path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(cfg_path.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{cfg_path} must hold a JSON object")
    if "auto_map" in config or config.get("trust_remote_code"):
        raise ModelLoadError(
            f"{path} needs custom code (auto_map / trust_remote_code); Kiln does not execute model "
            "code from checkpoints. Use an architecture that transformers implements natively."
        )

    shards = sorted(p for p in path.iterdir() if p.suffix == ".safetensors" and p.is_file())
    if not shards:
        bins = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        hint = (
            f" It only has pickle weights ({', '.join(sorted(bins))}); convert them to safetensors "
            "(e.g. `model.save_pretrained(dir, safe_serialization=True)`) in a trusted environment."
            if bins
            else ""
        )
        raise ModelLoadError(f"{path} has no *.safetensors weights.{hint}")
    records = []
    for shard in shards:
        digest, size = sha256_file(shard)
        records.append((shard.name, size, digest))
    base = base_model_digest((d, n) for _name, n, d in records)
    return ModelDirInfo(path=path, config=config, safetensors=tuple(records), base_model_sha256=base)


def resolve_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available; use device = 'cpu'")
    if device != "cpu" and not device.startswith("cuda"):
        raise ModelLoadError(f"unsupported device {device!r}; use auto, cpu, cuda or cuda:N")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return dtype


def load_model(
    spec: str | os.PathLike[str],
    *,
    device: str = "auto",
    dtype: str = "auto",
    model_id: str | None = None,
    info: ModelDirInfo | None = None,
    linear_kernels: str | None = None,
) -> LoadedModel:
    """Verify then load a model directory with transformers (safetensors only). A multimodal
    checkpoint whose language model transformers can load alone (Qwen3.5's) loads as that; a model
    the engine cannot run is refused here, naming its architecture (kiln.runtime.model_family). A
    hybrid's Gated DeltaNet functions get their implementation for its device here
    (kiln.runtime.linear_kernels; ``linear_kernels``: ``model.linear_kernels``, None keeps the
    process's choice)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.runtime.linear_kernels import resolve
    from kiln.runtime.model_family import describe

    info = info or inspect_model_dir(spec)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        tokenizer = AutoTokenizer.from_pretrained(info.path, trust_remote_code=False, local_files_only=True)
    except Exception as exc:  # transformers raises many types here
        raise ModelLoadError(f"cannot load the tokenizer from {info.path}: {exc}") from exc
    if getattr(tokenizer, "chat_template", None) is None:
        raise ModelLoadError(f"{info.path} has no chat template; add chat_template.jinja or use a chat model")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            info.path,
            trust_remote_code=False,
            local_files_only=True,
            use_safetensors=True,
            dtype=getattr(torch, dt),
        )
    except Exception as exc:
        archs = info.config.get("architectures") or [info.model_type]
        raise ModelLoadError(f"cannot load {info.path} (architecture {archs[0]}) as a causal language model: "
                             f"{exc}") from exc
    family = describe(model, info.config)
    model.to(dev)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        info=info,
        model_id=model_id or info.path.name,
        device=dev,
        dtype=dt,
        family=family,
        linear_kernels=resolve(model, dev, linear_kernels),
    )
