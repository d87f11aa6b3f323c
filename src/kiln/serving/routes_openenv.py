"""HTTP routes for ``/v1/openenv/*``: preflight, start an OpenEnv run, follow it, cancel it, download its artifacts.

Thin layer over :class:`kiln.openenv.service.OpenEnvService` (``KilnState.openenv``). The composition
root builds the service (:func:`kiln.serving.state.build_openenv`: restart recovery runs then, before
any request); the app starts its workers in the lifespan after the trainer and closes it first at shutdown.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from kiln.openenv.schemas import ARTIFACT_SHA256_HEADER, OpenEnvPreflight, OpenEnvRun, OpenEnvRunList, OpenEnvRunRequest
from kiln.serving.state import get_state, require_experimental
from kiln.serving.path_params import OpenEnvRunId

if TYPE_CHECKING:
    from kiln.openenv.service import OpenEnvService

router = APIRouter(tags=["openenv"])
ARTIFACT_CHUNK = 1 << 16


def _service(request: Request) -> OpenEnvService:
    return get_state(request).openenv


def _public(request: Request, body: Any) -> Any:
    return request.app.state.redact_paths(body)


@router.post("/v1/openenv/runs", status_code=202, response_model=OpenEnvRun)
def start_run(body: OpenEnvRunRequest, request: Request) -> dict[str, Any]:
    """Preflight the GRPO fields, then queue a run: episodes on the environment, then a GRPO job."""
    require_experimental(get_state(request), "an OpenEnv run")
    return _public(request, _service(request).submit(body))


@router.get("/v1/openenv/runs", response_model=OpenEnvRunList)
def list_runs(request: Request) -> dict[str, Any]:
    """Every run this server tracks, in admission order."""
    return _public(request, {"object": "list", "data": _service(request).list()})


@router.get("/v1/openenv/runs/{run_id}", response_model=OpenEnvRun)
def get_run(run_id: OpenEnvRunId, request: Request) -> dict[str, Any]:
    """One run's state, progress, returns, termination counts and training job."""
    return _public(request, _service(request).get(run_id))


@router.post("/v1/openenv/runs/{run_id}/cancel", response_model=OpenEnvRun)
def cancel_run(run_id: OpenEnvRunId, request: Request) -> dict[str, Any]:
    """Cancel a queued or running run (a training job it started is cancelled too)."""
    return _public(request, _service(request).cancel(run_id))


@router.post("/v1/openenv/preflight", response_model=OpenEnvPreflight)
def preflight(body: OpenEnvRunRequest, request: Request) -> dict[str, Any]:
    """Materialise and validate the run's effective GRPO config and inspect the environment (discovery only):
    no episode is played, nothing is persisted, no capacity is reserved."""
    require_experimental(get_state(request), "an OpenEnv run")
    return _public(request, _service(request).inspect(body))


@router.get("/v1/openenv/runs/{run_id}/artifacts/{name}", response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {}},
                             "description": "the artifact's exact bytes"}})
def download_artifact(run_id: OpenEnvRunId, name: str, request: Request) -> StreamingResponse:
    """Stream a published run artifact (``rollouts.jsonl``, ``replay.json``, ``train_receipt.json``), verified
    against the run's recorded length and SHA-256 on the descriptor it is streamed from; the headers carry both."""
    fd, size, digest = _service(request).open_artifact(run_id, name)

    def chunks():
        try:
            while chunk := os.read(fd, ARTIFACT_CHUNK):
                yield chunk
        finally:
            os.close(fd)

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"content-length": str(size), ARTIFACT_SHA256_HEADER: digest,
                                      "content-disposition": f'attachment; filename="{name}"'})
