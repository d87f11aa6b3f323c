"""The engine behind a real ``kiln serve`` on 127.0.0.1: scoring admission and cancellation,
hostile JSON on the fast path, hostile sampling parameters, and many concurrent streams."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.serving.conftest import start_server, stop_server

DEADLINE_S = 60.0
SCORE_TOKENS = 2000


@pytest.fixture(scope="module")
def roomy(builtin_model_dir, tmp_path_factory):
    """Default batching limits (64 streams fit the queue)."""
    srv = start_server(builtin_model_dir, tmp_path_factory.mktemp("roomy"),
                       extra_args=["--no-training", "--max-model-len", "2048"], env_extra={}, config=None)
    yield srv
    stopped(srv)


def stopped(srv) -> None:
    """SIGTERM ends the server gracefully, in bounded time, with exit status 0 (a kill after
    stop_server's deadline would be -9)."""
    assert stop_server(srv) == 0
    assert "Application shutdown complete" in srv.log()


@pytest.fixture(scope="module")
def tight(builtin_model_dir, tmp_path_factory):
    """Two running rows, three queued, small cycles: scoring queues and takes many cycles."""
    srv = start_server(builtin_model_dir, tmp_path_factory.mktemp("tight"),
                       extra_args=["--no-training", "--max-model-len", "2048", "--max-running-rows", "2",
                                   "--max-queued-rows", "3", "--token-budget", "32", "--prefill-chunk-tokens", "32"],
                       env_extra={}, config=None)
    yield srv
    stopped(srv)


def health(base: str) -> dict:
    return httpx.get(f"{base}/health", timeout=10).json()


def wait_idle(base: str) -> dict:
    end = time.monotonic() + DEADLINE_S
    while True:
        h = health(base)
        if h["active_rows"] == 0 and h["queued_rows"] == 0:
            return h
        assert time.monotonic() < end, f"rows never drained: {h}"
        time.sleep(0.05)


def score_body(model: str, i: int) -> dict:
    return {"model": model, "prompt": [(j * 7 + i) % 500 + 3 for j in range(SCORE_TOKENS)],
            "max_tokens": 0, "prompt_logprobs": 1}


# -- task 5 ----------------------------------------------------------------------------------


def test_scoring_goes_through_the_queue_limits(tight):
    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=tight.base_url, timeout=DEADLINE_S) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=score_body(tight.model_id, i))
                                          for i in range(10)))

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "overloaded" and "retry-after" in refused.headers
    ok = next(r for r in responses if r.status_code == 200)
    assert len(ok.json()["choices"][0]["prompt_logprobs"]) == SCORE_TOKENS
    assert wait_idle(tight.base_url)["active_rows"] == 0


