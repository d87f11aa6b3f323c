"""Issue item 1: one typed composition root (engine, ONE adapter store, training service)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.conftest import default_device

SRC = Path(__file__).resolve().parents[2] / "src" / "kiln"


def test_kiln_state_fields_are_typed():
    from kiln.serving.state import KilnState

    annotations = KilnState.__annotations__
    assert annotations["engine"] == "ServingEngine"  # serving.engine: builtin | vllm, one seam (runtime/serving_engine.py)
    assert annotations["model"] == "LoadedModel"
    assert annotations["store"] == "AdapterStore"
    assert annotations["trainer"] == "TrainingService | None"
    assert annotations["metrics"] == "Metrics"
    assert annotations["loaded_settings"] == "LoadedSettings"
    assert not any("Any" in a for a in annotations.values()), annotations


def test_only_the_composition_root_builds_an_adapter_store():
    """Serving builds its store in one place; routes and training receive it (see the runtime test below)."""
    builders = sorted(str(p.relative_to(SRC)) for p in (SRC / "serving").rglob("*.py")
                      if re.search(r"\bAdapterStore\(", p.read_text()))
    assert builders == ["serving/state.py"], builders


def test_app_does_not_duck_type_training_into_the_state():
    app_src = (SRC / "serving" / "app.py").read_text() + (SRC / "serving" / "state.py").read_text()
    assert "attach_training" not in app_src
    assert "getattr(" not in app_src


@pytest.fixture(scope="module")
def built(builtin_model_dir, tmp_path_factory):
    from kiln.config import load_settings
    from kiln.serving.state import build_state

    home = tmp_path_factory.mktemp("compose")
    loaded = load_settings(cli={"home": str(home), "model.path": str(builtin_model_dir), "model.device": "cpu"},
                           environ={})
    state = build_state(loaded)
    yield state
    state.trainer.close()


def test_build_state_wires_one_store_and_one_engine(built):
    from kiln.adapters.store import AdapterStore
    from kiln.runtime.engine import Engine
    from kiln.training.queue.service import TrainingService

    assert isinstance(built.engine, Engine) and isinstance(built.store, AdapterStore)
    assert isinstance(built.trainer, TrainingService)
    assert built.trainer.store is built.store
    assert built.trainer.engine is built.engine
    # one activation service (kiln.adapters.activation) for routes, training, evals and restore
    assert built.trainer.activation is built.activation is built.evals.activation
    assert built.activation.memory is built.memory and built.activation.served is built.served
    assert built.model.device == default_device()


def test_adapter_routes_use_the_state_store(built):
    from types import SimpleNamespace

    from kiln.serving.routes_adapters import _store

    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(kiln=built)))
    assert _store(request) is built.store


def test_training_disabled_means_no_service(builtin_model_dir, tmp_path):
    from kiln.config import load_settings
    from kiln.serving.state import build_state

    loaded = load_settings(cli={"home": str(tmp_path), "model.path": str(builtin_model_dir),
                                "training.enabled": False}, environ={})
    assert build_state(loaded).trainer is None
