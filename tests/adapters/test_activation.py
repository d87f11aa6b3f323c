"""The adapter-activation service (kiln.adapters.activation) on a real store and memory budget, with an
engine stand-in that records what it was asked to serve (or fails its canary): base check, quarantine,
memory reservation, canary quarantine, private loads, the served-set record; and that it is the only
caller of the engine's activation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.adapters.activation import AdapterActivation, AdapterQuarantined
from kiln.adapters.errors import AdapterConflict
from kiln.adapters.footprint import adapter_parts
from kiln.adapters.served import ServedSet
from kiln.errors import Conflict, InsufficientMemory
from kiln.runtime.adapter_slots import AdapterError
from kiln.runtime.memory_budget import MemoryBudget

SRC = Path(__file__).resolve().parents[2] / "src" / "kiln"


class FakeEngine:
    """Serves name -> revision; ``fail`` makes the next load's canary fail."""

    def __init__(self, on_change=None):
        self.active: dict[str, str] = {}
        self.fail: str | None = None
        self.on_change = on_change

    def activate_adapter(self, name: str, path: Path, revision: str) -> None:
        if self.fail:
            raise AdapterError(self.fail)
        self.active[name] = revision
        self._changed()

    def deactivate_adapter(self, name: str) -> None:
        del self.active[name]
        self._changed()

    def active_adapters(self) -> dict[str, str]:
        return dict(self.active)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.active_adapters())


def _publish(store, make_lora, base_info, name, *, seed=0, r=4, base=None):
    staging = store.new_staging()
    for f in make_lora(seed=seed, r=r).iterdir():
        (Path(staging) / f.name).write_bytes(f.read_bytes())
    return store.publish(staging, name=name, base_model_sha256=base or base_info.base_model_sha256, kind="sft",
                         config={}, base_model_dir=base_info)


def _service(store, base_info, *, budget=None):
    memory = None if budget is None else MemoryBudget(budget, 0, lambda: {"weights": 0})
    served = ServedSet(store.root, public=store.has)
    failures: list[int] = []
    engine = FakeEngine()
    service = AdapterActivation(engine, store, base_info.base_model_sha256, memory=memory, served=served,
                                on_canary_failed=lambda: failures.append(1))
    engine.on_change = service.record_served
    return service, engine, failures


def test_activation_reserves_replaces_and_records_the_served_set(make_lora, store, base_info):
    service, engine, _ = _service(store, base_info, budget=1 << 30)
    first = _publish(store, make_lora, base_info, "a", seed=1)
    service.activate(first)
    assert engine.active == {"a": first.revision}
    owners = service.memory.owners("adapter")
    assert owners == {f"a@{first.revision}"}
    assert service.served.load()[0] == {"a": first.revision}
    second = _publish(store, make_lora, base_info, "a", seed=2)
    service.activate(second)  # the served revision it replaces does not stand in its way, and is released
    assert service.memory.owners("adapter") == {f"a@{second.revision}"}
    engine.deactivate_adapter("a")
    assert service.memory.owners("adapter") == set() and service.served.load()[0] == {}


def test_another_base_and_a_quarantined_revision_are_refused_before_the_engine(make_lora, store, base_info):
    service, engine, _ = _service(store, base_info)
    foreign = _publish(store, make_lora, base_info, "foreign", seed=3)
    service.base_model_sha256 = "f" * 64
    with pytest.raises(AdapterConflict, match="trained on base"):
        service.activate(foreign)
    service.base_model_sha256 = base_info.base_model_sha256
    store.quarantine("foreign", foreign.revision, "canary failed")
    with pytest.raises(AdapterQuarantined) as info:
        service.activate(foreign)
    assert info.value.status == 409 and "canary failed" in info.value.message
    with pytest.raises(AdapterQuarantined):  # a private load is refused the same way
        with service.private("kiln-eval-x", "foreign", foreign.revision, Path(foreign.path), what="an eval"):
            pass
    assert engine.active == {}


def test_a_failed_canary_quarantines_and_releases(make_lora, store, base_info):
    service, engine, failures = _service(store, base_info, budget=1 << 30)
    record = _publish(store, make_lora, base_info, "bad", seed=4)
    engine.fail = "canary produced NaN"
    with pytest.raises(AdapterError):
        service.activate(record)
    assert store.quarantined("bad")[record.revision]["reason"] == "canary produced NaN"
    assert failures == [1] and service.memory.owners("adapter") == set() and engine.active == {}
    engine.fail = None
    with pytest.raises(AdapterQuarantined):
        service.activate(record)


def test_memory_refusals_name_the_reservations(make_lora, store, base_info):
    record = _publish(store, make_lora, base_info, "m", seed=5, r=8)
    need = sum(adapter_parts(record.path).values())
    service, engine, _ = _service(store, base_info, budget=need - 1)
    with pytest.raises(InsufficientMemory) as never:
        service.activate(record)
    assert never.value.code == "memory_budget_exceeded" and engine.active == {}
    service, engine, _ = _service(store, base_info, budget=need + 10)
    job = service.memory.reserve("training", "job-1", {"lora": 20}, what="a job")
    with pytest.raises(Conflict) as now:
        service.activate(record)
    assert now.value.code == "memory_reserved" and "job-1" in now.value.message
    service.activate(record, ignore_kinds=frozenset({"training"}))  # a job activating its own adapter
    assert engine.active == {"m": record.revision}
    service.memory.release(job)


def test_a_private_load_holds_its_reservation_only_while_loaded(make_lora, store, base_info):
    service, engine, _ = _service(store, base_info, budget=1 << 30)
    record = _publish(store, make_lora, base_info, "target", seed=6)
    with service.private("kiln-eval-1", "target", record.revision, Path(record.path), what="an eval"):
        assert engine.active == {"kiln-eval-1": record.revision}
        assert service.memory.owners("adapter") == {f"kiln-eval-1@{record.revision}"}
        assert service.served.load()[0] == {}  # a private load is not part of the served set
    assert engine.active == {} and service.memory.owners("adapter") == set()


def test_restore_serves_the_saved_set_through_the_same_checks(make_lora, store, base_info):
    service, engine, _ = _service(store, base_info)
    good = _publish(store, make_lora, base_info, "good", seed=7)
    held = _publish(store, make_lora, base_info, "held", seed=8)
    service.served.save({"good": good.revision, "held": held.revision})
    store.quarantine("held", held.revision, "bad weights")
    engine.on_change = None  # as at start-up: the hook is set after the restore
    failed, default = service.restore()
    assert engine.active == {"good": good.revision} and default is None
    assert [f["name"] for f in failed] == ["held"] and "quarantined" in failed[0]["error"]


def test_only_the_activation_service_calls_the_engines_activation():
    """Routes, training, evals, the default adapter and restore all go through AdapterActivation."""
    callers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                     if not str(p.relative_to(SRC)).startswith("runtime/")
                     and re.search(r"\.activate_adapter\(", p.read_text(encoding="utf-8")))
    assert callers == ["adapters/activation.py"]
