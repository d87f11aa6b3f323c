"""Route a request addressed to a scoped adapter: in scope of its corrections -> the adapter, else the base model.

An adapter published with ``scope: "corrections"`` (``kiln.adapters.scope``) keeps its corrections in its
revision's manifest config; the routing index is built from them on first use and cached per (name, revision), so
a new revision is routed by its own corrections and a crash loses nothing (the manifest is the record). The
decision is reported on the response (header :data:`SCOPE_HEADER`: ``in``, ``out``, or ``mixed`` for a
completion request whose prompts disagree) and counted in
``kiln_scope_decisions_total``. Requests to unscoped adapters and to the base model pass through untouched.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kiln.adapters.scope import ScopeIndex, last_user_text, revision_scope
from kiln.serving.state import KilnState

SCOPE_HEADER = "x-kiln-scope"
_CACHE_SIZE = 64
_cache: OrderedDict[tuple[int, str, str], ScopeIndex | None] = OrderedDict()
_lock = threading.Lock()


def _index(state: KilnState, adapter: str, revision: str) -> ScopeIndex | None:
    key = (id(state.store), adapter, revision)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    index = revision_scope(state.store, adapter, revision)  # a private or vanished revision: unscoped
    with _lock:
        _cache[key] = index
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return index


def route(state: KilnState, adapter: str | None, messages: list[Any]) -> tuple[str | None, dict[str, str]]:
    """``(the adapter that serves the request, response headers)``: ``adapter`` unchanged unless it is scoped and
    the request's last user message is outside its corrections, then ``None`` (the bare base model)."""
    return route_texts(state, adapter, lambda: [last_user_text(messages)])


def route_texts(state: KilnState, adapter: str | None,
                texts: Callable[[], list[str]]) -> tuple[str | None, dict[str, str]]:
    """:func:`route` for a completion request's prompts. One adapter serves a request, so several prompts go to
    the adapter when any of them is in scope (header ``mixed`` when some are not: those are answered by the
    adapter too), and to the base when none is. ``texts`` is called only for a scoped adapter."""
    if adapter is None:
        return None, {}
    revision = state.engine.active_adapters().get(adapter)
    if revision is None:
        return adapter, {}
    index = _index(state, adapter, revision)
    if index is None:
        return adapter, {}
    inside = [index.route(t).in_scope for t in texts()]
    verdict = "in" if all(inside) else "mixed" if any(inside) else "out"
    state.metrics.scope_decisions[verdict].inc()
    return (adapter if any(inside) else None), {SCOPE_HEADER: verdict}