def test_scoring_is_cancelled_when_the_client_leaves(tight):
    base = tight.base_url
    before = health(base)["engine_steps"]

    async def main() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as c:
            tasks = [asyncio.ensure_future(c.post("/v1/completions", json=score_body(tight.model_id, i)))
                     for i in range(5)]
            end = time.monotonic() + DEADLINE_S
            while True:
                h = (await c.get("/health")).json()
                if h["active_rows"] + h["queued_rows"] >= 3:  # the queue is full: three admitted
                    break
                assert time.monotonic() < end, "the scoring rows were never admitted"
                await asyncio.sleep(0.02)
            for t in tasks:
                t.cancel()  # closes the connections: the server sees the disconnects
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    after = wait_idle(base)
    whole = 3 * SCORE_TOKENS // 32  # cycles the three admitted prompts need when nobody cancels them
    assert after["engine_steps"] - before < whole
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=DEADLINE_S, json={
        "model": tight.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert chat.status_code == 200


# -- task 6 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_deeply_nested_json_is_a_400(roomy, path):
    body = '{"model": "x", "prompt": ' + "[" * 1000 + "]" * 1000 + "}"
    r = httpx.post(f"{roomy.base_url}{path}", content=body, headers={"content-type": "application/json"},
                   timeout=DEADLINE_S)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json"
    assert health(roomy.base_url)["status"] == "ok"


# -- task 4 ----------------------------------------------------------------------------------


def test_hostile_top_p_does_not_cut_off_a_neighbour(roomy):
    base, model = roomy.base_url, roomy.model_id

    async def main() -> tuple[str, list[int]]:
        async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as c:
            async def stream() -> str:
                text = []
                async with c.stream("POST", "/v1/chat/completions", json={
                        "model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
                        "max_tokens": 40, "ignore_eos": True, "stream": True, "temperature": 0}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        text.append(line)
                return "\n".join(text)

            neighbour = asyncio.ensure_future(stream())
            hostile = [c.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                "temperature": 1.5, "top_p": p}) for p in (1e-46, 5e-324, 1e-300)]
            codes = [r.status_code for r in await asyncio.gather(*hostile)]
            return await neighbour, codes

    text, codes = asyncio.run(main())
    assert all(code in (200, 400) for code in codes), codes
    assert '"finish_reason":"length"' in text and text.rstrip().endswith("data: [DONE]")
    assert health(base)["status"] == "ok"
    assert wait_idle(base)["active_rows"] == 0


# -- task 7 ----------------------------------------------------------------------------------


def test_64_concurrent_streams_all_complete(roomy):
    from openai import AsyncOpenAI

    async def main() -> list[tuple[str | None, int]]:
        client = AsyncOpenAI(base_url=f"{roomy.base_url}/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)

        async def one(i: int) -> tuple[str | None, int]:
            stream = await client.chat.completions.create(
                model=roomy.model_id, messages=[{"role": "user", "content": f"Tell me about topic {i}."}],
                max_tokens=24, stream=True, extra_body={"ignore_eos": True},
                temperature=0.8 if i % 2 else 0, seed=i)
            finish, pieces = None, 0
            async for chunk in stream:
                for choice in chunk.choices:
                    pieces += 1
                    finish = choice.finish_reason or finish
            return finish, pieces

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(main())  # any 4xx/5xx raises out of the openai client
    assert [f for f, _ in results] == ["length"] * 64
    assert all(p >= 2 for _, p in results)
    assert wait_idle(roomy.base_url)["active_rows"] == 0


# -- task 1: /health sees a stuck engine ------------------------------------------------------


def test_health_is_503_while_the_engine_is_stuck(builtin_model_dir, tmp_path):
    import dataclasses

    from kiln.config import load_settings
    from kiln.runtime.sampling import SamplingParams
    from kiln.serving.app import create_app

    settings = load_settings(cli={"model.path": str(builtin_model_dir), "training.enabled": False,
                                  "home": str(tmp_path)}, environ={})
    app = create_app(settings)

    async def main() -> tuple[int, dict, int]:
        async with app.router.lifespan_context(app):
            engine = app.state.kiln.engine
            sched = engine._scheduler
            sched.config = dataclasses.replace(sched.config, stall_timeout_s=0.2)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
                with engine.ownership.exclusive():  # the next step cannot run
                    engine.submit([5, 6, 7], [SamplingParams(max_tokens=2)])
                    end = time.monotonic() + DEADLINE_S
                    while (r := await c.get("/health")).status_code == 200:
                        assert time.monotonic() < end, "health never reported the stall"
                        await asyncio.sleep(0.05)
                    stuck_code, stuck = r.status_code, r.json()
                end = time.monotonic() + DEADLINE_S
                while (r := await c.get("/health")).status_code != 200 or r.json()["active_rows"]:
                    assert time.monotonic() < end, "health never recovered"
                    await asyncio.sleep(0.05)
                return stuck_code, stuck, r.status_code

    stuck_code, stuck, recovered = asyncio.run(main())
    assert stuck_code == 503 and stuck["status"] == "unavailable" and "stuck" in stuck["engine_error"]
    assert recovered == 200
