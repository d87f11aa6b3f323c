"""Serving a stored adapter revision, with canary quarantine.

Every operator path that makes the engine serve a stored revision (``POST /v1/adapters/{name}/load``,
the default adapter, the restore after a restart) goes through :func:`activate`: a revision the
store has quarantined is refused (409 ``adapter_quarantined``) until an operator clears it, and a
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
    """Serve ``record`` (a verified store record) unless quarantined; quarantine it when it fails."""
    check_not_quarantined(state.store, record.name, record.revision)
    try:
        state.engine.activate_adapter(record.name, record.path, record.revision)
    except AdapterError as exc:
        state.store.quarantine(record.name, record.revision, exc.message)
        raise
