"""Discovery and the WebSocket episode client against real openenv-core servers (no model: scripted policies)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from kiln.openenv import episode as ep
from kiln.openenv.discovery import (
    EnvironmentProtocolError,
    check_env_url,
    compile_action_schema,
    discover,
    discovery_digest,
)
from tests.openenv.guess_env import TARGET

CAP = 4 * 1024 * 1024


def _discover(url):
    return discover(url, max_bytes=CAP, timeout_s=10)


def _episode(url, policy, *, max_steps=3, timeout_s=10.0, frame=1024 * 1024, budget=None, spy=None):
    disc = _discover(url)
    budget = budget or ep.Budget(64 * 1024 * 1024)
    http = httpx.Client(follow_redirects=False, trust_env=False)

    def open_session():
        s = ep.Session(url, max_frame_bytes=frame, timeout_s=timeout_s, http=http, discovery_cap=CAP)
        if spy is not None:
            real = s.exchange

            def exchange(msg):
                spy.append(msg)
                return real(msg)
            s.exchange = exchange
        return s

    session, data = ep.open_episode(open_session, {"seed": 1}, capacity_wait_s=10, cancelled=lambda: False,
                                    budget=budget)
    messages = [{"role": "user", "content": ep.render_observation(data)}]
    try:
        return ep.play(session, ep.Episode(1, data), policy, messages, validator=disc.validator, max_steps=max_steps,
                       protocol_error_reward=-2.0, budget=budget, render=ep.render_observation), session
    finally:
        http.close()


def test_discovery_digest_is_stable_and_canonical(env_servers):
    a, b = _discover(env_servers["guess"]), _discover(env_servers["guess"])
    assert a.digest == b.digest and len(a.digest) == 64
    assert set(a.documents) == {"/metadata", "/schema", "/openapi.json"}
    # key order is irrelevant; any value change is bound
    reordered = {k: a.documents[k] for k in reversed(list(a.documents))}
    assert discovery_digest(reordered) == a.digest
    changed = dict(a.documents, **{"/metadata": {**a.documents["/metadata"], "x-extension": 1}})
    assert discovery_digest(changed) != a.digest
    assert a.action_schema["required"] == ["guess"]


def test_env_url_must_be_loopback_http():
    assert check_env_url("http://127.0.0.1:9/") == "http://127.0.0.1:9"
    for bad in ("http://10.0.0.1:80", "https://127.0.0.1:1", "http://127.0.0.1:1/path", "http://u:p@127.0.0.1:1",
                "http://example.com:80"):
        with pytest.raises(ValueError):
            check_env_url(bad)


def test_action_schema_refuses_remote_refs_and_invalid_schemas():
    with pytest.raises(EnvironmentProtocolError) as e:
        compile_action_schema({"$ref": "https://example.com/a.json"})
    assert e.value.code == "invalid_action_schema"
    with pytest.raises(EnvironmentProtocolError):
        compile_action_schema({"type": 5})
    internal = {"$defs": {"d": {"type": "integer"}}, "type": "object", "properties": {"g": {"$ref": "#/$defs/d"}}}
    v = compile_action_schema(internal)
    assert v.is_valid({"g": 1}) and not v.is_valid({"g": "x"})


def test_done_episode_sums_step_rewards(env_servers):
    result, _ = _episode(env_servers["guess"], lambda m: f'{{"guess": {TARGET}}}')
    assert (result.termination, result.steps, result.episode_return) == (ep.DONE, 1, 1.0)


def test_max_steps_cutoff(env_servers):
    result, _ = _episode(env_servers["counter"], lambda m: '{"guess": 4}', max_steps=3)
    assert (result.termination, result.steps) == (ep.MAX_STEPS, 3)
    assert result.episode_return == pytest.approx(3 * (1 - abs(4 - TARGET) / 9))


@pytest.mark.parametrize("text", ['{"guess": 42}', "not json at all", '{"guess": 3, "extra": true}'])
def test_invalid_action_is_never_sent(env_servers, text):
    sent: list = []
    result, _ = _episode(env_servers["guess"], lambda m: text, spy=sent)
    assert result.termination == ep.INVALID_ACTION and result.episode_return == -2.0 and result.steps == 0
    assert [m["type"] for m in sent] == ["reset"]  # the action never reached the socket
    assert result.error["reason"] in ("schema", "not_json")


def test_environment_error_is_a_protocol_error(env_servers):
    result, _ = _episode(env_servers["error"], lambda m: '{"guess": 1}')
    assert result.termination == ep.PROTOCOL_ERROR and result.episode_return == -2.0
    assert result.error["code"] == "EXECUTION_ERROR"


def test_timeout_poisons_the_session(env_servers):
    result, session = _episode(env_servers["slow"], lambda m: '{"guess": 1}', timeout_s=0.5)
    assert result.termination == ep.PROTOCOL_ERROR and result.error["code"] == "session_poisoned"
    assert session.poisoned
    with pytest.raises(ep.SessionPoisoned):
        session.exchange({"type": "state"})


def test_oversized_frame_is_fatal(env_servers):
    with pytest.raises(ep.FrameTooLarge):
        _episode(env_servers["huge"], lambda m: '{"guess": 1}')


def test_aggregate_budget(env_servers):
    with pytest.raises(ep.RolloutBudgetExceeded):
        _episode(env_servers["counter"], lambda m: '{"guess": 1}', max_steps=50, budget=ep.Budget(2_000))


def test_capacity_reached_backs_off_and_reopens(env_servers):
    from websockets.sync.client import connect

    url = env_servers["counter"]
    holder = connect(url.replace("http", "ws") + "/ws", proxy=None).__enter__()  # the server's only session
    holder.send('{"type":"reset","data":{}}')
    holder.recv(timeout=10)
    http = httpx.Client(trust_env=False)
    opened = []

    def open_session():
        opened.append(1)
        return ep.Session(url, max_frame_bytes=1 << 20, timeout_s=10, http=http, discovery_cap=CAP)

    with pytest.raises(ep.CapacityTimeout):
        ep.open_episode(open_session, {"seed": 0}, capacity_wait_s=0.3, cancelled=lambda: False, budget=ep.Budget(1 << 20))
    assert len(opened) >= 2
    threading.Timer(0.4, holder.close).start()
    t0 = time.monotonic()
    session, data = ep.open_episode(open_session, {"seed": 0}, capacity_wait_s=10, cancelled=lambda: False,
                                    budget=ep.Budget(1 << 20))
    session.close()
    http.close()
    assert data["observation"]["prompt"] and time.monotonic() - t0 >= 0.3
