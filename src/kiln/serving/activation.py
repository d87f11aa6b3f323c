"""Serving a stored adapter revision, with canary quarantine.

Every operator path that makes the engine serve a stored revision (``POST /v1/adapters/{name}/load``,
the default adapter, the restore after a restart) goes through :func:`activate`: a revision trained on another base model is refused
(409 ``adapter_conflict``), a revision the store has quarantined is refused (409 ``adapter_quarantined``) until an operator clears it, and a
revision whose load or canary fails is quarantined with the failure as its reason before the error
reaches the caller, so the next attempt does not load it again. The previous revision stays served.
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
    try:
        state.engine.activate_adapter(record.name, record.path, record.revision)
    except AdapterError as exc:
        state.store.quarantine(record.name, record.revision, exc.message)
        raise
