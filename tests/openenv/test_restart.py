"""Restart rules: queued runs are queued again in admission order; interrupted runs fail explicitly; recovery
happens when the server starts and shutdown joins the workers."""

from __future__ import annotations

import json
import time

import httpx

from kiln.canonical import atomic_write_json
from kiln.config import AdapterSettings, Settings
from kiln.openenv.schemas import OpenEnvRunRequest
from kiln.openenv.service import OpenEnvService, runs_root
from tests.serving.conftest import start_server, stop_server


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


def test_close_joins_every_worker_and_keeps_queued_runs(tmp_path):
    settings = Settings(home=str(tmp_path), adapters=AdapterSettings(dir=str(tmp_path / "adapters")),
                        openenv={"max_active_runs": 3})
    service = OpenEnvService(engine=None, trainer=None, settings=settings)
    service.start()
    assert all(t.is_alive() for t in service._threads) and len(service._threads) == 3
    assert service.close(join_s=10) == []
    assert not any(t.is_alive() for t in service._threads)


def test_recovery_runs_at_server_start_and_shutdown_interrupts(builtin_model_dir, tmp_path, env_servers):
    """Restart recovery happens when `kiln serve` starts (no /v1/openenv request first); a run in flight at
    shutdown is recorded as interrupted and the server exits."""
    home = tmp_path / "home"
    root = home / "adapters" / ".openenv" / "runs"
    interrupted, queued = "oerun-" + "1" * 16, "oerun-" + "2" * 16
    atomic_write_json(root / interrupted / "run.json", _rec(interrupted, "training", 1))
    atomic_write_json(root / queued / "run.json", _rec(queued, "queued", 2))  # env_url: nobody serves port 9
    cfg = tmp_path / "kiln.toml"
    cfg.write_text("[openenv]\nexchange_timeout_s = 10.0\n")
    server = start_server(builtin_model_dir, home, extra_args=[], env_extra={}, config=cfg)
    try:
        on_disk = json.loads((root / interrupted / "run.json").read_text())
        assert on_disk["state"] == "failed" and on_disk["error"]["code"] == "interrupted"
        deadline = time.monotonic() + 60
        while json.loads((root / queued / "run.json").read_text())["state"] not in ("failed", "succeeded"):
            assert time.monotonic() < deadline, "the recovered queued run was not executed"
            time.sleep(0.2)
        ran = json.loads((root / queued / "run.json").read_text())
        assert ran["error"]["code"] in ("environment_unavailable", "training_disabled"), ran["error"]
        assert ran["started_at"] is not None
        # a run in flight at shutdown: many long episodes on the counter environment
        body = {"env_url": env_servers["counter"], "groups": 64, "group_size": 8, "max_steps": 32,
                "training": {"adapter": "oe-shutdown"}}
        run = httpx.post(f"{server.base_url}/v1/openenv/runs", json=body, timeout=60).json()
        while httpx.get(f"{server.base_url}/v1/openenv/runs/{run['id']}", timeout=10).json()["state"] != "collecting":
            assert time.monotonic() < deadline + 60
            time.sleep(0.1)
    finally:
        rc = stop_server(server)
    assert rc == 0, server.log()
    after = json.loads((root / run["id"] / "run.json").read_text())
    assert after["state"] == "failed" and after["error"]["code"] == "interrupted", after
    assert after["artifacts"] is None and after["training_job"] is None
