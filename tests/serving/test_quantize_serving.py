"""``kiln serve --quantize int8``: a real server over the int8 base (kiln.runtime.quantize).

Its identity says so (/health, /v1/config with the probe KL), greedy chat completions through the
``openai`` client decode what an in-process int8 engine decodes, and a KL ceiling below the measured
KL stops the start-up with exit status 2 and the reason.
"""

from __future__ import annotations

import httpx
import pytest

from tests.serving.conftest import start_server, stop_server

PROMPT = [{"role": "user", "content": "Say something about kilns."}]


@pytest.fixture(scope="module")
def int8_server(builtin_model_dir, tmp_path_factory):
    srv = start_server(builtin_model_dir, tmp_path_factory.mktemp("int8-home"),
                       extra_args=["--no-training", "--quantize", "int8", "--device", "cpu"],
                       env_extra={"KILN_MODEL_QUANTIZE_MAX_KL": "0.01"}, config=None)
    yield srv
    stop_server(srv)


def test_identity_names_the_int8_base(int8_server):
    from tests.security.openapi_check import checked_client, fetch_checker

    with checked_client(int8_server.base_url, fetch_checker(int8_server.base_url)) as http:  # schema-checked
        health = http.get("/health").json()
        config = http.get("/v1/config").json()
    assert health["base_representation"] == "int8" and health["dtype"] == "float32"
    assert config["settings"]["model.quantize"] == {"value": "int8", "source": "cli"}
    assert config["settings"]["model.quantize_max_kl"]["source"] == "env"
    quant = config["effective"]["quantization"]
    assert quant["requested"] == "int8" and quant["effective"] == "int8"
    assert quant["kernel"] in ("c", "aten", "dequantize") and quant["head"] in ("int8", "float32")
    assert 0 < quant["probe_kl"] < 0.01 and quant["probe_tokens"] > 100
    assert quant["weight_bytes_after"] < quant["weight_bytes_before"]
    assert health["memory_budget"]["resident"]["weights"] == quant["weight_bytes_after"]  # admission counts int8


def test_greedy_completion_over_int8_equals_an_in_process_int8_engine(int8_server, builtin_model_dir):
    from openai import OpenAI

    import httpx

    from kiln.runtime.engine import Engine, EngineConfig
    from kiln.runtime.quantize_load import load_quantized
    from kiln.runtime.sampling import SamplingParams

    client = OpenAI(base_url=f"{int8_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.chat.completions.create(model=int8_server.model_id, messages=PROMPT, max_tokens=16, temperature=0)
    text = out.choices[0].message.content
    assert out.usage.completion_tokens > 0
    # the server timed its kernel choice (quantize.choose_kernel); the same kernel here, so the numbers are the same
    kernel = httpx.get(f"{int8_server.base_url}/v1/config", timeout=30).json()["effective"]["quantization"]["kernel"]
    loaded = load_quantized(builtin_model_dir, "int8", kernel=kernel)
    engine = Engine(loaded, EngineConfig()).start()
    try:
        ids = engine.encode_chat(PROMPT)
        local = engine.generate(ids, SamplingParams(max_tokens=16, temperature=0.0), timeout=60)[0]
    finally:
        engine.stop()
    assert text == local.text


def test_kl_ceiling_stops_the_start(builtin_model_dir, tmp_path):
    with pytest.raises(RuntimeError) as info:
        start_server(builtin_model_dir, tmp_path, extra_args=["--no-training", "--quantize", "int4"],
                     env_extra={"KILN_MODEL_QUANTIZE_MAX_KL": "0.000001"}, config=None)
    message = str(info.value)
    assert "exited with 2" in message and "quantize_max_kl" in message
