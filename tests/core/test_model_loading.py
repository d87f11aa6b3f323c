from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.canonical import base_model_digest, sha256_file
from kiln.runtime.loader import ModelLoadError, inspect_model_dir, load_model
from tests.conftest import default_device


def test_builtin_model_shape(builtin_model_dir: Path) -> None:
    cfg = json.loads((builtin_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["head_dim"] >= 32
    assert sorted(p.name for p in builtin_model_dir.glob("*.safetensors")) == ["model.safetensors"]
    assert not list(builtin_model_dir.glob("*.bin"))
    assert (builtin_model_dir / "chat_template.jinja").is_file()


def test_base_model_sha256_matches_independent_computation(builtin_model_dir: Path) -> None:
    info = inspect_model_dir(builtin_model_dir)
    digest, size = sha256_file(builtin_model_dir / "model.safetensors")
    assert info.base_model_sha256 == base_model_digest([(digest, size)])
    assert len(info.base_model_sha256) == 64


def test_builtin_model_generates_an_answer(builtin_model_dir: Path) -> None:
    loaded = load_model(builtin_model_dir)
    tok = loaded.tokenizer
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    out = loaded.model.generate(**enc, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0][enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text
    from kiln.runtime.loader import resolve_dtype

    assert loaded.device == default_device() and loaded.dtype == resolve_dtype("auto", loaded.device)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_refuses_hub_id() -> None:
    with pytest.raises(ModelLoadError, match="Hub ID"):
        inspect_model_dir("Qwen/Qwen3-0.6B")


def test_refuses_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        inspect_model_dir(tmp_path / "nope")


def test_refuses_symlinked_file(builtin_model_dir: Path, tmp_path: Path) -> None:
    d = _copy(builtin_model_dir, tmp_path / "m")
    (d / "config.json").rename(tmp_path / "real-config.json")
    os.symlink(tmp_path / "real-config.json", d / "config.json")
    with pytest.raises(ModelLoadError, match="symlink"):
        inspect_model_dir(d)


def test_refuses_symlinked_root(builtin_model_dir: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    os.symlink(builtin_model_dir, link)
    with pytest.raises(ModelLoadError, match="symlink"):
        inspect_model_dir(link)


def test_refuses_bin_only(builtin_model_dir: Path, tmp_path: Path) -> None:
    d = _copy(builtin_model_dir, tmp_path / "m")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin"):
        inspect_model_dir(d)


def test_refuses_remote_code(builtin_model_dir: Path, tmp_path: Path) -> None:
    d = _copy(builtin_model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Evil"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="trust_remote_code"):
        inspect_model_dir(d)


def test_refuses_special_file(builtin_model_dir: Path, tmp_path: Path) -> None:
    d = _copy(builtin_model_dir, tmp_path / "m")
    os.mkfifo(d / "pipe")
    with pytest.raises(ModelLoadError, match="not a regular file"):
        inspect_model_dir(d)


def test_weight_change_changes_identity(builtin_model_dir: Path, tmp_path: Path) -> None:
    d = _copy(builtin_model_dir, tmp_path / "m")
    before = inspect_model_dir(d).base_model_sha256
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert inspect_model_dir(d).base_model_sha256 != before


def test_cuda_request_without_cuda_is_refused(builtin_model_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        load_model(builtin_model_dir, device="cuda")
