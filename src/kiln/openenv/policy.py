"""Policy identity for OpenEnv runs: which adapter revision produced each action.

A run's corpus must come from one policy, or GRPO would credit one set of weights with actions
another produced. The first action of a run pins its policy (the adapter name and the revision the
engine served for that action; the base model is ``{"adapter": null, "revision": null}``). Every later
action is checked against the pin: a different revision (the adapter was retrained with auto_load,
reloaded, or unloaded and loaded again) fails the run with ``policy_revision_changed`` before the
action reaches the environment, so nothing from a mixed corpus is published or trained on.

Standard library only.
"""

from __future__ import annotations

import threading
from typing import Any

from kiln.errors import Conflict


class PolicyChanged(Conflict):
    code = "policy_revision_changed"
    default_hint = ("a run's actions must come from one policy revision: keep the policy adapter's served revision "
                    "fixed while a run collects (do not retrain it with auto_load or reload it), then start a new run")


class PolicyPin:
    """The run's policy identity, pinned by its first action; :meth:`check` refuses any other."""

    def __init__(self, adapter: str | None):
        self.adapter = adapter
        self.pinned: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def check(self, revision: str | None) -> dict[str, Any]:
        """The identity of one action produced by ``revision`` of the policy adapter (None: the base)."""
        ident = {"adapter": self.adapter, "revision": revision if self.adapter is not None else None}
        with self._lock:
            if self.pinned is None:
                self.pinned = ident
            elif ident != self.pinned:
                raise PolicyChanged(f"the policy adapter {self.adapter!r} changed revision during the run "
                                    f"({_short(self.pinned['revision'])} -> {_short(ident['revision'])}); the run "
                                    "stops so that one corpus never mixes two policies")
        return ident


def _short(revision: str | None) -> str:
    return "none" if revision is None else revision[:12]
