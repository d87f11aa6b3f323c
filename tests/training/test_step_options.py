"""Step options through the training service: they are part of the plan, so resuming a job with a
changed option is refused before queueing, naming the option; the checkpoint records them too."""

from __future__ import annotations

import pytest

from kiln.errors import KilnError
from kiln.training.schemas import SFTRequest
from tests.training import test_service as _service_tests

service = _service_tests.service  # the same real engine + training service fixture (module scope here)
_until = _service_tests._until


def _sft(**kw):
    examples = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                for q, a in [("Hi?", "Hello there, friend."),
                             ("Tell me about the planets.", ("Mercury, Venus, Earth and Mars are rocky; Jupiter and "
                                                             "Saturn are gas giants; Uranus and Neptune are ice giants.")),
                             ("2+2?", "Four.")]]
    return SFTRequest.model_validate({"adapter": "opts", "examples": examples, "batch_size": 3,
                                      "checkpoint_interval": 2} | kw)


def test_resume_with_a_changed_step_option_is_refused(service):
    from kiln.training.core.checkpoints import latest_checkpoint

    svc = service.trainer
    plan = svc.prepare(_sft(epochs=400))
    assert plan.request["packing"] is True and plan.request["gradient_checkpointing"] is False
    other = svc.prepare(_sft(epochs=400, gradient_checkpointing=True))
    assert other.plan_sha256 != plan.plan_sha256  # the option is part of the plan's identity

    job = svc.submit(_sft(epochs=400))
    _until(lambda: (svc.job(job["id"])["progress"].get("checkpoint_step") or 0) >= 2)
    progress = svc.job(job["id"])["progress"]
    assert progress["padded_positions_saved"] > 0  # three rows of different lengths: packed
    svc.cancel(job["id"])
    _until(lambda: svc.job(job["id"])["state"] == "cancelled")

    for changed, text in (({"gradient_checkpointing": True}, "gradient_checkpointing: False -> True"),
                          ({"packing": False}, "packing: True -> False")):
        with pytest.raises(KilnError) as info:
            svc.submit(_sft(epochs=400, resume_from_job=job["id"], **changed))
        assert (info.value.status, info.value.code) == (409, "resume_plan_mismatch")
        assert text in str(info.value), str(info.value)

    ckpt = latest_checkpoint(svc._checkpoint_root(job["id"]), plan_sha256=plan.plan_sha256)
    assert ckpt.stats["step_options"] == {"packing": True, "gradient_checkpointing": False, "compile": False}
    resumed = svc.submit(_sft(epochs=400, resume_from_job=job["id"]))
    _until(lambda: "resumed_from_step" in svc.job(resumed["id"])["progress"])
    svc.cancel(resumed["id"])
    _until(lambda: svc.job(resumed["id"])["state"] == "cancelled")
