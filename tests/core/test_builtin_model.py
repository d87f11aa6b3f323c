"""The built-in model ships its trained tokenizer and weights: every CPU builds the same bytes."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.runtime import builtin
from kiln.runtime.builtin import SHIPPED, BuiltinModelError, build_builtin_model, ensure_builtin_model

# Builds the model into argv[1], then prints the ATen path it ran on, each file's SHA-256 and the
# greedy answer to the README's example question.
BUILD_AND_ASK = """
import hashlib, json, sys
from pathlib import Path
import torch
from kiln.runtime.builtin import build_builtin_model
from kiln.runtime.loader import load_model
out = build_builtin_model(Path(sys.argv[1]))
loaded = load_model(out, device="cpu", dtype="float32")
tok = loaded.tokenizer
enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                              add_generation_prompt=True, return_tensors="pt", return_dict=True)
ids = loaded.model.generate(**enc, max_new_tokens=24, do_sample=False)[0, enc["input_ids"].shape[1]:]
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                  "files": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.iterdir())},
                  "answer": tok.decode(ids, skip_special_tokens=True)}))
"""


def _build_and_ask(out: Path, capability: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    run = subprocess.run([sys.executable, "-c", BUILD_AND_ASK, str(out)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_cpu_path_builds_the_same_bytes_and_answers(builtin_model_dir: Path, tmp_path: Path) -> None:
    native = _build_and_ask(tmp_path / "native", None)
    default = _build_and_ask(tmp_path / "default", "default")
    assert default["capability"] == "DEFAULT"
    assert native["files"] == default["files"]
    assert native["files"] == {f.name: _sha256(f) for f in sorted(builtin_model_dir.iterdir())}
    for name, digest in SHIPPED.items():
        assert native["files"][name] == digest
    # The README's example: the same greedy answer on the vectorized and the default kernels.
    assert native["answer"] == default["answer"]
    assert "Paris" in native["answer"]


def test_shipped_files_that_do_not_match_their_digest_are_refused(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(builtin.SHIPPED, "model.safetensors", "0" * 64)
    with pytest.raises(BuiltinModelError) as err:
        build_builtin_model(tmp_path / "m")
    assert err.value.code == "builtin_model_mismatch" and "reinstall" in err.value.hint
    assert list(tmp_path.iterdir()) == []  # nothing half-built is left behind


def test_ensure_checks_an_existing_builtin_model(builtin_model_dir: Path, tmp_path: Path) -> None:
    target = builtin.builtin_model_dir(tmp_path / "home")
    shutil.copytree(builtin_model_dir, target)
    assert ensure_builtin_model(tmp_path / "home") == target
    # A model an earlier Kiln trained on this CPU: other weights under the same name.
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(BuiltinModelError) as err:
        builtin.verify_builtin_model(target)
    assert "kiln model init --force" in err.value.hint
    # kiln serve after an upgrade: the stale copy is set aside and the shipped model built in its place
    assert ensure_builtin_model(tmp_path / "home") == target
    assert {name: _sha256(target / name) for name in SHIPPED} == SHIPPED
    assert (target.with_name(target.name + ".stale") / "model.safetensors").read_bytes() == bytes(data)


def test_ensure_builds_when_missing(tmp_path: Path) -> None:
    path = ensure_builtin_model(tmp_path / "home")
    assert {name: _sha256(path / name) for name in SHIPPED} == SHIPPED


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the shipped weights were trained on x86-64")
def test_recipe_reproduces_the_shipped_files(tmp_path: Path) -> None:
    """The training recipe, run on ATen's default kernels, gives back exactly the shipped bytes."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    run = subprocess.run([sys.executable, "-m", "kiln.runtime.builtin_train", str(tmp_path / "m")], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    for name, digest in SHIPPED.items():
        assert _sha256(tmp_path / "m" / name) == digest, name
