"""HTTP routes for ``/v1/train/*``: submit SFT/GRPO jobs, follow and cancel them.

Thin layer: the wire models live in :mod:`kiln.training.schemas`, the logic in
:class:`kiln.training.service.TrainingService` (``get_state(request).trainer``,
built by :func:`kiln.serving.state.build_state`). Responses are validated
against the :mod:`kiln.serving.protocol` models (``response_model``) and carry no
absolute server paths (:mod:`kiln.serving.paths`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from kiln.errors import NotFound, Unavailable
from kiln.serving.protocol import TrainingJob, TrainingStatus
from kiln.serving.state import get_state, require_experimental
from kiln.training.kd_schemas import KDRequest
from kiln.training.opd_schemas import OPDRequest
from kiln.training.schemas import JOB_ID_RE, GRPORequest, SFTRequest

if TYPE_CHECKING:
    from kiln.training.service import TrainingService

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


@router.post("/v1/train/sft", status_code=202, response_model=TrainingJob)
def submit_sft(body: SFTRequest, request: Request) -> dict[str, Any]:
    """Queue a LoRA SFT job (loss on assistant tokens only)."""
    return _public(request, _trainer(request).submit(body))


@router.post("/v1/train/grpo", status_code=202, response_model=TrainingJob)
def submit_grpo(body: GRPORequest, request: Request) -> dict[str, Any]:
    """Queue a GRPO job: over pre-scored completion groups, or over `prompts` that Kiln samples `group_size`
    completions for and scores with `reward` (an eval scorer, a sandboxed Python file under the data dir, or an
    HTTP endpoint on loopback), `iterations` times (docs/training.md, "GRPO with rollouts"). Every check runs
    before queueing: 400 (invalid request, unknown scorer, missing reference, non-loopback URL, reward file
    outside the data dir, code execution disabled), 404 (base adapter or reward file not found),
    409 (base adapter of another model), 503 (queue full, training disabled)."""
    return _public(request, _trainer(request).submit(body))


@router.post("/v1/train/opd", status_code=202, response_model=TrainingJob)
def submit_opd(body: OPDRequest, request: Request) -> dict[str, Any]:
    """Queue an on-policy distillation job: the student samples, a registered teacher scores, the student
    moves toward the teacher on its own tokens (docs/training.md, "On-policy distillation")."""
    return _public(request, _trainer(request).submit(body))


@router.post("/v1/train/kd", status_code=202, response_model=TrainingJob)
def submit_kd(body: KDRequest, request: Request) -> dict[str, Any]:
    """Queue a sparse-KD job on the served model's adapter from an offline capture run under the data dir,
    consumed through its ledger exactly once (docs/training.md, "Sparse KD from a capture")."""
    return _public(request, _trainer(request).submit(body))


@router.get("/v1/train/status", response_model=TrainingStatus)
def train_status(request: Request) -> dict[str, Any]:
    """The running job, the queue (FIFO) and the most recent finished jobs."""
    return _public(request, _trainer(request).status())


@router.get("/v1/train/jobs/{job_id}", response_model=TrainingJob)
def train_job(job_id: str, request: Request) -> dict[str, Any]:
    """One job: state, step, loss, tokens/s, ETA, result or error."""
    return _public(request, _trainer(request).job(_job_id(job_id)))


@router.delete("/v1/train/queue/{job_id}", response_model=TrainingJob)
def cancel_job(job_id: str, request: Request) -> dict[str, Any]:
    """Cancel a queued job, or stop a running one at its next step boundary."""
    return _public(request, _trainer(request).cancel(_job_id(job_id)))
