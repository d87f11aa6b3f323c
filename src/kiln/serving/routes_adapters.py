"""HTTP routes for ``/v1/adapters``: list, inspect, receipt, load, unload, delete, upload, download, merge.

The store logic lives in :mod:`kiln.adapters`; a load goes through the activation service
(:mod:`kiln.adapters.activation`: base, quarantine, memory, then the engine's canary-checked atomic
swap). Adapter
errors become Kiln's error envelope with their own status codes.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Literal

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask

from kiln.adapters.errors import AdapterBusy, AdapterConflict, AdapterIntegrityError, AdapterTooLarge
from kiln.adapter_names import NAME_SCHEMA
from kiln.adapters.manifest import ADAPTER_REVISION_HEADER, MAX_ADAPTER_NAME_CHARS, MAX_LORA_RANK, check_name
from kiln.adapters.merge import DEFAULT_TIES_DENSITY, MAX_MERGE_PARENTS, publish_merge
from kiln.adapters.store import AdapterRecord, AdapterStore
from kiln.errors import NotFound
from kiln.serving import default_adapter
from kiln.serving.state import require_experimental
from kiln.serving.path_params import AdapterName

router = APIRouter(tags=["adapters"])

ARCHIVE_MEDIA_TYPE = "application/gzip"
MAX_CONCURRENT_UPLOADS = 2  # server-wide; each holds a staging dir and a validation thread
UPLOAD_RETRY_AFTER_S = 5


class UploadGate:
    """One upload at a time per adapter name (409), at most ``limit`` uploads server-wide (429)."""

    def __init__(self, limit: int = MAX_CONCURRENT_UPLOADS):
        self.limit = limit
        self._lock = threading.Lock()
        self._names: set[str] = set()

    def active(self) -> set[str]:
        with self._lock:
            return set(self._names)

    @contextmanager
    def hold(self, name: str) -> Iterator[None]:
        with self._lock:
            if name in self._names:
                raise AdapterConflict(f"an upload to adapter {name!r} is already in progress",
                                      hint="Wait for it to finish, then check GET /v1/adapters/{name}.")
            if len(self._names) >= self.limit:
                raise AdapterBusy(f"{self.limit} adapter uploads are already in progress",
                                  retry_after=UPLOAD_RETRY_AFTER_S)
            self._names.add(name)
        try:
            yield
        finally:
            with self._lock:
                self._names.discard(name)


class MergeSource(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(max_length=MAX_ADAPTER_NAME_CHARS, json_schema_extra=NAME_SCHEMA)
    weight: float = 1.0


class MergeRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(max_length=MAX_ADAPTER_NAME_CHARS, description="name of the merged adapter",
                      json_schema_extra=NAME_SCHEMA)
    method: Literal["linear", "ties", "cat"] = "linear"
    adapters: list[MergeSource] = Field(min_length=1, max_length=MAX_MERGE_PARENTS)
    density: float = Field(DEFAULT_TIES_DENSITY, gt=0, le=1, description="TIES: fraction of entries kept")
    rank: int | None = Field(None, ge=1, le=MAX_LORA_RANK, description="TIES: rank of the merged adapter")


def _state(request: Request) -> Any:
    return request.app.state.kiln


def _store(request: Request) -> AdapterStore:
    return _state(request).store  # the one store, built by kiln.serving.state.build_state


def _active(request: Request) -> dict[str, str]:
    return dict(_state(request).engine.active_adapters())


def _describe(record: AdapterRecord, active: dict[str, str], store: AdapterStore) -> dict[str, Any]:
    """One listed adapter. ``verified``/``error``: whether everything the listing reads (HEAD, manifest,
    quarantine marks, receipt) is readable and binds; the weights are re-hashed by a load and by
    ``kiln adapters verify``."""
    try:
        quarantined, error = store.quarantined(record.name), None  # revision -> {reason, at}: refused until cleared
    except AdapterIntegrityError as exc:
        quarantined, error = None, exc.message
    receipt = store.receipt_summary(record)  # None: a kind no job trains (upload, merge)
    error = error or (receipt or {}).get("error")
    return {**record.summary(), "active": record.name in active, "active_revision": active.get(record.name),
            "quarantined": quarantined, "receipt": receipt, "verified": error is None, "error": error}


def _damaged(name: str, error: str, active: dict[str, str]) -> dict[str, Any]:
    """A listed adapter whose HEAD or manifest cannot be read: named, marked, and nothing guessed."""
    return {"name": name, "revision": None, "base_model_sha256": None, "kind": None, "parent_revision": None,
            "size_bytes": None, "created": None, "active": name in active, "active_revision": active.get(name),
            "quarantined": None, "receipt": None, "verified": False, "error": error}


@router.get("/v1/adapters")
def list_adapters(request: Request) -> dict[str, Any]:
    """Every stored adapter at its current revision, with whether (and which revision) is being served; one
    whose files cannot be read is listed with ``verified: false`` and the reason."""
    store, active = _store(request), _active(request)
    records, damaged = store.scan()
    data = [_describe(r, active, store) for r in records] + [_damaged(d["name"], d["error"], active) for d in damaged]
    return {"object": "list", "data": sorted(data, key=lambda entry: entry["name"])}


class DefaultAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(max_length=MAX_ADAPTER_NAME_CHARS, description="a stored adapter", json_schema_extra=NAME_SCHEMA)
    revision: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="a retained revision; default: HEAD")


# Registered before /v1/adapters/{name}: an adapter named "default" is reached through the list.
@router.get("/v1/adapters/default")
def get_default_adapter(request: Request) -> dict[str, Any]:
    """The server default adapter: what requests naming the base model are served with."""
    return default_adapter.describe(_state(request))


@router.put("/v1/adapters/default")
def put_default_adapter(body: DefaultAdapterRequest, request: Request) -> dict[str, Any]:
    """Serve ``name`` (loading it if needed) to requests naming the base model, pinned to its revision."""
    return default_adapter.set_default(_state(request), body.name, body.revision)


@router.delete("/v1/adapters/default")
def delete_default_adapter(request: Request) -> dict[str, Any]:
    """Requests naming the base model get the bare base again."""
    return default_adapter.clear_default(_state(request))


@router.get("/v1/adapters/{name}")
def get_adapter(name: AdapterName, request: Request) -> dict[str, Any]:
    """One adapter, including its full manifest."""
    try:
        record = _store(request).get(name)
    except AdapterIntegrityError as exc:  # its HEAD or manifest cannot be read: marked, as the list marks it
        return {**_damaged(name, exc.message, _active(request)), "manifest": None}
    return {**_describe(record, _active(request), _store(request)), "manifest": record.manifest.to_dict()}


@router.get("/v1/adapters/{name}/receipt")
def get_receipt(name: AdapterName, request: Request, revision: str | None = None) -> dict[str, Any]:
    """The training receipt of ``name`` at ``revision`` (default: HEAD), checked to bind to that revision."""
    store = _store(request)
    record = store.get(name, revision)  # 400 for a malformed revision, 404 for one not retained
    body = store.verify_receipt(record)  # 500 adapter_integrity when it does not bind (as a load would say)
    if body is None:
        raise NotFound(f"adapter {name!r} revision {record.revision} is a {record.manifest.kind!r} revision: "
                       "no training job made it, so it has no receipt", code="receipt_not_found",
                       hint="receipts come with revisions published by training jobs (sft, grpo, opd, kd)")
    return body


@router.post("/v1/adapters/{name}/load")
def load_adapter(name: AdapterName, request: Request) -> dict[str, Any]:
    """Verify the stored files, then serve the adapter's current revision (canary-checked, atomic swap)."""
    state = _state(request)
    record = _store(request).verify(name)
    state.activation.activate(record)  # 409 other base / quarantined / memory; failed canary: 400, quarantined
    return {"name": record.name, "revision": record.revision, "active": True}


