"""Restart rules: queued runs are queued again in admission order; interrupted runs fail explicitly."""

from __future__ import annotations

import json

from kiln.canonical import atomic_write_json
from kiln.config import AdapterSettings, Settings
from kiln.openenv.schemas import OpenEnvRunRequest
from kiln.openenv.service import OpenEnvService, runs_root


def _rec(run_id, state, seq):
    req = OpenEnvRunRequest(env_url="http://127.0.0.1:9", training={"adapter": "a"})
    return {"id": run_id, "object": "openenv.run", "state": state, "admission_seq": seq, "created_at": 0.0,
            "started_at": None, "finished_at": None, "request": req.model_dump(mode="json"), "training_contract": {},
            "environment": None, "progress": {"episodes_done": 0}, "returns": None, "terminations": {},
            "training_job": None, "error": None}


def test_restart_requeues_queued_and_fails_interrupted(tmp_path):
    settings = Settings(home=str(tmp_path), adapters=AdapterSettings(dir=str(tmp_path / "adapters")))
    root = runs_root(settings)
    runs = [("oerun-" + "b" * 16, "queued", 3), ("oerun-" + "a" * 16, "queued", 2),
            ("oerun-" + "c" * 16, "collecting", 1), ("oerun-" + "d" * 16, "succeeded", 0)]
    for run_id, state, seq in runs:
        atomic_write_json(root / run_id / "run.json", _rec(run_id, state, seq))
    (root / "oerun-eeeeeeeeeeeeeeee").mkdir()
    (root / "oerun-eeeeeeeeeeeeeeee" / "run.json").write_text("{not json")
    service = OpenEnvService(engine=None, trainer=None, settings=settings)  # workers not started
    listed = {r["id"]: r for r in service.list()}
    assert len(listed) == 4
    assert listed["oerun-" + "a" * 16]["queue_position"] == 1 and listed["oerun-" + "b" * 16]["queue_position"] == 2
    interrupted = listed["oerun-" + "c" * 16]
    assert interrupted["state"] == "failed" and interrupted["error"]["code"] == "interrupted"
    on_disk = json.loads((root / ("oerun-" + "c" * 16) / "run.json").read_text())
    assert on_disk["state"] == "failed"
    assert listed["oerun-" + "d" * 16]["state"] == "succeeded"
    cancelled = service.cancel("oerun-" + "a" * 16)
    assert cancelled["state"] == "cancelled" and service.get("oerun-" + "b" * 16)["queue_position"] == 1
