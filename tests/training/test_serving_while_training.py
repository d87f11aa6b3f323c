"""A real `kiln serve` with a job training while chats stream: the job's steps are sliced into bounded holds, the
pacer leaves serving gaps, and GET /v1/train/status and /metrics show serving's latency and the pacing."""

from __future__ import annotations

import shutil
import threading
import time

from kiln.runtime.builtin import BUILTIN_NAME
from tests.zygote import kiln_server

LONG = {"adapter": "long", "epochs": 1000, "until_learned": False, "locality": {"measure": False},
        "examples": [{"messages": [{"role": "user", "content": f"Q{i}"},
                                   {"role": "assistant", "content": f"A long answer number {i} to train on."}]}
                     for i in range(8)]}


def test_chats_during_a_job_slice_its_steps_and_show_in_status(builtin_model_dir, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(builtin_model_dir, home / "models" / BUILTIN_NAME)
    with kiln_server(home) as server:
        c = server.client
        model = c.get("/v1/models").json()["data"][0]["id"]
        job = c.post("/v1/train/sft", json=LONG).json()
        deadline = time.monotonic() + 300
        while int(c.get(f"/v1/train/jobs/{job['id']}").json().get("step") or 0) < 2:
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.05)
        stop = threading.Event()
        errors: list[str] = []

        def chat_loop() -> None:  # back-to-back chats: serving has rows most of the time
            import httpx

            with httpx.Client(base_url=server.url, timeout=120) as cc:
                while not stop.is_set():
                    r = cc.post("/v1/chat/completions", json={"model": model, "max_tokens": 24, "ignore_eos": True,
                                                              "messages": [{"role": "user", "content": "Hi"}]})
                    if r.status_code != 200:
                        errors.append(r.text)
                        return

        clients = [threading.Thread(target=chat_loop) for _ in range(2)]
        for t in clients:
            t.start()
        try:
            while not (c.get(f"/v1/train/jobs/{job['id']}").json().get("progress") or {}).get("sliced_steps"):
                assert time.monotonic() < deadline and not errors, errors or "no step was sliced while chats ran"
                time.sleep(0.1)
            status = c.get("/v1/train/status").json()
        finally:
            stop.set()
            for t in clients:
                t.join(120)
        pacer, serving = status["pacer"], status["serving"]
        assert pacer["serving_share"] == 0.5 and pacer["max_hold_ms"] == 50.0
        assert pacer["hold_cycles"] == 0 and pacer["last_budget_ms"] == 50.0  # the default: max_hold_ms alone
        assert pacer["busy_holds"] > 0 and pacer["longest_busy_hold_s"] > 0 and pacer["holds"] >= pacer["busy_holds"]
        assert serving["itl_count"] > 0 and serving["itl_p99_ms"] >= serving["itl_p50_ms"] > 0
        assert serving["ttft_count"] > 0
        metrics = c.get("/metrics").text
        for name in ("kiln_training_busy_holds", "kiln_training_longest_busy_hold_seconds", "kiln_training_yields",
                     "kiln_training_serving_share 0.5", "kiln_training_max_hold_milliseconds 50.0",
                     "kiln_training_hold_cycles 0.0"):
            assert name in metrics, name
        assert c.delete(f"/v1/train/queue/{job['id']}").status_code == 200
