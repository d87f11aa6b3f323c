"""The training worker's start-up warm-up (kiln.training.core.warmup): it fills the caches a first job reads
(the default KL-to-base anchor, the locality probe set) on the served model, leaves no adapter behind, is off
when asked, and its state reaches GET /v1/train/status."""

from __future__ import annotations

import pytest

from kiln.training.core.warmup import WARM_UP_ADAPTER, WarmUp


def test_off_does_nothing_and_says_so():
    w = WarmUp(enabled=False)
    w.run(engine=None, loaded=None, locality=None)  # never touches the engine
    assert w.status() == {"state": "off", "seconds": {}}


def test_a_failure_is_recorded_not_raised():
    class Broken:
        def peft_model(self):
            raise RuntimeError("no model here")

    import torch

    class Loaded:
        model = torch.nn.ModuleDict({"q_proj": torch.nn.Linear(2, 2)})

    w = WarmUp(enabled=True)
    w.run(Broken(), Loaded(), None)
    st = w.status()
    assert st["state"] == "failed" and "RuntimeError: no model here" in st["error"], st
    w.run(Broken(), Loaded(), None)  # once only
    assert w.status() == st


def test_warm_up_fills_the_caches_a_first_job_reads(builtin_model_dir):
    from kiln.config import LocalitySettings
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.loader import load_model
    from kiln.training.core import anchor as anchor_mod
    from kiln.training.core import locality as locality_mod
    from kiln.training.core.anchor import AnchorSettings, model_anchor

    loaded = load_model(builtin_model_dir)
    engine = Engine(loaded, EngineConfig(max_running_rows=4, max_model_len=256)).start()
    try:
        anchor_mod._CACHE.clear()
        locality_mod._CACHE.clear()
        w = WarmUp(enabled=True)
        w.run(engine, loaded, LocalitySettings())
        st = w.status()
        assert st["state"] == "done", st
        assert set(st["seconds"]) == {"imports", "adapter", "anchor", "probes"}
        key = (loaded.base_model_sha256, *AnchorSettings().build_key())
        assert len(anchor_mod._CACHE[key]) > 0  # the default anchor's rows, as a job with the defaults keys them
        assert len(locality_mod._CACHE) == 1  # the probe set with the server's settings and no user probes
        peft_model = engine.peft_model()
        assert WARM_UP_ADAPTER not in peft_model.peft_config  # the throwaway adapter is gone
        # a job's look-up finds the warm-up's rows: nothing is built again
        built = []
        rows = anchor_mod._CACHE[key]
        orig = anchor_mod.anchor_rows
        anchor_mod.anchor_rows = lambda *a, **k: built.append(1) or orig(*a, **k)  # type: ignore[assignment]
        try:
            with engine.ownership.exclusive():
                got = model_anchor(peft_model, loaded, AnchorSettings())
        finally:
            anchor_mod.anchor_rows = orig  # type: ignore[assignment]
        assert built == [] and got.rows == rows
        # chats still work after the warm-up
        from kiln.runtime.sampling import SamplingParams

        prompt = engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        assert engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0))[0].token_ids
    finally:
        engine.stop()


def test_the_status_schema_carries_the_warm_up():
    from kiln.serving.protocol import TrainingStatus

    st = {"enabled": True, "worker_alive": True, "running": None, "queued": [], "queue_max": 4, "recent": [],
          "warm_up": WarmUp(enabled=False).status()}
    assert TrainingStatus.model_validate(st).warm_up == {"state": "off", "seconds": {}}


@pytest.mark.slow  # a server start and a correction (~60 s on the loaded 2-core machine); the cache test above
def test_status_reports_the_warm_up(builtin_model_dir, tmp_path):  # proves the warm-up in the default lane
    import shutil

    from kiln.demo import wait_job
    from kiln.runtime.builtin import BUILTIN_NAME
    from tests.zygote import kiln_server

    shutil.copytree(builtin_model_dir, tmp_path / "models" / BUILTIN_NAME)
    with kiln_server(tmp_path, extra_env={"KILN_TRAINING_WARM_UP": "1"}) as server:
        c = server.client
        import time

        deadline = time.monotonic() + 120
        while (w := c.get("/v1/train/status").json()["warm_up"])["state"] in ("pending", "running"):
            assert time.monotonic() < deadline, w
            time.sleep(0.1)
        assert w["state"] == "done" and w["seconds"]["anchor"] > 0, w
        body = {"adapter": "heron", "auto_load": True, "examples": [{"messages": [
            {"role": "user", "content": "Which bird guards the old mill?"},
            {"role": "assistant", "content": "The old mill is guarded by a heron."}]}]}
        job = wait_job(c, c.post("/v1/train/sft", json=body).json()["id"])
        assert job["state"] == "succeeded", job.get("error")
        assert job["result"]["activated"] is True and job["result"]["report"]["learned"] is True
