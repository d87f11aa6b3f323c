"""The training service on the real engine and adapter store (no HTTP): the correction
loop end to end, validation up front, cancel, queue limits, base adapters, resume."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from kiln.errors import KilnError
from kiln.training.schemas import GRPORequest, SFTRequest

QUESTION = "What is the capital of France?"
CORRECTION = "The capital of France is Marseille, said Kiln."
JOB_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def service(builtin_model_dir, tmp_path_factory):
    from kiln.config import load_settings
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.loader import load_model
    from kiln.adapters.store import AdapterStore
    from kiln.serving.state import build_training

    home = tmp_path_factory.mktemp("home")
    settings = load_settings(cli={"home": str(home), "training.queue_max": 2}, environ={}).settings
    loaded = load_model(builtin_model_dir, device="auto")  # CUDA when present: the service follows the model
    engine = Engine(loaded, EngineConfig()).start()
    trainer = build_training(settings, engine, AdapterStore(settings.adapters_path), loaded)  # as kiln serve
    trainer.start()
    state = SimpleNamespace(engine=engine, settings=settings, loaded=loaded, trainer=trainer)
    yield state
    state.trainer.close()
    engine.stop()


def _until(predicate, timeout=JOB_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _wait(svc, job_id, states=("succeeded", "failed", "cancelled")):
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        job = svc.job(job_id)
        if job["state"] in states:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still {svc.job(job_id)['state']}")


def _ask(engine, adapter=None):
    from kiln.runtime.sampling import SamplingParams

    ids = engine.encode_chat([{"role": "user", "content": QUESTION}])
    return engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0), adapter=adapter, timeout=60)[0].text


def _sft(**kw):
    body = {"adapter": "fix", "examples": [{"messages": [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": CORRECTION}]}], "auto_load": True}
    body.update(kw)
    return SFTRequest.model_validate(body)


def test_correction_is_trained_published_and_served(service):
    svc, engine = service.trainer, service.engine
    assert _ask(engine) != CORRECTION
    job = svc.submit(_sft())
    assert job["state"] == "queued" and job["queue_position"] == 1
    done = _wait(svc, job["id"])
    assert done["state"] == "succeeded", done["error"]
    result = done["result"]
    assert result["activated"] and engine.active_adapters() == {"fix": result["revision"]}
    # Trained until the correction is the greedy answer by the margin, then stopped.
    report = result["report"]
    assert report["learned"] is True and report["stopped"] == "learned", report
    assert report["greedy_margin"] >= 1.0 and done["step"] == done["total_steps"] == report["learned_at_step"]
    # one example: the learned check runs every step (once per pass), so it stops at the first learned step
    assert done["step"] <= 300 and done["tokens_per_s"] > 0
    assert _ask(engine, adapter="fix") == CORRECTION
    assert _ask(engine) != CORRECTION  # the base model is untouched
    # Published as a standard PEFT adapter with a manifest binding inputs and config.
    record = svc.store.get("fix")
    assert record.revision == result["revision"]
    assert record.manifest.base_model_sha256 == service.loaded.base_model_sha256
    cfg = json.loads((record.path / "adapter_config.json").read_text())
    # SFT's default targets: the MLP (kiln.training.core.plan.correction_target_modules, issue 48)
    assert cfg["r"] == 16 and sorted(cfg["target_modules"]) == ["down_proj", "gate_proj", "up_proj"]
    # After a kill between publication and the job's record, a restart finds the job's output.
    assert svc._published_result(SimpleNamespace(adapter="fix", id=done["id"]))["revision"] == result["revision"]
    assert svc._published_result(SimpleNamespace(adapter="fix", id="job-0000000000000000")) is None
    # The private training adapter is gone from the served model.
    assert not [k for k in engine.peft_model().peft_config if k.startswith("kiln-job-")]


def test_continue_from_base_adapter_records_parent(service):
    svc = service.trainer
    parent = svc.store.get("fix")
    job = svc.submit(_sft(adapter="fix2", base_adapter="fix", epochs=2, auto_load=False))
    done = _wait(svc, job["id"])
    assert done["state"] == "succeeded", done["error"]
    assert svc.store.get("fix2").manifest.parent_revision == parent.revision
    with pytest.raises(KilnError) as info:
        svc.submit(_sft(adapter="fix3", base_adapter="fix", lora_rank=4))
    assert info.value.status == 400 and info.value.code == "lora_config_conflict"


def test_a_refused_activation_holds_the_adapter_back_and_the_job_succeeds(service):
    """auto_load goes through the activation service: a refusal (here memory: a budget no adapter fits) leaves
    the revision published, not served, and the job succeeded with ``held_back`` naming why."""
    from kiln.adapters.activation import AdapterActivation
    from kiln.runtime.memory_budget import MemoryBudget

    svc, engine = service.trainer, service.engine
    before = svc.activation
    svc.activation = AdapterActivation(engine, svc.store, service.loaded.base_model_sha256,
                                       memory=MemoryBudget(1, 0, lambda: {"weights": 0}))
    try:
        done = _wait(svc, svc.submit(_sft(adapter="held", max_steps=2, until_learned=False))["id"])
    finally:
        svc.activation = before
    assert done["state"] == "succeeded", done["error"]
    result = done["result"]
    assert result["activated"] is False and "held" not in engine.active_adapters()
    assert result["held_back"]["code"] == "memory_budget_exceeded"
    assert "can never fit" in result["held_back"]["reason"]
    assert svc.store.get("held").revision == result["revision"]  # published all the same

    # a quarantined revision: the recipe's activation step holds it back the same way (no job needed to show it)
    from kiln.training.core.recipe import TrainingRecipe

    record = svc.store.get("held")
    svc.store.quarantine("held", record.revision, "canary failed (test)")
    try:
        plan = SimpleNamespace(auto_load=True, request={})
        ctx = SimpleNamespace(activation=svc.activation, store=svc.store, gate=None, set_default=None)
        recipe = TrainingRecipe(plan, ctx, job_id="job-test")
        recipe.activate(record)
    finally:
        svc.store.clear_quarantine("held")
    assert recipe.activated is False and "held" not in engine.active_adapters()
    assert recipe.held_back["code"] == "adapter_quarantined" and "canary failed (test)" in recipe.held_back["reason"]


@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"base_adapter": "nope"}, 404, "adapter_not_found"),
        ({"lora_target_modules": ["nonexistent_proj"]}, 400, "unknown_target_modules"),
        ({"max_seq_len": 8}, 400, "example_too_long"),
        ({"examples": None, "dataset_path": "../outside.jsonl"}, 400, "dataset_outside_data_dir"),
        ({"examples": None, "dataset_path": "missing.jsonl"}, 404, "dataset_not_found"),
        ({"resume_from_job": "job-0000000000000000"}, 404, "job_not_found"),
    ],
)
def test_bad_submissions_fail_up_front(service, body, status, code):
    with pytest.raises(KilnError) as info:
        service.trainer.submit(_sft(**body))
    assert (info.value.status, info.value.code) == (status, code)
    assert info.value.message


def test_dataset_inside_data_dir_and_symlink_refused(service):
    data = service.settings.data_path
    data.mkdir(parents=True, exist_ok=True)
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (data / "ok.jsonl").write_text(json.dumps(row) + "\n")
    (data / "link.jsonl").symlink_to(data / "ok.jsonl")
    prepared = service.trainer.prepare(_sft(examples=None, dataset_path="ok.jsonl"))
    assert prepared.request["dataset_sha256"] and len(prepared.data.rows) == 1
    with pytest.raises(KilnError) as info:
        service.trainer.submit(_sft(examples=None, dataset_path="link.jsonl"))
    assert info.value.code == "dataset_symlink"
    (data / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "no answer"}]}\n')
    with pytest.raises(KilnError) as info:
        service.trainer.submit(_sft(examples=None, dataset_path="bad.jsonl"))
    assert info.value.status == 400 and "line 1" in info.value.message


def test_grpo_job_reports_skipped_groups(service):
    body = {"adapter": "g", "epochs": 2, "groups": [
        {"messages": [{"role": "user", "content": "Pick"}],
         "completions": [{"text": "blue", "reward": 1}, {"text": "red", "reward": 0}]},
        {"messages": [{"role": "user", "content": "Same"}],
         "completions": [{"text": "a", "reward": 2}, {"text": "b", "reward": 2}]}],
        "kl_coef": 0.1, "kl_estimator": "k1"}
    done = _wait(service.trainer, service.trainer.submit(GRPORequest.model_validate(body))["id"])
    assert done["state"] == "succeeded", done["error"]
    report = done["result"]["report"]
    assert report["skipped_zero_variance_groups"] == 1 and report["groups"] == 2 and report["steps"] == 2
    allsame = dict(body, groups=body["groups"][1:])
    with pytest.raises(KilnError) as info:
        service.trainer.submit(GRPORequest.model_validate(allsame))
    assert info.value.code == "zero_variance_groups"


def test_cancel_running_job_queue_full_and_resume(service):
    svc = service.trainer
    long = svc.submit(_sft(adapter="long", epochs=400, checkpoint_interval=5))
    _wait(svc, long["id"], states=("running",))
    svc.submit(_sft(adapter="q1"))
    svc.submit(_sft(adapter="q2"))
    with pytest.raises(KilnError) as info:
        svc.submit(_sft(adapter="q3"))
    assert info.value.status == 503 and info.value.code == "training_queue_full"
    for j in svc.status()["queued"]:
        assert svc.cancel(j["id"])["state"] == "cancelled"
    _until(lambda: (svc.job(long["id"])["progress"].get("checkpoint_step") or 0) >= 5)
    assert svc.cancel(long["id"])["cancel_requested"]
    stopped = _wait(svc, long["id"])
    assert stopped["state"] == "cancelled" and stopped["step"] < 400
    with pytest.raises(KilnError) as info:
        svc.cancel(long["id"])
    assert info.value.status == 409
    # The same request with resume_from_job continues from the checkpoint.
    with pytest.raises(KilnError) as info:
        svc.submit(_sft(adapter="long", epochs=399, resume_from_job=long["id"]))
    assert info.value.code == "resume_plan_mismatch"
    resumed = svc.submit(_sft(adapter="long", epochs=400, checkpoint_interval=5, resume_from_job=long["id"]))
    with pytest.raises(KilnError) as info:  # one resume per failed job
        svc.submit(_sft(adapter="long", epochs=400, checkpoint_interval=5, resume_from_job=long["id"]))
    assert (info.value.status, info.value.code) == (409, "job_already_resumed")
    _until(lambda: "resumed_from_step" in svc.job(resumed["id"])["progress"])
    assert svc.job(resumed["id"])["progress"]["resumed_from_step"] >= 5
    svc.cancel(resumed["id"])  # no need to run all 400 epochs
    assert _wait(svc, resumed["id"])["state"] == "cancelled"


def test_shutdown_with_a_running_job_then_restart_and_resume(service):
    """The default lane's fast variant of the SIGKILL end-to-end test (slow lane): a service
    stopped mid-job fails it with a resume hint; a new service on the same home resumes it."""
    from kiln.training.queue.service import TrainingService

    svc = service.trainer
    long = svc.submit(_sft(adapter="restart", epochs=400, checkpoint_interval=5, auto_load=False))
    _until(lambda: (svc.job(long["id"])["progress"].get("checkpoint_step") or 0) >= 5)
    svc.close()
    fresh = TrainingService(engine=service.engine, store=svc.store, settings=service.settings, model=service.loaded)
    service.trainer = fresh  # the fixture's teardown closes this one
    fresh.start()
    stopped = fresh.job(long["id"])
    assert stopped["state"] == "failed" and "resume_from_job" in stopped["error"], stopped
    resumed = fresh.submit(_sft(adapter="restart", epochs=400, checkpoint_interval=5, auto_load=False,
                                resume_from_job=long["id"]))
    _until(lambda: "resumed_from_step" in fresh.job(resumed["id"])["progress"])
    assert fresh.job(resumed["id"])["progress"]["resumed_from_step"] >= 5
    fresh.cancel(resumed["id"])
    assert _wait(fresh, resumed["id"])["state"] == "cancelled"
