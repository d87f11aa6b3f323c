"""Shared fixtures.

``builtin_model_dir`` builds Kiln's built-in model once and caches it, keyed by
the builder's source, under ``$KILN_TEST_CACHE`` (default: the system temp dir),
so every test session and every helper process reuses the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _builder_key() -> str:
    """The builder's source and the floating-point path it trains on: the built-in model is byte-identical
    on rebuild for one CPU code path (torch version and ATen capability: AVX2, AVX-512, default), and a
    different path trains to slightly different weights, so each path gets its own cached build."""
    import torch

    h = hashlib.sha256()
    for rel in ("src/kiln/runtime/builtin.py", "src/kiln/runtime/corpus/builtin.txt"):
        h.update((ROOT / rel).read_bytes())
    h.update(f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}".encode())
    return h.hexdigest()[:16]


def built_model_path() -> Path:
    """Build (or reuse) the built-in model for tests; safe under concurrent sessions."""
    from kiln.runtime.builtin import build_builtin_model

    cache = Path(os.environ.get("KILN_TEST_CACHE") or Path(tempfile.gettempdir()) / "kiln-test-cache")
    target = cache / f"builtin-{_builder_key()}"
    if not (target / "config.json").is_file():
        try:
            build_builtin_model(target)
        except FileExistsError:
            pass  # another session published it first
    return target


@pytest.fixture(scope="session")
def builtin_model_dir() -> Path:
    return built_model_path()


_OPT_IN = {"slow": "KILN_SLOW", "vllm": "KILN_VLLM"}


def pytest_collection_modifyitems(config, items) -> None:
    """Opt-in lanes: ``slow`` runs with KILN_SLOW=1, ``vllm`` with KILN_VLLM=1."""
    for item in items:
        for marker, env in _OPT_IN.items():
            if marker in item.keywords and os.environ.get(env) != "1":
                item.add_marker(pytest.mark.skip(reason=f"opt-in lane: set {env}=1 to run"))


def default_device() -> str:
    """The device ``device = "auto"`` resolves to on this machine (tests follow it, never assume CPU)."""
    from kiln.runtime.loader import resolve_device

    return resolve_device("auto")
