"""The server default adapter: what requests naming the base model are served with.

An operator (``PUT /v1/adapters/default``, ``kiln adapters default NAME``, or ``[adapters] default``
at start-up) names an adapter; Kiln loads it if needed and pins the revision it serves. Requests
whose ``model`` is the base model ID then use that adapter, but only while the engine still
serves exactly the pinned revision: a hot-swap of the name to another revision does not move the
default silently (base requests get the bare base until the default is set again, and
``GET /v1/adapters/default`` says ``serving: false``). ``model: "<base>@base"`` always names the bare
base. The default is saved with the served set (``<store>/.served.json``) and survives restarts.
"""

from __future__ import annotations

from typing import Any

from kiln.errors import InvalidRequest

BARE_BASE_SUFFIX = "@base"  # "<base model ID>@base": the base without the default adapter


def adapter_for_base(state: Any) -> str | None:
    """The adapter a request naming the base model gets: the default while it serves its pinned revision."""
    served = state.served
    default = served.default if served is not None else None
    if default is None:
        return None
    name, revision = default
    return name if state.engine.active_adapters().get(name) == revision else None


def describe(state: Any) -> dict[str, Any]:
    """``{"default": null}`` or the default with whether base requests get it now."""
    default = state.served.default if state.served is not None else None
    if default is None:
        return {"default": None}
    name, revision = default
    served = state.engine.active_adapters().get(name)
    return {"default": {"name": name, "revision": revision, "serving": served == revision,
                        "served_revision": served}}


def set_default(state: Any, name: str, revision: str | None = None) -> dict[str, Any]:
    """Verify ``name`` (at ``revision``, default HEAD), serve it if it is not served at that revision,
    pin it as the default and save (blocking: adapter load)."""
    if state.served is None:
        raise InvalidRequest("this server keeps no served adapter set", code="default_adapter_unavailable")
    record = state.store.verify(name, revision)
    if state.engine.active_adapters().get(name) != record.revision:
        state.activation.activate(record)  # base, quarantine, memory and canary; a failure quarantines it
    state.served.default = (record.name, record.revision)
    state.served.save(state.engine.active_adapters())
    return describe(state)


def clear_default(state: Any) -> dict[str, Any]:
    if state.served is not None and state.served.default is not None:
        state.served.default = None
        state.served.save(state.engine.active_adapters())
    return describe(state)


def parse_setting(value: str) -> tuple[str, str | None]:
    """``[adapters] default``: ``NAME`` or ``NAME@REVISION``."""
    name, _, revision = value.partition("@")
    return name, revision or None
