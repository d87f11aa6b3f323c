"""The judgment workflow: record A/B preferences, train a judge adapter on them, ask a judge.

:class:`JudgmentService` owns the :class:`~kiln.judgments.store.JudgmentStore` and reaches the serving
engine (to score with a judge) and the training service (to queue the judge's SFT job); the routes in
:mod:`kiln.serving.routes_judgments` are a thin layer over it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from pydantic import ValidationError

from kiln.canonical import canonical_json_bytes
from kiln.errors import Conflict, InvalidRequest, Unavailable
from kiln.evals.judge_preference import preferences, served_judge_revision
from kiln.judgments import format as fmt
from kiln.judgments.schemas import CompareRequest, JudgeTrainRequest, JudgmentCreate
from kiln.judgments.store import FILE_NAME, JudgmentStore

if TYPE_CHECKING:
    from kiln.config import Settings
    from kiln.training.queue.service import TrainingService

MIN_TRAIN_JUDGMENTS = 2


class JudgmentService:
    def __init__(self, *, engine: Any, trainer: TrainingService | None, settings: Settings):
        self.engine = engine
        self.trainer = trainer
        self.store = JudgmentStore(settings.eval_path / FILE_NAME)

    def close(self) -> None:
        self.store.close()

    def record(self, body: JudgmentCreate) -> dict[str, Any]:
        return self.store.add(body.model_dump())

    def page(self, *, after: str | None, limit: int, newest_first: bool = False) -> dict[str, Any]:
        data, more = self.store.page(after=after, limit=limit, newest_first=newest_first)
        return {"object": "list", "data": data, "has_more": more, "last_id": data[-1]["id"] if data else None,
                "total": self.store.count()}

    def export_lines(self) -> Iterator[bytes]:
        """Every judgment as canonical JSON, one per line (JSONL), oldest first."""
        for row in self.store.iter_all():
            yield canonical_json_bytes(row) + b"\n"

    def train(self, body: JudgeTrainRequest) -> dict[str, Any]:
        """Queue an SFT job on the stored judgments in the preference format (each in both orders)."""
        from kiln.training.schemas import SFTRequest

        if self.trainer is None:
            raise Unavailable("training is not enabled on this server", code="training_disabled",
                              hint="start the server with training.enabled = true (KILN_TRAINING_ENABLED=1)")
        rows = self.store.latest_preferences(body.limit)
        if len(rows) < MIN_TRAIN_JUDGMENTS:
            # the store's state, not the request: 409, and the same request succeeds once enough are recorded
            raise Conflict(f"training a judge needs at least {MIN_TRAIN_JUDGMENTS} judgments that prefer a "
                           f"response (ties are not trained on); the store has {len(rows)}",
                           code="too_few_judgments", hint="record more with POST /v1/judgments")
        examples = fmt.training_examples(rows)
        try:
            request = SFTRequest.model_validate({
                "adapter": body.adapter, "examples": examples, "epochs": body.epochs, "max_steps": body.max_steps,
                "learning_rate": body.learning_rate, "lora_rank": body.lora_rank, "seed": body.seed,
                "auto_load": body.auto_load, "scope": "off",  # a judge reads its own prompts: never routed by them
                "locality": None if body.locality is None else body.locality.model_dump(mode="json")})
        except ValidationError as exc:  # e.g. a judge turn over the SFT message limit: the caller's data, a 400
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidRequest(f"the judgments do not fit an SFT request at {where}: {first['msg']}",
                                 code="judgments_not_trainable",
                                 hint="shorten the longest judgments or lower `limit` to leave them out") from None
        job = self.trainer.submit(request)
        return {"object": "judgment.training", "job": job, "judgments": len(rows), "examples": len(examples),
                "judgments_sha256": fmt.judgments_digest(rows), "format": fmt.PREFERENCE_FORMAT}

    def compare(self, body: CompareRequest) -> dict[str, Any]:
        revision = served_judge_revision(self.engine, body.judge, param="judge")
        pref = preferences(self.engine, body.judge, [(body.prompt, body.response_a, body.response_b)])[0]
        return {"object": "judgment.comparison", "judge": body.judge, "judge_revision": revision,
                "p_a": pref.p_first, "preferred": pref.preferred, "orders": list(pref.orders)}