@router.post("/v1/adapters/{name}/quarantine/clear")
def clear_quarantine(name: AdapterName, request: Request) -> dict[str, Any]:
    """Lift the quarantine of every revision of ``name`` (after fixing what failed); they load again."""
    return {"name": name, "cleared": _store(request).clear_quarantine(name)}


@router.post("/v1/adapters/{name}/unload")
def unload_adapter(name: AdapterName, request: Request) -> dict[str, Any]:
    """Stop serving the adapter; requests already running on it finish on their revision."""
    check_name(name)
    _state(request).engine.deactivate_adapter(name)  # UnknownAdapter: 404 adapter_not_active
    return {"name": name, "active": False}


@router.delete("/v1/adapters/{name}")
def delete_adapter(name: AdapterName, request: Request) -> dict[str, Any]:
    """Delete an adapter with every stored revision. Refused (409) while it is being served."""
    check_name(name)
    if name in _active(request):
        raise AdapterConflict(
            f"adapter {name!r} is being served; it cannot be deleted while active",
            hint=f"Unload it first: `kiln adapters unload {name}` (POST /v1/adapters/{name}/unload).",
        )
    record = _store(request).delete(name)  # None: a damaged adapter (unreadable HEAD or manifest) was removed
    return {"name": name, "revision": record.revision if record is not None else None, "deleted": True}


