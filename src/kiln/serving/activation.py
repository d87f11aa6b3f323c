"""Serving a stored adapter revision, with canary quarantine.

Every operator path that makes the engine serve a stored revision (``POST /v1/adapters/{name}/load``,
the default adapter, the restore after a restart) goes through :func:`activate`: a revision trained on another base model is refused
(409 ``adapter_conflict``), a revision the store has quarantined is refused (409 ``adapter_quarantined``) until an operator clears it, and a
revision whose load or canary fails is quarantined with the failure as its reason before the error
reaches the caller, so the next attempt does not load it again. The previous revision stays served.

Before the load, the revision's tensor bytes are admitted against the memory budget
(:mod:`kiln.runtime.memory_budget`: 409 ``memory_reserved`` / 507 ``memory_budget_exceeded``); the
reservation stays while the revision is served and is released when it is unloaded or replaced.
"""

from __future__ import annotations

from typing import Any

from kiln.adapters.errors import AdapterConflict
from kiln.runtime.adapter_slots import AdapterError


class AdapterQuarantined(AdapterConflict):
    code = "adapter_quarantined"


def check_not_quarantined(store: Any, name: str, revision: str) -> None:
    mark = store.quarantined(name).get(revision)
    if mark is not None:
        raise AdapterQuarantined(
            f"adapter {name!r} revision {revision[:12]} is quarantined since {mark['at']}: {mark['reason']}",
            hint=f"fix or republish it, or clear the mark: POST /v1/adapters/{name}/quarantine/clear "
                 f"(kiln adapters unquarantine {name})")


def activate(state: Any, record: Any) -> None:
    """Serve ``record`` (a verified store record) unless it was trained on another base (409) or is
    quarantined (409); quarantine it when its load or canary fails."""
    if record.manifest.base_model_sha256 != state.model.base_model_sha256:
        raise AdapterConflict(
            f"adapter {record.name!r} was trained on base {record.manifest.base_model_sha256}, but this server "
            f"serves {state.model.base_model_sha256}",
            hint="Load it on a server running its base model.",
        )
    check_not_quarantined(state.store, record.name, record.revision)
    memory = getattr(state, "memory", None)
    reservation = None
    owner = f"{record.name}@{record.revision}"
    if memory is not None and state.engine.active_adapters().get(record.name) != record.revision:
        from kiln.adapters.footprint import adapter_parts

        # the revision it replaces is released once the new one serves, so it does not count against it
        served = state.engine.active_adapters().get(record.name)
        ignore = {f"{record.name}@{served}"} if served else set()
        reservation = memory.reserve("adapter", owner, adapter_parts(record.path),
                                     what=f"loading adapter {record.name!r} revision {record.revision[:12]}",
                                     ignore_owners=ignore, pending=True)  # another load's sync keeps it
    try:
        state.engine.activate_adapter(record.name, record.path, record.revision)
    except AdapterError as exc:
        if reservation is not None:
            memory.release(reservation)
        state.store.quarantine(record.name, record.revision, exc.message)
        metrics = getattr(state, "metrics", None)
        if metrics is not None:
            metrics.canary_failed()
        raise
    except BaseException:
        if reservation is not None:
            memory.release(reservation)
        raise
    if reservation is not None:
        memory.settle(reservation)
