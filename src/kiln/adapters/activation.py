"""Serving a stored adapter revision: the one way an adapter comes onto the engine.

:class:`AdapterActivation` is the only caller of the engine's ``activate_adapter``. Every path that
serves a stored revision goes through it: ``POST /v1/adapters/{name}/load``, the default adapter
(``PUT /v1/adapters/default``, ``[adapters] default``), the restore of the served set after a restart,
a training job's ``auto_load`` / ``post_eval.activate_on_pass`` (:mod:`kiln.training.core.recipe`), and
an eval's private load of its target and judges (:mod:`kiln.evals.evaluation`). Each gets the same checks,
in this order:

1. base: a revision trained on another base model is refused (409 ``adapter_conflict``);
2. quarantine: a revision the store has quarantined is refused (409 ``adapter_quarantined``) until an
   operator clears it;
3. memory: the revision's tensor bytes are admitted against the memory budget
   (:mod:`kiln.runtime.memory_budget`: 409 ``memory_reserved`` / 507 ``memory_budget_exceeded``); the
   reservation stays while the revision is served and is released when it is unloaded or replaced;
4. canary: the engine loads the revision and runs its canary; a revision whose load or canary fails is
   quarantined with the failure as its reason before the error reaches the caller (400
   ``adapter_rejected``), so the next attempt does not load it again. The previous revision stays served.

:meth:`AdapterActivation.record_served` is the engine's ``on_adapters_changed`` hook: it saves the served
set (:mod:`kiln.adapters.served`) and drops the reservations of revisions no longer served.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

from kiln.adapters.errors import AdapterConflict
from kiln.errors import KilnError
from kiln.runtime.adapter_slots import AdapterError

if TYPE_CHECKING:
    from kiln.adapters.served import ServedSet
    from kiln.adapters.store import AdapterRecord, AdapterStore
    from kiln.runtime.memory_budget import MemoryBudget, Reservation

log = logging.getLogger(__name__)


class AdapterEngine(Protocol):
    """The part of an engine (:class:`kiln.runtime.serving_engine.ServingEngine`) activation uses."""

    def activate_adapter(self, name: str, path: Path, revision: str) -> None: ...
    def deactivate_adapter(self, name: str) -> None: ...
    def active_adapters(self) -> dict[str, str]: ...


class AdapterQuarantined(AdapterConflict):
    code = "adapter_quarantined"


def check_not_quarantined(store: AdapterStore, name: str, revision: str) -> None:
    mark = store.quarantined(name).get(revision)
    if mark is not None:
        raise AdapterQuarantined(
            f"adapter {name!r} revision {revision[:12]} is quarantined since {mark['at']}: {mark['reason']}",
            hint=f"fix or republish it, or clear the mark: POST /v1/adapters/{name}/quarantine/clear "
                 f"(kiln adapters unquarantine {name})")


class AdapterActivation:
    """Base check, quarantine, memory reservation, canary and the served-set record, for one engine.

    Built once by the composition root (:func:`kiln.serving.state.build_state`) and handed to the routes,
    the training service and the eval service; ``memory`` (None: no accounting), ``served`` (None: the
    served set is not kept) and ``on_canary_failed`` (a metrics counter) are wired there."""

    def __init__(self, engine: AdapterEngine, store: AdapterStore, base_model_sha256: str, *,
                 memory: MemoryBudget | None = None, served: ServedSet | None = None,
                 on_canary_failed: Callable[[], None] | None = None):
        self.engine = engine
        self.store = store
        self.base_model_sha256 = base_model_sha256
        self.memory = memory
        self.served = served
        self.on_canary_failed = on_canary_failed

    # ------------------------------------------------------------------ checks
    def check(self, record: AdapterRecord) -> None:
        """Refuse ``record`` when it was trained on another base (409) or is quarantined (409)."""
        if record.manifest.base_model_sha256 != self.base_model_sha256:
            raise AdapterConflict(
                f"adapter {record.name!r} was trained on base {record.manifest.base_model_sha256}, but this server "
                f"serves {self.base_model_sha256}",
                hint="Load it on a server running its base model.",
            )
        check_not_quarantined(self.store, record.name, record.revision)

    # -------------------------------------------------------------- activation
    def activate(self, record: AdapterRecord, *, ignore_kinds: frozenset[str] = frozenset()) -> None:
        """Serve ``record`` (a verified store record) under its name, replacing the revision served before.

        ``ignore_kinds``: reservations that do not stand in the way (a training job activating its own
        adapter as it ends ignores its ``training`` reservation)."""
        self.check(record)
        served = self.engine.active_adapters().get(record.name)
        reservation = None
        if self.memory is not None and served != record.revision:
            # the revision it replaces is released once the new one serves, so it does not count against it
            reservation = self._reserve(f"{record.name}@{record.revision}", Path(record.path),
                                        what=f"loading adapter {record.name!r} revision {record.revision[:12]}",
                                        ignore_owners={f"{record.name}@{served}"} if served else set(),
                                        ignore_kinds=ignore_kinds)
        self._load(record.name, record.name, Path(record.path), record.revision, reservation)
        if reservation is not None and self.memory is not None:
            self.memory.settle(reservation)

    @contextmanager
    def private(self, key: str, adapter: str, revision: str, path: Path, *, what: str,
                ignore_kinds: frozenset[str] = frozenset()) -> Iterator[None]:
        """Load revision ``revision`` of ``adapter`` privately under the engine name ``key`` (an eval's target
        or judge) for the ``with`` block, then unload it. Quarantine, memory and canary as any activation (the
        caller resolved the record and checked its base)."""
        check_not_quarantined(self.store, adapter, revision)
        reservation = None
        if self.memory is not None:  # held while the private copy is loaded (409 / 507 as any adapter load)
            reservation = self._reserve(f"{key}@{revision}", path, what=what, ignore_kinds=ignore_kinds)
        self._load(key, adapter, path, revision, reservation)
        try:
            yield
        finally:
            try:
                self.engine.deactivate_adapter(key)
            except KilnError:
                log.warning("private adapter %s was already gone", key)
            if reservation is not None and self.memory is not None:
                self.memory.release(reservation)

    def _reserve(self, owner: str, path: Path, *, what: str, ignore_kinds: frozenset[str],
                 ignore_owners: set[str] | None = None) -> Reservation:
        from kiln.adapters.footprint import adapter_parts

        assert self.memory is not None
        return self.memory.reserve("adapter", owner, adapter_parts(path), what=what, ignore_kinds=ignore_kinds,
                                   ignore_owners=ignore_owners or set(), pending=True)  # another load's sync keeps it

    def _load(self, key: str, adapter: str, path: Path, revision: str, reservation: Reservation | None) -> None:
        """The engine's activation (canary first); a failed load or canary quarantines the revision."""
        try:
            self.engine.activate_adapter(key, path, revision)
        except AdapterError as exc:
            self._release(reservation)
            self.store.quarantine(adapter, revision, exc.message)
            if self.on_canary_failed is not None:
                self.on_canary_failed()
            raise
        except BaseException:
            self._release(reservation)
            raise

    def _release(self, reservation: Reservation | None) -> None:
        if reservation is not None and self.memory is not None:
            self.memory.release(reservation)

    # -------------------------------------------------------------- served set
    def restore(self) -> tuple[list[dict[str, str]], tuple[str, str] | None]:
        """Serve again what was served before a restart (each at its revision, through :meth:`activate`);
        return the entries that could not be, with why, and the saved default (see
        :meth:`kiln.adapters.served.ServedSet.restore`). Nothing to restore without a served set."""
        if self.served is None:
            return [], None
        return self.served.restore(self.store, self.activate)

    def record_served(self, active: dict[str, str]) -> None:
        """The engine's ``on_adapters_changed`` hook: save the served set and release the reservation of every
        revision no longer served (unloaded or replaced)."""
        if self.served is not None:
            self.served.save(active)
        if self.memory is not None:
            self.memory.keep_only("adapter", {f"{name}@{revision}" for name, revision in active.items()})
