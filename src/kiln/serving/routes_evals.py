"""HTTP routes for ``/v1/evals/*``: suites, runs, comparisons, replays and the post-train gate.

Thin layer over :class:`kiln.evals.service.EvalService` (``KilnState.evals``, built by the composition root,
:func:`kiln.serving.state.build_state`). Submissions answer 202 with the queued run; follow it with
``GET /v1/evals/runs/{id}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from kiln.errors import NotFound
from kiln.serving.state import get_state
from kiln.evals.schemas import (
    RUN_ID_RE,
    CompareRequest,
    GateRequest,
    ImportRequest,
    ReplayRequest,
    RunRequest,
    SuiteSpec,
)
from kiln.serving.path_params import EvalRunId, SuiteName

if TYPE_CHECKING:
    from kiln.evals.service import EvalService

router = APIRouter(tags=["evals"])


def _evals(request: Request) -> EvalService:
    return get_state(request).evals


def _run_id(run_id: str) -> str:
    if not RUN_ID_RE.match(run_id):
        raise NotFound(f"no eval run {run_id!r}", code="eval_run_not_found",
                       hint="run IDs look like 'eval-0123456789abcdef'")
    return run_id


@router.post("/v1/evals/suites", status_code=201)
def create_suite(body: SuiteSpec, request: Request, replace: bool = False) -> dict[str, Any]:
    """Store a suite (validated: patterns, schemas, references, code execution policy)."""
    return _evals(request).put_suite(body, replace=replace)


@router.post("/v1/evals/suites/import", status_code=201)
def import_suite(body: ImportRequest, request: Request) -> dict[str, Any]:
    """Build and store a suite from JSONL rows."""
    return _evals(request).import_jsonl(name=body.name, jsonl=body.jsonl, dataset_path=body.dataset_path,
                                        scorers=[sc.model_dump(mode="json") for sc in body.scorers],
                                        generation=body.generation.model_dump(mode="json"),
                                        aggregation=body.aggregation, description=body.description,
                                        replace=body.replace)


@router.get("/v1/evals/suites")
def list_suites(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": _evals(request).suites.list()}


@router.get("/v1/evals/suites/{name}")
def get_suite(name: SuiteName, request: Request) -> dict[str, Any]:
    return _evals(request).suites.get(name).model_dump(mode="json")


@router.delete("/v1/evals/suites/{name}")
def delete_suite(name: SuiteName, request: Request) -> dict[str, Any]:
    return _evals(request).suites.delete(name)


@router.post("/v1/evals/runs", status_code=202)
def submit_run(body: RunRequest, request: Request) -> dict[str, Any]:
    """Queue a suite (stored or inline) against the base model or an adapter."""
    return _evals(request).submit_run(body)


@router.post("/v1/evals/comparisons", status_code=202)
def submit_comparison(body: CompareRequest, request: Request) -> dict[str, Any]:
    """Queue up to 8 targets on one suite, paired per example."""
    return _evals(request).submit_comparison(body)


@router.post("/v1/evals/replays", status_code=202)
def submit_replay(body: ReplayRequest, request: Request) -> dict[str, Any]:
    """Strictly replay a succeeded run: ends ``matched``, ``mismatch`` or ``error``."""
    return _evals(request).submit_replay(body)


@router.post("/v1/evals/gate", status_code=202)
def submit_gate(body: GateRequest, request: Request) -> dict[str, Any]:
    """Queue the post-train gate for a published candidate against a baseline."""
    return _evals(request).submit_gate(body.candidate, body.post_eval)


@router.get("/v1/evals/runs")
def list_runs(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": _evals(request).list()}


@router.get("/v1/evals/runs/{run_id}")
def get_run(run_id: EvalRunId, request: Request) -> dict[str, Any]:
    """One run: state, progress, and when finished the per-example results, aggregate and provenance."""
    return _evals(request).get(_run_id(run_id))


@router.delete("/v1/evals/runs/{run_id}")
def cancel_run(run_id: EvalRunId, request: Request) -> dict[str, Any]:
    """Cancel a queued run, or stop a running one at its next row boundary."""
    return _evals(request).cancel(_run_id(run_id))
