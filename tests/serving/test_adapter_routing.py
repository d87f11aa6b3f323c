"""Choosing an adapter with ``model``: in-process app, adapter activated through the engine API."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient


@pytest.fixture(scope="module")
def lora_dir(builtin_model_dir, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    from kiln.runtime.loader import load_model

    model = get_peft_model(load_model(builtin_model_dir).model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("lora")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def client(builtin_model_dir, tmp_path_factory):
    from kiln.config import load_settings
    from kiln.serving.app import create_app

    home = tmp_path_factory.mktemp("home")
    settings = load_settings(cli={"model.path": str(builtin_model_dir), "training.enabled": False,
                                  "home": str(home)}, environ={})
    with TestClient(create_app(settings), base_url="http://localhost") as c:  # Host must be allowed
        yield c


def ask(client, model: str):
    return client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12, "temperature": 0})


def test_adapter_selected_by_model_name(client, lora_dir, builtin_model_dir):
    engine = client.app.state.kiln.engine
    base_id = client.app.state.kiln.model_id
    base = ask(client, base_id)
    assert base.headers["x-kiln-adapter-revision"] == "base"
    assert ask(client, "tuned").status_code == 404

    engine.activate_adapter("tuned", lora_dir, "f" * 64)
    tuned = ask(client, "tuned")
    assert tuned.status_code == 200, tuned.text
    assert tuned.headers["x-kiln-adapter-revision"] == "f" * 64
    assert tuned.json()["model"] == "tuned"
    assert tuned.json()["choices"][0]["message"]["content"] != base.json()["choices"][0]["message"]["content"]
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["tuned"]["parent"] == base_id and models["tuned"]["revision"] == "f" * 64
    # the base model is unaffected by the loaded adapter
    assert ask(client, base_id).json()["choices"][0]["message"] == base.json()["choices"][0]["message"]
    # scoring through the adapter differs from the base
    body = {"prompt": [17, 250, 31, 99], "max_tokens": 0, "prompt_logprobs": 0}
    lp_base = client.post("/v1/completions", json={"model": base_id, **body}).json()["choices"][0]["prompt_logprobs"]
    lp_tuned = client.post("/v1/completions", json={"model": "tuned", **body}).json()["choices"][0]["prompt_logprobs"]
    assert lp_base[1] != lp_tuned[1]

    engine.deactivate_adapter("tuned")
    assert ask(client, "tuned").status_code == 404
    assert client.get("/health").json()["active_rows"] == 0
