"""Both engines implement the ServingEngine seam (every member, with the same call shape)."""

from __future__ import annotations

import inspect
import re

import pytest

from kiln.runtime.serving_engine import ENGINE_ATTRIBUTES, ServingEngine, seam_members


@pytest.mark.parametrize("cls_path", ["kiln.runtime.engine:Engine", "kiln.runtime.vllm_engine:VllmEngine"])
def test_engine_implements_the_seam(cls_path):
    import importlib

    module, name = cls_path.split(":")
    cls = getattr(importlib.import_module(module), name)
    members = seam_members()
    assert len(members) >= 20
    for member in members:
        seam, impl = getattr(ServingEngine, member), getattr(cls, member, None)
        assert impl is not None, f"{name} lacks {member}"
        assert isinstance(impl, property) == isinstance(seam, property), f"{name}.{member}: property mismatch"
        if callable(seam):
            want = [p.name for p in inspect.signature(seam).parameters.values()]
            got = [p.name for p in inspect.signature(impl).parameters.values()]
            assert got[: len(want)] == want, f"{name}.{member}{got} does not take {want}"
    source = inspect.getsource(cls)
    for attr in ENGINE_ATTRIBUTES:
        assert re.search(rf"self\.{attr}\s*[:=]", source), f"{name} never sets self.{attr}"
    assert hasattr(cls, "on_adapters_changed")


def test_state_is_typed_with_the_seam():
    from kiln.serving.state import KilnState

    assert KilnState.__annotations__["engine"] == "ServingEngine"
