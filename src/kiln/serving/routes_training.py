"""HTTP routes for ``/v1/train/*``: submit jobs (one route per kind in :mod:`kiln.training.queue.kinds`), follow
and cancel them.

Thin layer: the wire models live in :mod:`kiln.training.schemas`, the logic in
:class:`kiln.training.queue.service.TrainingService` (``get_state(request).trainer``,
built by :func:`kiln.serving.state.build_state`). Responses are validated
against the :mod:`kiln.serving.protocol` models (``response_model``) and carry no
absolute server paths (:mod:`kiln.serving.paths`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from kiln.errors import NotFound, Unavailable
from kiln.serving.protocol import TrainingJob, TrainingStatus
from kiln.serving.state import get_state, require_experimental
from kiln.training.queue.kinds import JobKind, wire_kinds
from kiln.training.schemas import JOB_ID_RE
from kiln.serving.path_params import JobId

if TYPE_CHECKING:
    from kiln.training.queue.service import TrainingService

router = APIRouter(tags=["training"])


def _trainer(request: Request) -> TrainingService:
    state = get_state(request)
    require_experimental(state, "training")
    trainer = state.trainer
    if trainer is None:
        raise Unavailable("training is not enabled on this server", code="training_disabled", hint="start the server with training.enabled = true (KILN_TRAINING_ENABLED=1)")
    return trainer


def _public(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    redact = request.app.state.redact_paths
    return redact(body)


def _job_id(job_id: str) -> str:
    if not JOB_ID_RE.match(job_id):
        raise NotFound(f"no job {job_id!r}", code="job_not_found", hint="job IDs look like 'job-0123456789abcdef'")
    return job_id


def _submit_route(kind: JobKind[Any, Any]) -> None:
    """``POST /v1/train/<kind>``: queue a job of that wire kind (every check before queueing is its prepare's)."""

    def submit(body: BaseModel, request: Request) -> dict[str, Any]:
        return _public(request, _trainer(request).submit(body))

    submit.__name__ = submit.__qualname__ = f"submit_{kind.kind}"
    submit.__doc__ = kind.summary
    submit.__annotations__ = {"body": kind.schema, "request": Request, "return": dict[str, Any]}
    router.post(f"/v1/train/{kind.kind}", status_code=202, response_model=TrainingJob)(submit)


for _kind in wire_kinds():  # one route per wire kind of the registry (kiln.training.queue.kinds)
    _submit_route(_kind)


@router.get("/v1/train/status", response_model=TrainingStatus)
def train_status(request: Request) -> dict[str, Any]:
    """The running job, the queue (FIFO) and the most recent finished jobs; the trainer's hold pacer and serving's
    recent latency beside them (docs/latency.md)."""
    status = _trainer(request).status()
    if status.get("enabled"):
        status["serving"] = request.app.state.kiln.metrics.recent.summary()
    return _public(request, status)


@router.get("/v1/train/jobs/{job_id}", response_model=TrainingJob)
def train_job(job_id: JobId, request: Request) -> dict[str, Any]:
    """One job: state, step, loss, tokens/s, ETA, result or error."""
    return _public(request, _trainer(request).job(_job_id(job_id)))


@router.delete("/v1/train/queue/{job_id}", response_model=TrainingJob)
def cancel_job(job_id: JobId, request: Request) -> dict[str, Any]:
    """Cancel a queued job, or stop a running one at its next step boundary."""
    return _public(request, _trainer(request).cancel(_job_id(job_id)))
