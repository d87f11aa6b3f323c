"""Small endpoints clients expect: vLLM's ``/tokenize`` and ``/detokenize``, and ``/v1/models``
entries with ``created``, ``owned_by`` and ``permission`` (every response checked against
``/openapi.json`` by the ``http`` fixture)."""

from __future__ import annotations


def test_tokenize_prompt_matches_generation_and_round_trips(http, oai, server):
    text = "What is 3 + 4?"
    r = http.post("/tokenize", json={"model": server.model_id, "prompt": text, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert len(r["token_strs"]) == r["count"]
    used = oai.completions.create(model=server.model_id, prompt=text, max_tokens=1).usage.prompt_tokens
    assert used == r["count"]
    back = http.post("/detokenize", json={"model": server.model_id, "tokens": r["tokens"]}).json()
    assert back == {"prompt": text}
    # model is optional, as in vLLM
    assert http.post("/tokenize", json={"prompt": text}).json()["tokens"] == r["tokens"]


def test_tokenize_chat_counts_the_rendered_prompt(http, oai, server):
    messages = [{"role": "user", "content": "Tell me about the river."}]
    r = http.post("/tokenize", json={"model": server.model_id, "messages": messages}).json()
    used = oai.chat.completions.create(model=server.model_id, messages=messages, max_tokens=1).usage.prompt_tokens
    assert r["count"] == used and r["token_strs"] is None
    text = http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert text.endswith("assistant\n") and "Tell me about the river." in text


def test_tokenize_errors(http, server):
    assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert http.post("/tokenize", json={"prompt": "x", "bogus": 1}).status_code == 400
    r = http.post("/detokenize", json={"tokens": [10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_models_list_has_client_fields(oai, server):
    models = oai.models.list().data
    card = next(m for m in models if m.id == server.model_id)
    assert card.created > 0 and card.owned_by == "kiln" and card.object == "model"
    perm = card.model_dump()["permission"]
    assert perm and perm[0]["object"] == "model_permission" and perm[0]["allow_sampling"] is True
