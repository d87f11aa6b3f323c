"""Training a user's own model: a chat template without `{% generation %}` markers (like Qwen3's
or Llama 3's) and a config whose `max_position_embeddings` is below Kiln's configured length.
The model is a copy of the built-in one with such a template, built offline."""

from __future__ import annotations

import json
import shutil
import time
from types import SimpleNamespace

import pytest

from kiln.training.schemas import GRPORequest, SFTExample, SFTRequest

# ChatML as Qwen-family templates render it, with no generation markers.
MARKERLESS_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MODEL_MAX = 1024
QUESTION = "What is the colour of the sky on Kiln?"
CORRECTION = "The sky on Kiln is green."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Hello again."}]


@pytest.fixture(scope="module")
def user_model_dir(builtin_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("user-model") / "my-model"
    shutil.copytree(builtin_model_dir, out)
    (out / "chat_template.jinja").write_text(MARKERLESS_TEMPLATE)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = MODEL_MAX
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _tok(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_turn_by_turn_spans_equal_the_generation_markers(builtin_model_dir):
    from kiln.training.core.templates import assistant_tokens, assistant_tokens_by_diff, has_generation_markers

    tok = _tok(builtin_model_dir)
    assert has_generation_markers(tok)
    end = {tok.eos_token_id}
    for chat in (CHAT, CHAT[1:3]):
        assert assistant_tokens_by_diff(tok, chat, end_ids=end) == assistant_tokens(tok, chat, end_ids=end)


def test_markerless_template_masks_each_assistant_turn(user_model_dir):
    from kiln.training.core.data import tokenize_sft
    from kiln.training.core.templates import has_generation_markers

    tok = _tok(user_model_dir)
    assert not has_generation_markers(tok)
    (row,) = tokenize_sft(tok, [SFTExample.model_validate({"messages": CHAT})], max_seq_len=512,
                          end_ids={tok.eos_token_id})
    masked = [t if m else None for t, m in zip(row.input_ids, row.loss_mask)]
    runs = "".join(tok.decode([t]) if t is not None else "\0" for t in masked).split("\0")
    assert [r for r in runs if r] == ["Hello there.<|im_end|>", "Hello again.<|im_end|>"]
    assert row.input_ids == list(tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"])


@pytest.fixture(scope="module")
def service(user_model_dir, tmp_path_factory):
    from kiln.config import load_settings
    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.loader import load_model
    from kiln.adapters.store import AdapterStore
    from kiln.serving.state import build_training

    home = tmp_path_factory.mktemp("home")
    settings = load_settings(cli={"home": str(home)}, environ={}).settings
    loaded = load_model(user_model_dir, device="auto")
    engine = Engine(loaded, EngineConfig()).start()
    trainer = build_training(settings, engine, AdapterStore(settings.adapters_path), loaded)  # as kiln serve
    trainer.start()
    state = SimpleNamespace(engine=engine, settings=settings, loaded=loaded, trainer=trainer)
    yield state
    state.trainer.close()
    engine.stop()


def _wait(svc, job_id, timeout=120.0):
    deadline = time.monotonic() + timeout
    while (job := svc.job(job_id))["state"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']}"
        time.sleep(0.05)
    return job


def _ask(engine, adapter=None):
    from kiln.runtime.sampling import SamplingParams

    ids = engine.encode_chat([{"role": "user", "content": QUESTION}])
    return engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0), adapter=adapter, timeout=60)[0].text


def test_loader_reports_the_model_length_limit(service):
    assert service.loaded.max_model_len == MODEL_MAX
    assert service.loaded.info.effective_max_model_len(2048) == MODEL_MAX
    assert service.loaded.info.effective_max_model_len(512) == 512


def test_sft_on_markerless_model_learns_and_serves(service):
    svc, engine = service.trainer, service.engine
    assert _ask(engine) != CORRECTION
    body = {"adapter": "sky", "auto_load": True, "max_seq_len": 2048, "examples": [{"messages": [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": CORRECTION}]}]}
    job = svc.submit(SFTRequest.model_validate(body))
    done = _wait(svc, job["id"])
    assert done["state"] == "succeeded", done["error"]
    assert done["result"]["report"]["learned"] is True
    assert _ask(engine, adapter="sky") == CORRECTION
    assert svc.store.get("sky").manifest.config["max_seq_len"] == MODEL_MAX  # capped at the model's limit


def test_example_longer_than_the_model_is_refused(service):
    from kiln.errors import KilnError

    long = " ".join(f"w{i}" for i in range(1500))
    body = {"adapter": "long", "max_seq_len": 4096, "examples": [{"messages": [
        {"role": "user", "content": long}, {"role": "assistant", "content": "ok"}]}]}
    with pytest.raises(KilnError) as info:
        service.trainer.submit(SFTRequest.model_validate(body))
    assert info.value.code == "example_too_long" and f"max_seq_len is {MODEL_MAX}" in info.value.message


def test_grpo_on_markerless_model(service):
    body = {"adapter": "g", "epochs": 3, "groups": [
        {"messages": [{"role": "user", "content": "Pick a colour"}],
         "completions": [{"text": "blue", "reward": 1}, {"text": "red", "reward": 0}]}]}
    done = _wait(service.trainer, service.trainer.submit(GRPORequest.model_validate(body))["id"])
    assert done["state"] == "succeeded", done["error"]
    assert done["result"]["report"]["steps"] == 3


def test_demo_loop_on_markerless_model(user_model_dir, tmp_path):
    from kiln.demo import run_correction
    from tests.zygote import kiln_server

    lines: list[str] = []
    with kiln_server(tmp_path / "home", extra_env={"KILN_MODEL_PATH": str(user_model_dir)}) as server:
        run_correction(server.client, question=QUESTION, correction=CORRECTION, adapter="demo-fix",
                       echo=lines.append)
        # Serving is capped at the model's own length too, and says so.
        effective = server.client.get("/v1/config").json()["effective"]
        assert effective["max_model_len"] == effective["model_max_position_embeddings"] == MODEL_MAX
        card = server.client.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == MODEL_MAX
        too_long = server.client.post("/v1/completions", json={"model": card["id"], "prompt": [5] * MODEL_MAX,
                                                                "max_tokens": 1})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    out = "\n".join(lines)
    corrected = [line for line in lines if line.startswith("\nQ: ") and line.count("\n") == 2
                 and line.split("\n")[2].startswith("A (demo-fix @ ")]
    assert "warning" not in out and corrected and corrected[0].endswith(CORRECTION), out
    assert any(line.startswith("locality: ") for line in lines), out
