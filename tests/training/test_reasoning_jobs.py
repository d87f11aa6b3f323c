"""Reasoning through the improvement loop: GRPO rollouts and eval suites on a thinking Qwen3 template.

A scripted Qwen3 (:mod:`tests.scripted_model`: the real Qwen3 tokenizer and template, next token by the last
one alone) answers a thinking prompt with ``<think>banana</think>`` and then `` banana`` or ``apple`` (a tie,
picked by each row's seed), and the ``enable_thinking: false`` prompt with `` banana`` or ``apple`` directly.
So every completion carries the word "banana" in its reasoning and half of them in the answer: a reward
or scorer that read the reasoning would pass them all.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest

from kiln.demo import wait_job
from tests.scripted_model import scripted_qwen3_dir
from tests.serving.conftest import start_server, stop_server

PROMPTS = [{"messages": [{"role": "user", "content": q}], "reference": "banana"}
           for q in ("Name a fruit.", "Which fruit is yellow?")]
GRPO = {"prompts": PROMPTS, "group_size": 8, "iterations": 1, "max_tokens": 8, "batch_size": 8, "seed": 1,
        "learning_rate": 1e-3}
NO_THINK = {"enable_thinking": False}


class _Capture(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict]] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Capture.seen.append(body)
        out = json.dumps({"rewards": [1.0 if "banana" in it["completion"] else 0.0 for it in body["items"]]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(out.encode())

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def reward_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/score"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = start_server(scripted_qwen3_dir(), tmp_path_factory.mktemp("reasoning-jobs"),
                     extra_args=["--max-model-len", "2048"], env_extra={}, config=None)
    c = httpx.Client(base_url=s.base_url, timeout=120)
    yield c
    c.close()
    stop_server(s)


def _job(c: httpx.Client, body: dict) -> dict:
    r = c.post("/v1/train/grpo", json=body)
    assert r.status_code == 202, r.text
    return wait_job(c, r.json()["id"], timeout=300)


def test_grpo_rewards_the_answer_not_the_reasoning(srv, reward_url):
    """The scorer reward (contains "banana") reads the answer: "banana" inside <think> earns nothing, so the mean
    reward is below 1 and the groups vary (read with the reasoning, every sample would pass and every group
    would be flat). The http reward gets each answer with its reasoning beside it."""
    job = _job(srv, {**GRPO, "adapter": "think-scorer", "reward": {"type": "scorer", "scorer": {"type": "contains"}}})
    assert job["state"] == "succeeded", job
    report = job["result"]["report"]
    assert 0.0 < report["reward_per_iteration"][0] < 1.0, report["reward_per_iteration"]
    _Capture.seen.clear()
    job = _job(srv, {**GRPO, "adapter": "think-http", "reward": {"type": "http", "url": reward_url},
                     "reasoning_loss": False})  # the answers alone carry the loss
    assert job["state"] == "succeeded", job
    items = _Capture.seen[0]["items"]
    assert len(items) == 16 and {it["reasoning"] for it in items} == {"banana"}
    assert {it["completion"].strip() for it in items} <= {"banana", "apple"}
    assert all("<think>" not in it["completion"] and "</think>" not in it["completion"] for it in items)


def test_grpo_with_thinking_off_renders_the_no_think_prompt(srv, reward_url):
    _Capture.seen.clear()
    job = _job(srv, {**GRPO, "adapter": "no-think", "chat_template_kwargs": NO_THINK,
                     "reward": {"type": "http", "url": reward_url}})
    assert job["state"] == "succeeded", job
    items = _Capture.seen[0]["items"]
    assert {it["reasoning"] for it in items} == {None}  # the closed empty span came from the prompt
    assert {it["completion"].strip() for it in items} <= {"banana", "apple"}
    generation = job["result"]["report"]["generation"]
    assert generation["thinking"] is False and generation["chat_template_kwargs"] == NO_THINK
    assert generation["reasoning_parser"] == "qwen3"


def _suite(name: str, **generation) -> dict:
    return {"name": name, "examples": [{"messages": p["messages"], "reference": "banana"} for p in PROMPTS],
            "scorers": [{"type": "contains"}], "generation": {"samples": 8, "temperature": 1.0, "max_tokens": 8,
                                                              **generation}}


@pytest.mark.parametrize("generation,thinking", [({}, True), ({"chat_template_kwargs": NO_THINK}, False)])
def test_eval_suite_scores_the_answer_and_reports_thinking(srv, generation, thinking):
    """An inline suite with thinking on and off: scorers read the answer (the reasoning's "banana" passes
    nothing), each sample keeps its reasoning beside it, and the report says whether the model could think."""
    from tests.evals.test_http import wait_run

    r = srv.post("/v1/evals/runs", json={"inline_suite": _suite(f"fruit-{thinking}", **generation)})
    assert r.status_code == 202, r.text
    run = wait_run(srv, r.json()["id"])
    assert run["state"] == "succeeded", run["error"]
    res = run["result"]
    samples = [x for e in res["examples"] for x in e["samples"]]
    assert {x["reasoning"] for x in samples} == ({"banana"} if thinking else {None})
    assert {x["completion"].strip() for x in samples} <= {"banana", "apple"}
    assert all(x["passed"] == (x["completion"].strip() == "banana") for x in samples)
    assert not all(x["passed"] for x in samples)
    assert res["aggregate"]["thinking"] is thinking and res["provenance"]["reasoning"]["thinking"] is thinking
    assert res["provenance"]["reasoning"]["reasoning_parser"] == "qwen3"


@pytest.mark.parametrize("kwargs,thinking", [({}, True), ({"chat_template_kwargs": NO_THINK}, False)])
def test_opd_job_reports_whether_the_student_thought(srv, kwargs, thinking):
    """An OPD job (the base model as its local teacher) with thinking on and off: the report says which, from
    the prompts the job rendered with its template kwargs."""
    r = srv.post("/v1/teachers", json={"alias": "self-teacher", "kind": "local"})
    assert r.status_code in (201, 409), r.text
    body = {"adapter": f"opd-think-{thinking}", "teacher": "self-teacher", "prompts": [{"messages": PROMPTS[0]["messages"]}],
            "samples_per_prompt": 2, "max_tokens": 6, "max_steps": 1, "teacher_path": False, "rehearsal": 0,
            "batch_size": 1, **kwargs}
    r = srv.post("/v1/train/opd", json=body)
    assert r.status_code == 202, r.text
    job = wait_job(srv, r.json()["id"], timeout=300)
    assert job["state"] == "succeeded", job.get("error")
    generation = job["result"]["report"]["generation"]
    assert generation["thinking"] is thinking and generation["reasoning_parser"] == "qwen3"
    assert generation["chat_template_kwargs"] == (NO_THINK if not thinking else None)


def test_sft_reasoning_loss_false_masks_the_think_span():
    """On the real Qwen3 template an assistant turn with reasoning renders <think>...</think> before its answer:
    with reasoning_loss (the default) both carry loss; without it only the answer (and the end of turn)."""
    from transformers import AutoTokenizer

    from kiln.training.core.data import tokenize_sft
    from kiln.training.schemas import SFTExample

    tok = AutoTokenizer.from_pretrained(scripted_qwen3_dir())
    ex = SFTExample(messages=[{"role": "user", "content": "Name a fruit."},
                              {"role": "assistant", "content": "apple", "reasoning_content": "I think of banana."}])
    (whole,) = tokenize_sft(tok, [ex], max_seq_len=256)
    (answer,) = tokenize_sft(tok, [ex], max_seq_len=256, reasoning_tags=("<think>", "</think>"))

    def learned(row):
        return tok.decode([t for t, m in zip(row.input_ids, row.loss_mask) if m])

    assert whole.input_ids == answer.input_ids
    assert "<think>" in learned(whole) and "banana" in learned(whole) and "apple" in learned(whole)
    assert learned(answer).strip() == "apple<|im_end|>"


def test_answer_mask_and_prompt_opening_on_the_real_qwen3_tokenizer():
    """The contract's pieces on the real tokenizer: the answer mask GRPO uses with reasoning_loss false (0 through
    </think>, 1 after), the span a constrained action opens, and thinking read from the rendered prompt."""
    from transformers import AutoTokenizer

    from kiln.runtime.chat_generation import ChatGeneration
    from kiln.runtime.reasoning import Qwen3ReasoningParser
    from kiln.runtime.tokenization import Tokenization
    from tests.scripted_model import APPLE, BANANA, END_THINK, IM_END, SP_BANANA, THINK

    tokens = Tokenization(AutoTokenizer.from_pretrained(scripted_qwen3_dir()))
    on = ChatGeneration(tokens, Qwen3ReasoningParser())
    off = ChatGeneration(tokens, Qwen3ReasoningParser(), NO_THINK)
    msgs = PROMPTS[0]["messages"]
    p_on, p_off = on.prompt_ids(msgs), off.prompt_ids(msgs)
    assert on.thinking(p_on) and not off.thinking(p_off) and not on.opened(p_on)
    assert on.opening(p_on) == p_on + [THINK] and on.opened(on.opening(p_on)) and off.opening(p_off) == p_off
    assert on.answer_mask(p_on, [THINK, BANANA, END_THINK, SP_BANANA, IM_END]) == [0, 0, 0, 1, 1]
    assert on.answer_mask(p_on, [APPLE, IM_END]) == [1, 1]  # no span: all answer
    assert on.answer_mask(p_on, [THINK, BANANA, BANANA]) == [0, 0, 0]  # never closed: all reasoning
    a = on.split(tokens.decode([THINK, BANANA, END_THINK, SP_BANANA]), p_on)
    assert (a.reasoning, a.content.strip()) == ("banana", "banana")
