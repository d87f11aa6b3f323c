"""Issue 45 item 10: the published request schemas state the cross-field rules the validators enforce.

For each rule, two bodies that differ only in the combination the rule is about: the server's own
/openapi.json (jsonschema, draft 2020-12) and the server agree on which one is refused. Before the rules
were published, the refused combinations were schema-valid (schemathesis' positive_data_acceptance
reported them as "schema-valid request rejected").
"""

from __future__ import annotations

import jsonschema
import pytest

from kiln.wire_rules import field_is, never_both, rules, when

SUITE = {"name": "s", "examples": [{"messages": [{"role": "user", "content": "hi"}], "reference": "x"}],
         "scorers": [{"type": "exact"}]}
TOOL_TURNS = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "add", "arguments": "{}"}}]},
    {"role": "tool", "content": "4", "tool_call_id": "c1"},
]
PAIRS = [
    # (rule, path, refused body, accepted-by-schema body)
    ("revision needs adapter", "/v1/evals/runs",
     {"suite": "nope", "target": {"revision": "0" * 64}},
     {"suite": "nope", "target": {"adapter": "nope", "revision": "0" * 64}}),
    ("exactly one of suite and inline_suite", "/v1/evals/runs",
     {"suite": "nope", "inline_suite": SUITE},
     {"suite": "nope"}),
    ("set_default_on_pass needs activate_on_pass", "/v1/evals/gate",
     {"candidate": {"adapter": "nope", "revision": "0" * 64},
      "post_eval": {"suite": "nope", "set_default_on_pass": True}},
     {"candidate": {"adapter": "nope", "revision": "0" * 64},
      "post_eval": {"suite": "nope", "set_default_on_pass": True, "activate_on_pass": True}}),
    ("majority@k needs samples >= 2", "/v1/evals/suites",
     {**SUITE, "aggregation": "majority@k"},
     {**SUITE, "aggregation": "majority@k", "generation": {"samples": 2, "temperature": 0.7}}),
    ("several samples need temperature > 0", "/v1/evals/suites",
     {**SUITE, "generation": {"samples": 2}},
     {**SUITE, "generation": {"samples": 2, "temperature": 0.5}}),
    ("a local teacher takes no url", "/v1/teachers",
     {"alias": "t1", "kind": "local", "url": "http://127.0.0.1:9"},
     {"alias": "t1", "kind": "local"}),
    ("a remote teacher needs provider, model_id and url", "/v1/teachers",
     {"alias": "t2", "kind": "remote", "provider": "vllm", "url": "http://127.0.0.1:9"},
     {"alias": "t2", "kind": "remote", "provider": "vllm", "model_id": "m", "url": "http://127.0.0.1:9"}),
    ("a credential-free teacher URL is an exact loopback URL", "/v1/teachers",
     {"alias": "t3", "kind": "remote", "provider": "vllm", "model_id": "m", "url": "http://example.com:9"},
     {"alias": "t3", "kind": "remote", "provider": "vllm", "model_id": "m", "url": "http://127.0.0.1:9"}),
    ("an OpenEnv run names its adapter", "/v1/openenv/preflight",
     {"env_url": "http://127.0.0.1:9", "training": {}},
     {"env_url": "http://127.0.0.1:9", "training": {"adapter": "a1"}}),
    ("chat_template_kwargs names follow the pattern and avoid reserved names", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template_kwargs": {"tools": 1}},
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template_kwargs": {"x_flag": 1}}),
    ("one structured-output constraint at most", "/v1/completions",
     {"prompt": "a", "max_tokens": 1, "guided_regex": "a", "guided_choice": ["a"]},
     {"prompt": "a", "max_tokens": 1, "guided_regex": "a"}),
    ("a completion prompt is not empty", "/v1/completions",
     {"prompt": "", "max_tokens": 1},
     {"prompt": "a", "max_tokens": 1}),
    ("a tool message names the call it answers", "/v1/chat/completions",
     {"messages": TOOL_TURNS[:2] + [{"role": "tool", "content": "4"}], "max_tokens": 1},
     {"messages": TOOL_TURNS, "max_tokens": 1}),
    ("only an assistant turn with tool_calls may omit content", "/v1/chat/completions",
     {"messages": [{"role": "user"}], "max_tokens": 1},
     {"messages": TOOL_TURNS, "max_tokens": 1}),
    ("an import names exactly one of jsonl and dataset_path", "/v1/evals/suites/import",
     {"name": "imp", "scorers": [{"type": "exact"}], "jsonl": "{}", "dataset_path": "a.jsonl"},
     {"name": "imp", "scorers": [{"type": "exact"}], "dataset_path": "a.jsonl"}),
    ("an import's dataset_path is relative, without '..'", "/v1/evals/suites/import",
     {"name": "imp", "scorers": [{"type": "exact"}], "dataset_path": "../a.jsonl"},
     {"name": "imp", "scorers": [{"type": "exact"}], "dataset_path": "sub/a.jsonl"}),
    ("a judgment's texts are not blank", "/v1/judgments",
     {"prompt": " \u3000\x1c", "response_a": "a", "response_b": "b", "preferred": "a"},
     {"prompt": " q ", "response_a": "a", "response_b": "b", "preferred": "a"}),
    ("stream_options only with stream=true", "/v1/completions",
     {"prompt": "a", "max_tokens": 1, "stream_options": {"include_usage": True}},
     {"prompt": "a", "max_tokens": 1, "stream_options": {"include_usage": True}, "stream": True}),
    ("the batch route takes no stream_options (it never streams)", "/v1/completions/batch",
     {"prompts": ["a"], "max_tokens": 1, "stream_options": {"include_usage": False}},
     {"prompts": ["a"], "max_tokens": 1}),
    ("a logit_bias key is a token ID in decimal", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logit_bias": {"x": 1}},
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logit_bias": {"5": 1}}),
    ("an import's jsonl holds a non-space character (a row)", "/v1/evals/suites/import",
     {"name": "imp", "scorers": [{"type": "exact"}], "jsonl": " \n\u3000\n"},
     {"name": "imp", "scorers": [{"type": "exact"}], "jsonl": "{}"}),
    ("a judge is an adapter name", "/v1/judgments/compare",
     {"judge": "", "prompt": "p", "response_a": "a", "response_b": "b"},
     {"judge": "j1", "prompt": "p", "response_a": "a", "response_b": "b"}),
    ("a credential_id follows kiln.toml's rule for ids", "/v1/teachers",
     {"alias": "t4", "kind": "remote", "provider": "vllm", "model_id": "m", "url": "https://example.com",
      "credential_id": ""},
     {"alias": "t4", "kind": "remote", "provider": "vllm", "model_id": "m", "url": "https://example.com",
      "credential_id": "nope"}),
    ("the batch route does not stream", "/v1/completions/batch",
     {"prompts": ["a"], "max_tokens": 1, "stream": True},
     {"prompts": ["a"], "max_tokens": 1, "stream": False}),
    ("post_eval owns activation: no auto_load beside it", "/v1/openenv/preflight",
     {"env_url": "http://127.0.0.1:9", "training": {"adapter": "a1", "auto_load": True, "post_eval": {"suite": "s"}}},
     {"env_url": "http://127.0.0.1:9", "training": {"adapter": "a1", "post_eval": {"suite": "s"}}}),
    ("an OpenEnv run's training takes GRPO's fields with their types", "/v1/openenv/preflight",
     {"env_url": "http://127.0.0.1:9", "training": {"adapter": "a1", "epochs": "two"}},
     {"env_url": "http://127.0.0.1:9", "training": {"adapter": "a1", "epochs": 2}}),
]


def _request_schema(checker, path: str) -> dict:
    _, op = checker.operation("POST", path)
    return op["requestBody"]["content"]["application/json"]["schema"]


def _schema_valid(checker, schema: dict, body: dict) -> bool:
    validator = jsonschema.Draft202012Validator({"components": checker.doc["components"], **schema})
    return validator.is_valid(body)


@pytest.mark.parametrize("rule,path,refused,accepted", PAIRS, ids=[p[0] for p in PAIRS])
def test_schema_and_server_agree_on_the_rule(client, checker, rule, path, refused, accepted):
    if path in ("/v1/chat/completions", "/v1/completions", "/v1/completions/batch"):
        model = client.get("/v1/models").json()["data"][0]["id"]
        refused, accepted = {**refused, "model": model}, {**accepted, "model": model}
    schema = _request_schema(checker, path)
    assert not _schema_valid(checker, schema, refused), f"{rule}: the schema still admits {refused}"
    assert _schema_valid(checker, schema, accepted), f"{rule}: the schema refuses {accepted}"
    r = client.post(path, json=refused)
    assert r.status_code == 400, r.text
    r = client.post(path, json=accepted)
    # the accepted combination passes validation: anything but a 400 for the request's shape
    assert r.status_code != 400 or r.json()["error"]["code"] not in ("invalid_request", "limit_exceeded"), r.text


def test_the_rule_builders_compose_into_draft_2020_12():
    schema = {"type": "object", **rules(
        when(field_is("a", {"const": True}), field_is("b", {"const": True})),
        never_both(field_is("x", {}), field_is("y", {})))}
    v = jsonschema.Draft202012Validator(schema)
    assert v.is_valid({"a": True, "b": True}) and not v.is_valid({"a": True})
    assert v.is_valid({"x": 1}) and not v.is_valid({"x": 1, "y": 2})


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_k": 5.0,
                              "stop_token_ids": [3.0]}, "top_k"),
    ("/v1/completions", {"prompt": [1.0, 2.0], "max_tokens": 2, "n": 1.0}, "n"),
    ("/v1/completions/batch", {"prompts": ["a", [1.0, 2]], "max_tokens": 2.0}, "max_tokens"),
    ("/detokenize", {"tokens": [1.0, 2.0]}, "tokens"),
])
def test_a_whole_float_is_an_integer_as_json_schema_says(client, checker, path, body, field):
    """JSON Schema's integer includes 5.0: the server accepts it; 5.5, "5" and true stay refused."""
    model = client.get("/v1/models").json()["data"][0]["id"]
    body = {**body, "model": model}
    assert _schema_valid(checker, _request_schema(checker, path), body)
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    value = body[field]
    for bad in ([1.5] if isinstance(value, list) else [2.5, "2", True]):
        refused = {**body, field: bad}
        assert not _schema_valid(checker, _request_schema(checker, path), refused)
        r = client.post(path, json=refused)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text
