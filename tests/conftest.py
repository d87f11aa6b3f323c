"""Shared fixtures.

``builtin_model_dir`` builds Kiln's built-in model (from the weights that ship in
the package) once and caches it, keyed by the builder's source, under
``$KILN_TEST_CACHE`` (default: the system temp dir), so every test session, every
xdist worker and every helper process reuses the same directory.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The training worker's start-up warm-up (training.warm_up, kiln.training.core.warmup) builds the anchor and the
# probe set in the background of every server: off for the lane's servers (each would pay it), on in the tests
# that check it.
os.environ.setdefault("KILN_TRAINING_WARM_UP", "0")


def _builder_key() -> str:
    """The builder's source (which pins the shipped files' SHA-256) and the transformers version (which
    writes the config files): the built-in model is the same bytes on every CPU."""
    from importlib.metadata import version

    h = hashlib.sha256((ROOT / "src/kiln/runtime/builtin.py").read_bytes())
    h.update(version("transformers").encode())
    return h.hexdigest()[:16]


def built_model_path() -> Path:
    """Build (or reuse) the built-in model for tests; safe under concurrent sessions and xdist workers."""
    import fcntl

    from kiln.runtime.builtin import build_builtin_model

    cache = Path(os.environ.get("KILN_TEST_CACHE") or Path(tempfile.gettempdir()) / "kiln-test-cache")
    target = cache / f"builtin-{_builder_key()}"
    if not (target / "config.json").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with open(cache / f".{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then reuse its directory
            if not (target / "config.json").is_file():
                build_builtin_model(target)
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
