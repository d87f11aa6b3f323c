"""HTTP routes for ``/v1/judgments*``: record A/B preferences, page and export them, train a judge
adapter on them, and ask a judge to compare two responses (docs/evals.md, "Judgments").

Thin layer over :class:`kiln.judgments.service.JudgmentService` (``KilnState.judgments``, built
by :func:`kiln.serving.state.build_judgments`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from kiln.errors import NotFound
from kiln.judgments.schemas import (
    JUDGMENT_ID_RE,
    MAX_PAGE,
    CompareRequest,
    JudgeTrainRequest,
    JudgmentCreate,
)
from kiln.serving.state import get_state, require_experimental
from kiln.serving.path_params import JudgmentId

if TYPE_CHECKING:
    from kiln.judgments.service import JudgmentService

router = APIRouter(tags=["judgments"])


def _service(request: Request) -> JudgmentService:
    return get_state(request).judgments


def _judgment_id(judgment_id: str) -> str:
    if not JUDGMENT_ID_RE.match(judgment_id):
        raise NotFound(f"no judgment {judgment_id!r}", code="judgment_not_found",
                       hint="judgment IDs look like 'jdg-0123456789abcdef'")
    return judgment_id


@router.post("/v1/judgments", status_code=201)
def record_judgment(body: JudgmentCreate, request: Request) -> dict[str, Any]:
    """Record one A/B preference (stored durably before the 201)."""
    return _service(request).record(body)


@router.get("/v1/judgments")
def list_judgments(request: Request, after: str | None = Query(None, max_length=20),
                   limit: int = Query(100, ge=1, le=MAX_PAGE),
                   order: Literal["asc", "desc"] = Query("asc")) -> dict[str, Any]:
    """Judgments oldest first (``order=desc``: newest first), ``limit`` per page; pass the page's ``last_id``
    as ``after`` for the next."""
    return _service(request).page(after=None if after is None else _judgment_id(after), limit=limit,
                                  newest_first=order == "desc")


@router.get("/v1/judgments/export")
def export_judgments(request: Request) -> StreamingResponse:
    """Every judgment as JSONL (one canonical JSON object per line), oldest first."""
    service = _service(request)
    return StreamingResponse(service.export_lines(), media_type="application/x-ndjson",
                             headers={"Content-Disposition": 'attachment; filename="judgments.jsonl"'})


@router.get("/v1/judgments/{judgment_id}")
def get_judgment(judgment_id: JudgmentId, request: Request) -> dict[str, Any]:
    return _service(request).store.get(_judgment_id(judgment_id))


@router.post("/v1/judgments/train", status_code=202)
def train_judge(body: JudgeTrainRequest, request: Request) -> dict[str, Any]:
    """Queue an SFT job that trains a judge adapter on the stored judgments (preference format, both orders)."""
    require_experimental(get_state(request), "training")
    out = _service(request).train(body)
    out["job"] = request.app.state.redact_paths(out["job"])
    return out


@router.post("/v1/judgments/compare")
def compare(body: CompareRequest, request: Request) -> dict[str, Any]:
    """P(response_a is better) from a judge's logprobs of ``A`` and ``B`` (both orders averaged)."""
    return _service(request).compare(body)
