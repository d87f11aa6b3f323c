"""Wire model for ``POST /v1/train/kd`` (pydantic only; no torch).

Bounded here; what needs the capture run, the served model or the ledger (the
run existing under the data dir, its plan binding this model and tokenizer,
shards left to consume) is checked in :func:`kiln.training.kd.job.prepare_kd`
before the job is queued.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from kiln.training.schemas import MAX_PATH_CHARS, _TrainCommon


class KDRequest(_TrainCommon):
    run: str = Field(min_length=1, max_length=MAX_PATH_CHARS,
                     description="a capture run root (`kiln distill capture --out`), relative to the data dir")
    ce_weight: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False,
                             description="weight of CE on the captured target (teacher-expert captures only)")
    kd_weight: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False,
                             description="weight of the coarse-tail forward KL to the captured teacher")
    replay: bool = Field(False, description="consume shards this adapter already committed once more, as "
                                            "chained replays (only when the capture's plan says replay: chained)")
    learning_rate: float = Field(1e-3, gt=0, le=1.0)
    batch_size: int = Field(8, ge=1, le=256, description="captured sequences (windows) per optimizer step")

    @model_validator(mode="after")
    def _checks(self) -> "KDRequest":
        if self.max_steps is not None:
            raise ValueError("max_steps is not supported for kd jobs: a kd job trains whole shards (each one is "
                             "reserved, trained and committed through the ledger); use epochs")
        if self.checkpoint_interval:
            raise ValueError("checkpoint_interval is not supported for kd jobs: they write a durable checkpoint "
                             "after every shard (the one its ledger commit names)")
        if self.post_eval is not None:
            raise ValueError("post_eval is not supported for kd jobs yet")
        if self.ce_weight == 0 and self.kd_weight == 0:
            raise ValueError("ce_weight and kd_weight are both 0; nothing to learn")
        return self
