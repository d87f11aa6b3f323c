"""Live LoRA adapters on the one served model (PEFT multi-adapter, no second copy).

Served adapter *names* map to internal PEFT adapter *keys* (``name@revision[:12]``).
A request resolves its name to a key once, at admission, and holds a reference
on that key until its row is cleaned up; activation of a new revision loads the
new key, checks it with a canary, then flips the name's mapping in one step.
Keys no longer mapped are deleted when their last row lets go. Deleting takes
exclusive ownership; when the last reference is dropped by a thread inside a shared
section (the engine's own cycle), the deletion is queued and :meth:`AdapterSlots.reap`
runs it once the engine has left the section, so the engine never waits on itself.

PEFT wraps the base model in place the first time an adapter is needed. It needs
one adapter to exist, so the wrap installs a rank-1 placeholder whose B matrix is
zero (a no-op); every forward passes explicit per-row ``adapter_names``, so the
placeholder or any adapter the trainer sets active is never applied by accident.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

from kiln.adapter_names import MAX_ADAPTER_NAME_CHARS, is_valid_name  # the one adapter-name rule
from kiln.errors import InvalidRequest
from kiln.runtime.adapter_refs import AdapterRefs
from kiln.runtime.adapter_refs import UnknownAdapter as UnknownAdapter  # re-exported: the engines raise it

BASE_KEY = "__base__"  # PEFT's name for "no adapter" in a mixed batch
PLACEHOLDER_KEY = "__kiln_placeholder__"
KEY_REVISION_CHARS = 12


class AdapterError(InvalidRequest):
    """An adapter could not be activated (its files, shape or canary); the message says what to do."""

    code = "adapter_rejected"
    default_hint = "the adapter failed to load or its canary failed; check the server log and the adapter files"


def adapter_key(name: str, revision: str) -> str:
    return f"{name}@{revision[:KEY_REVISION_CHARS]}"


class AdapterSlots:
    def __init__(self, model: Any, ownership: Any):
        self._base = model
        self._peft: Any = None
        self._ownership = ownership
        self._lock = threading.Lock()  # guards _doomed
        self._table = AdapterRefs()  # served name -> (key, revision), rows per key, retired keys
        self._doomed: list[str] = []  # retired keys whose last reference went while shared was held

    # -- model objects ---------------------------------------------------------
    @property
    def forward_model(self) -> Any:
        return self._peft if self._peft is not None else self._base

    @property
    def wrapped(self) -> bool:
        return self._peft is not None

    def peft_model(self) -> Any:
        """The PeftModel over the served model, wrapping it in place on first use."""
        if self._peft is not None:
            return self._peft
        with self._ownership.exclusive():
            self._wrap_locked()
        return self._peft

    def _wrap_locked(self) -> None:
        if self._peft is not None:
            return
        import torch
        from peft import LoraConfig

        from kiln.runtime.peft_wrap import get_peft_model

        target = next(
            (name.rsplit(".", 1)[-1] for name, mod in self._base.named_modules()
             if isinstance(mod, torch.nn.Linear) and ".layers." in name),
            None,
        )
        if target is None:
            raise AdapterError("the served model has no linear layers inside `.layers.`; LoRA adapters are unsupported")
        config = LoraConfig(r=1, lora_alpha=1, target_modules=[target], lora_dropout=0.0)
        was_training = self._base.training
        self._peft = get_peft_model(self._base, config, adapter_name=PLACEHOLDER_KEY)
        self._peft.train(was_training)
        if not was_training:
            self._peft.eval()

    # -- request side ------------------------------------------------------------
    def acquire(self, name: str) -> tuple[str, str]:
        """Resolve a served name to (key, revision) and hold a reference on the key."""
        return self._table.acquire(name)

    def acquire_private(self, key: str, count: int) -> list[str]:
        """``count`` references on a trainer's private adapter ``key`` (a PEFT key no served name maps to);
        :meth:`release` drops them, and never deletes the key (only :meth:`delete_private` does)."""
        if self._peft is None or key not in self._peft.peft_config:
            raise UnknownAdapter(f"no private adapter {key!r} on the served model")
        self._table.hold(key, count)
        return [key] * count

    def release(self, key: str) -> None:
        if not self._table.release(key):
            return
        if self._ownership.holds_shared():
            with self._lock:
                self._doomed.append(key)
            return
        with self._ownership.exclusive():
            self._delete_key(key)

    def reap(self) -> None:
        """Delete retired keys whose last reference was dropped inside a shared section.
        Call it without shared ownership (the engine does, between cycles)."""
        with self._lock:
            doomed, self._doomed = self._doomed, []
        if doomed:
            with self._ownership.exclusive():
                for key in doomed:
                    if self._table.deletable(key):  # else re-activated meanwhile (a new name maps to it again)
                        self._delete_key(key)

    @property
    def reap_pending(self) -> bool:
        with self._lock:
            return bool(self._doomed)

    # -- control side ------------------------------------------------------------
    def activate(self, name: str, path: Path, revision: str, canary: Callable[[str], None]) -> None:
        if not is_valid_name(name):
            raise AdapterError(f"invalid adapter name {name[:80]!r}: 1-{MAX_ADAPTER_NAME_CHARS} of A-Z a-z 0-9 . _ -")
        key = adapter_key(name, revision)
        with self._ownership.exclusive():
            self._wrap_locked()
            if self._table.current(name) == key:
                return  # already serving this revision
            if key in self._peft.peft_config:
                self._delete_key(key)  # a stale retired copy still in use cannot be, or refs would hold it
            try:
                self._peft.load_adapter(str(path), adapter_name=key, is_trainable=False)
                self._peft.eval()
                canary(key)
            except Exception as exc:
                if key in self._peft.peft_config:
                    self._delete_key(key)
                raise AdapterError(
                    f"cannot activate adapter {name!r} revision {revision[:KEY_REVISION_CHARS]} from {path}: {exc}; "
                    "the previous revision (if any) stays active"
                ) from exc
            stale = self._table.activate(name, key, revision)
            if stale is not None:
                self._delete_key(stale)

    def deactivate(self, name: str) -> None:
        key = self._table.deactivate(name)
        if key is not None:  # no row holds it: delete it now (else its last release does)
            with self._ownership.exclusive():
                self._delete_key(key)

    def active(self) -> dict[str, str]:
        return self._table.active()

    def describe(self) -> dict[str, Any]:
        """The physical adapter state (GET /v1/debug/model-state): whether the model is PEFT-wrapped, each
        served name's key and revision, rows holding each key, retired keys not yet deleted, and every
        adapter the PEFT model holds (private training adapters included)."""
        out: dict[str, Any] = {"wrapped": self._peft is not None, **self._table.snapshot()}
        out["peft_adapters"] = sorted(self._peft.peft_config) if self._peft is not None else []
        return out

    def delete_private(self, key: str) -> None:
        """Delete an adapter the trainer added under its own private name."""
        if self._table.serves_key(key):
            raise AdapterError(f"{key!r} is a served adapter key; use deactivate_adapter")
        with self._ownership.exclusive():
            self._delete_key(key)

    def _delete_key(self, key: str) -> None:
        """Caller holds exclusive ownership."""
        if self._peft is None or key not in self._peft.peft_config:
            self._table.forget(key)
            return
        active = self._peft.active_adapters if hasattr(self._peft, "active_adapters") else []
        if key in active:
            self._peft.set_adapter(PLACEHOLDER_KEY)
        self._peft.delete_adapter(key)
        self._table.forget(key)
