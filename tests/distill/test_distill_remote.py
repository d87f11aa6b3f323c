"""Capture from a registered remote teacher: a real second `kiln serve` on 127.0.0.1.

The teacher server serves Kiln's built-in model (vocabulary 551) with
``limits.max_prompt_logprobs = 551``, so a prompt-logprobs row is the whole
distribution (v1 rows store the full entropy). It is registered through the real
``TeacherRegistry`` (both probes over HTTP) into a ``KILN_HOME`` registry, and
``kiln distill capture --teacher-alias`` scores through it (binary wire, pinned
fingerprint checked on every answer). The rows must equal a local capture of the
same checkpoint within float32 noise; a teacher that cannot give the entropy, or
whose fingerprint changed since it was pinned, is refused.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import numpy as np
import pytest

from kiln.distill.examples import available_shards, load_shard_examples
from tests.distill.tinymodels import (
    build_tiny_model,
    capture_in_process,
    make_plan,
    synthetic_examples,
)
from tests.serving.conftest import start_server, stop_server

pytest.importorskip("torch")

VOCAB = 551


@pytest.fixture(scope="module")
def remote(builtin_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    from kiln.teachers.kiln_identity import tokenizer_digests
    from kiln.teachers.probe import StudentFacts
    from kiln.teachers.registry import TeacherRegistry, TeacherRequest

    tmp = tmp_path_factory.mktemp("remote-teacher")
    (tmp / "teacher-home").mkdir()
    srv = start_server(builtin_model_dir, tmp / "teacher-home", extra_args=[],
                       env_extra={"KILN_LIMITS_MAX_PROMPT_LOGPROBS": str(VOCAB)}, config=None)
    home = tmp / "home"
    vocab_sha = tokenizer_digests(AutoTokenizer.from_pretrained(builtin_model_dir), VOCAB)[0]
    registry = TeacherRegistry(home / "teachers" / "registry.json", credentials={}, server_host="127.0.0.1",
                               timeout_s=60, student=lambda: StudentFacts(VOCAB, vocab_sha, (5, 6, 7, 8)),
                               local_teacher=None)  # type: ignore[arg-type]
    entry = registry.register(TeacherRequest(alias="big", kind="remote", provider="kiln", model_id=srv.model_id,
                                             url=srv.base_url.replace("localhost", "127.0.0.1")))
    manifest = httpx.get(srv.base_url + "/v1/teacher/manifest", timeout=30)
    assert manifest.status_code == 200, manifest.text
    (tmp / "teacher-manifest.json").write_bytes(manifest.content)
    yield {"srv": srv, "home": home, "tmp": tmp, "entry": registry.pin("big"), "public": entry,
           "manifest": manifest.json()}
    stop_server(srv)


def test_capture_through_a_registered_kiln_teacher_equals_a_local_capture(remote, builtin_model_dir, monkeypatch):
    from typer.testing import CliRunner

    import kiln
    from kiln.distill.cli import app

    tmp = remote["tmp"]
    student = build_tiny_model(tmp / "student", vocab=VOCAB, seed=2, tokenizer_from=builtin_model_dir)
    examples = synthetic_examples(6, VOCAB, prompt=4, target=5, seed=7)
    examples[0]["prompt_token_ids"] = [3] * 20  # longer than max_len: left-truncated windows
    r_path, r_plan, r_data = make_plan(tmp / "r", builtin_model_dir, student, examples, top_k=8, max_len=16,
                                       backend="remote-kiln", backend_version=f"kiln:{kiln.__version__}")
    monkeypatch.setenv("KILN_HOME", str(remote["home"]))
    res = CliRunner().invoke(app, ["capture", str(r_path), "--teacher-alias", "big", "--tokenizer",
                                   str(builtin_model_dir), "--dataset-root", str(r_data), "--out",
                                   str(tmp / "r-run"), "--examples-per-shard", "3", "--teacher-manifest",
                                   str(tmp / "teacher-manifest.json")])
    assert res.exit_code == 0, res.stdout
    receipt = json.loads(res.stdout)
    assert receipt["tokens"] == 30 and len(receipt["shards"]) == 2
    child = json.loads((tmp / "r-run" / ".receipts" / "capture-child.json").read_text())
    assert child["teacher_fingerprint"] == remote["entry"]["fingerprint"] and child["prompt_logprobs_k"] == VOCAB
    assert child["backend"] == "remote-kiln" and child["requests"] >= 2

    l_path, _l, l_data = make_plan(tmp / "l", builtin_model_dir, student, examples, top_k=8, max_len=16)
    capture_in_process(tmp / "l", builtin_model_dir, l_path, l_data, tmp / "l-run", examples_per_shard=3)

    def columns(run):
        plan, todo, _ = available_shards(run)
        return [e for d, h in todo for e in load_shard_examples(d, h, plan)]

    got, want = columns(tmp / "r-run"), columns(tmp / "l-run")
    assert [e.example_id for e in got] == [e.example_id for e in want]
    for g, w in zip(got, want):
        assert list(g.context) == list(w.context) and list(g.forced) == list(w.forced)
        assert np.array_equal(g.top_ids, w.top_ids)
        np.testing.assert_allclose(g.top_logprobs, w.top_logprobs, atol=2e-5)
        np.testing.assert_allclose(g.forced_logprobs, w.forced_logprobs, atol=2e-5)  # NaN where forced is in top-K
        np.testing.assert_allclose(g.tail, w.tail, atol=2e-5)
        np.testing.assert_allclose(g.entropy, w.entropy, atol=1e-4)
    assert any(np.isfinite(e.forced_logprobs).any() for e in got)  # some forced IDs outside the top-K
    assert r_plan.digest() == json.loads((tmp / "r-run" / ".receipts" / "capture.json").read_text())["plan_sha256"]


def test_remote_teacher_refusals(remote, builtin_model_dir):
    """Entropy a top-K row cannot give, a fingerprint changed since pinning, a plan bound to another backend."""
    import kiln
    from kiln.distill.errors import ContractError
    from kiln.distill.remote import RemoteTeacherScorer
    from kiln.teachers.kiln_identity import identity_from_fingerprint
    from kiln.teachers.probe import TeacherRefused

    tmp = remote["tmp"]
    _p, plan, _d = make_plan(tmp / "x", builtin_model_dir, builtin_model_dir, synthetic_examples(1, VOCAB), top_k=8,
                             backend="remote-kiln", backend_version=f"kiln:{kiln.__version__}")
    pinned = remote["entry"] | {"credential": None}
    ident = identity_from_fingerprint(pinned["fingerprint"])

    def with_identity(**changes):
        fp = dataclasses.replace(ident, **changes).fingerprint()
        return pinned | {"fingerprint": fp, "manifest": remote["manifest"] | {"system_fingerprint": fp}}

    with pytest.raises(ContractError, match="entropy"):
        RemoteTeacherScorer(plan, with_identity(max_top_k=20, max_prompt_logprob_candidates=21 * ident.max_model_len), str(builtin_model_dir))
    # pinned under another served_model_id: construction passes, every answer's fingerprint then differs
    scorer = RemoteTeacherScorer(plan, with_identity(served_model_id="renamed"), str(builtin_model_dir))
    with pytest.raises(TeacherRefused) as err:
        scorer.score([("ex", [5, 6, 7], [8, 9])])
    assert err.value.code == "teacher_fingerprint_changed"
    _p, local_plan, _d = make_plan(tmp / "y", builtin_model_dir, builtin_model_dir, synthetic_examples(1, VOCAB),
                                   top_k=8)
    with pytest.raises(ContractError, match="capture.backend"):
        RemoteTeacherScorer(local_plan, pinned, str(builtin_model_dir))
    # a manifest whose inference document was edited no longer digests to the pinned identity's
    edited = remote["manifest"] | {"inference_config": remote["manifest"]["inference_config"] | {"dtype": "x"}}
    with pytest.raises(ContractError, match="inference_config digests to"):
        RemoteTeacherScorer(plan, pinned | {"manifest": edited}, str(builtin_model_dir))