@router.get("/v1/adapters/{name}/download")
def download_adapter(name: AdapterName, request: Request) -> FileResponse:
    """The current revision as a reproducible tar.gz (PEFT files plus kiln-manifest.json in ``<name>/``)."""
    from kiln.adapters.archive import pack

    store = _store(request)
    record = store.verify(name)
    staging = store.new_staging()
    try:
        archive = staging / f"{name}.tar.gz"
        pack(record.path, archive, folder=name)
    except BaseException:
        staging.discard()
        raise
    return FileResponse(
        archive,
        media_type=ARCHIVE_MEDIA_TYPE,
        filename=f"{name}-{record.revision[:12]}.tar.gz",
        headers={ADAPTER_REVISION_HEADER: record.revision},
        background=BackgroundTask(staging.discard),
    )


def _upload_gate(request: Request) -> UploadGate:
    return _state(request).extras.setdefault("adapter_upload_gate", UploadGate())


def _max_weights(state: Any) -> int:
    """Cap on an uploaded adapter_model.safetensors: the largest LoRA of the served base (computed once)."""
    from kiln.adapters.archive import max_weights_bytes
    from kiln.adapters.validate import base_weight_shapes

    cap = state.extras.get("adapter_max_weights")
    if cap is None:
        cap = state.extras["adapter_max_weights"] = max_weights_bytes(base_weight_shapes(state.model.info.path))
    return cap


def _publish_upload(store: AdapterStore, name: str, scratch: Any, state: Any) -> AdapterRecord:
    """Unpack, validate and publish (blocking: runs in the threadpool, never on the event loop)."""
    from kiln.adapters.archive import unpack

    with store.new_staging() as target:
        unpack(scratch / "upload.tar.gz", target.path, max_weights=_max_weights(state))
        return store.publish(
            target, name=name, base_model_sha256=state.model.base_model_sha256, kind="upload", config={},
            inputs_sha256=None, parent_revision=None, base_model_dir=state.model.info,
        )


@router.post("/v1/adapters/{name}/upload", status_code=201)
async def upload_adapter(name: AdapterName, request: Request) -> dict[str, Any]:
    """Publish a tar.gz of PEFT files (body: the raw archive) as a new revision of ``name`` (kind "upload")."""
    state = _state(request)
    limit = state.settings.adapters.max_upload_bytes
    check_name(name)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise AdapterTooLarge(f"upload of {declared} bytes exceeds adapters.max_upload_bytes ({limit})")
    with _upload_gate(request).hold(name):
        store = await run_in_threadpool(_store, request)
        scratch = await run_in_threadpool(store.new_staging)
        try:
            received = 0
            with open(scratch / "upload.tar.gz", "wb") as out:
                async for chunk in request.stream():
                    received += len(chunk)
                    if received > limit:
                        raise AdapterTooLarge(f"upload exceeds adapters.max_upload_bytes ({limit} bytes)")
                    out.write(chunk)  # page-cache write of one chunk
            record = await run_in_threadpool(_publish_upload, store, name, scratch, state)
        finally:
            await run_in_threadpool(scratch.discard)
    return _describe(record, _active(request), _store(request))


@router.post("/v1/adapters/merge", status_code=201)
def merge_adapters(body: MergeRequest, request: Request) -> dict[str, Any]:
    """Merge stored adapters (linear average, TIES, or rank concatenation) into a new adapter."""
    state = _state(request)
    require_experimental(state, "an adapter merge")
    record = publish_merge(
        _store(request),
        name=check_name(body.name),
        sources=[(check_name(s.name), s.weight) for s in body.adapters],
        method=body.method,
        base_model=state.model.info,
        density=body.density,
        rank=body.rank,
    )
    return {**_describe(record, _active(request), _store(request)), "notes": record.manifest.config.get("notes", [])}
