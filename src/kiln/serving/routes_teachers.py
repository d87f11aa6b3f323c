"""HTTP routes for ``/v1/teachers``: register (after both probes), list, show, delete; and
``/v1/teacher/manifest``, this server's own teacher manifest (:mod:`kiln.teachers.inference_proof`).

The logic lives in :class:`kiln.teachers.registry.TeacherRegistry`
(``get_state(request).teachers.registry``). Registration probes the teacher
over the network (or this server's engine for ``local``), so it runs in a
worker thread.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict

from kiln.errors import Unavailable
from kiln.serving.state import get_state
from kiln.serving.path_params import TeacherAlias
from kiln.teachers.registry import TeacherRegistry, TeacherRequest
from kiln.teachers.service import TeacherService

router = APIRouter(tags=["teachers"])


class TeacherBounds(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_top_k: int
    max_model_len: int
    max_prompt_logprob_candidates: int
    vocab_size: int
    full_vocab: bool


class TeacherInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alias: str
    kind: Literal["remote", "local"]
    provider: str | None
    model_id: str | None
    url: str | None
    credential_id: str | None
    adapter: str | None
    status: str
    usable: bool
    reason: str | None
    fingerprint: str | None
    registered_at: int | None
    identity: dict[str, Any] | None
    identity_revision: str | None
    bounds: TeacherBounds | None
    off_policy_manifest: dict[str, Any] | None
    probes: dict[str, int] | None = None
    deleted: bool | None = None


class TeacherList(BaseModel):
    model_config = ConfigDict(extra="forbid")
    object: Literal["list"] = "list"
    data: list[TeacherInfo]


class TeacherManifestInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    identity: dict[str, Any]
    system_fingerprint: str
    inference_config: dict[str, Any]


def _service(request: Request) -> TeacherService:
    teachers = get_state(request).teachers
    if teachers is None:
        raise Unavailable("teachers are not available in this process", code="teachers_unavailable")
    return teachers


def _registry(request: Request) -> TeacherRegistry:
    return _service(request).registry


@router.get("/v1/teacher/manifest", response_model=TeacherManifestInfo)
def teacher_manifest(request: Request, model: Annotated[str | None, Query(max_length=512)] = None) -> dict[str, Any]:
    """What a capture needs to prove this teacher's ``config.json`` digest (``kiln distill capture
    --teacher-manifest``): the identity, its fingerprint and the inference document it binds."""
    return _service(request).manifest(model)


@router.post("/v1/teachers", status_code=201, response_model=TeacherInfo)
async def register_teacher(body: TeacherRequest, request: Request) -> dict[str, Any]:
    """Probe the teacher (top-1 and max-K) and publish the alias; immutable once registered."""
    return await run_in_threadpool(_registry(request).register, body)


@router.get("/v1/teachers", response_model=TeacherList)
def list_teachers(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": _registry(request).list()}


@router.get("/v1/teachers/{alias}", response_model=TeacherInfo)
def show_teacher(alias: TeacherAlias, request: Request) -> dict[str, Any]:
    return _registry(request).show(alias)


@router.delete("/v1/teachers/{alias}", response_model=TeacherInfo)
def delete_teacher(alias: TeacherAlias, request: Request) -> dict[str, Any]:
    return _registry(request).delete(alias)
