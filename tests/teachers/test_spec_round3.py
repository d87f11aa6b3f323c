"""Spec deviations round 3 (issue 33), launcher side: each test quotes the clause of
shared/spec/teacher-launcher.txt it enforces and runs the real launcher entry point."""

from __future__ import annotations

import json
import os

import pytest

from kiln.teachers import launcher
from kiln.teachers.identity import TeacherIdentityError, TeacherIdentityV1, validate_served_model_id
from kiln.teachers.kiln_identity import identity_from_fingerprint
from kiln.teachers.options import OptionError, check_environment, parse_vllm_options
from tests.teachers.test_launcher import _INPUT, base_args, run_in_process

H = "ab" * 32


# ---- item 1 -------------------------------------------------------------------------------
# "The launcher stages an immutable model snapshot, binds the runtime and selected accelerator
#  into a TeacherIdentityV1, disables mutable model surfaces, and supervises ..."


@pytest.mark.parametrize(
    "name,value",
    [
        ("VLLM_SERVER_DEV_MODE", "1"),
        ("VLLM_SERVER_DEV_MODE", "true"),
        ("VLLM_ALLOW_INSECURE_SERIALIZATION", "1"),
        ("VLLM_TORCH_CUDA_PROFILE", "1"),
        # a switch of the same kind the table does not know by name yet
        ("VLLM_SOME_FUTURE_DEV_SWITCH", "1"),
    ],
)
def test_mutable_surface_switches_are_refused_before_anything_is_copied(tiny_model, roots, monkeypatch, capsys, name,
                                                                         value):
    monkeypatch.setenv(name, value)
    code, err = run_in_process(base_args(tiny_model, roots), capsys)
    assert code == 2 and name in err and "mutable surface" in err
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []


def test_mutable_surface_switch_explicitly_off_is_accepted():
    # "0" is the value vLLM reads as off; it opens nothing.
    check_environment({"VLLM_SERVER_DEV_MODE": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "0"})


# ---- item 3 -------------------------------------------------------------------------------
# The precomputed input describes what the launcher would measure of a vLLM runtime; the
# launcher spawns "python3 -m vllm.entrypoints.cli.main serve" and nothing else.


@pytest.mark.parametrize("mode", [["--manifest-only"], ["--dry-run"]])
def test_kiln_implementation_refused_on_a_vllm_identity_input(tmp_path, tiny_model, capsys, mode):
    doc = json.loads(json.dumps(_INPUT))
    doc["implementation"] = "kiln:0.25.0"
    doc["runtime_versions"]["vllm"] = "0.25.0"
    path = tmp_path / "input.json"
    path.write_text(json.dumps(doc))
    code = launcher.main([f"--identity-input={path}", f"--model-path={tiny_model}", "--served-model-id=t",
                          "--max-top-k=4", "--max-model-len=64", *mode])
    captured = capsys.readouterr()
    assert code == 2 and "not a vLLM runtime" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


# ---- item 5 -------------------------------------------------------------------------------
# "Kiln closes that bypass by requiring both the request model and response model to equal the
#  identity's served_model_id": an ID with a trailing newline is not the ID a client sends.


@pytest.mark.parametrize("bad", ["teacher\n", "teacher\r", "tea\tcher", "teacher\x00", "\nteacher"])
def test_served_model_id_refuses_control_characters(bad, tiny_model, roots, capsys):
    with pytest.raises(TeacherIdentityError):
        validate_served_model_id(bad)
    code, err = run_in_process(
        [f"--model-path={tiny_model}", f"--served-model-id={bad}", "--max-top-k=4", "--max-model-len=64",
         "--manifest-only"], capsys)
    assert code == 2 and "served model ID" in err


def test_fingerprint_with_a_newline_in_the_served_model_id_is_refused():
    good = TeacherIdentityV1(
        served_model_id="teacher", base_model_sha256=H, tokenizer_vocab_sha256=H, tokenizer_config_sha256=H,
        adapter=None, vocab_size=100, max_top_k=4, max_model_len=64, max_prompt_logprob_candidates=320,
        implementation="vllm:0.25.0", inference_config_sha256=H,
    )
    assert identity_from_fingerprint(good.fingerprint()) == good
    # Build the fingerprint of the same identity with "teacher\n" by hand (canonical form otherwise).
    import base64
    import hashlib

    obj = good.to_json()
    obj["served_model_id"] = "teacher\n"
    raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    fp = f"kiln-teacher-v1.{base64.urlsafe_b64encode(raw).rstrip(b'=').decode()}.{hashlib.sha256(raw).hexdigest()}"
    with pytest.raises(ValueError, match="served model ID"):
        identity_from_fingerprint(fp)


def test_implementation_with_a_trailing_newline_is_refused():
    with pytest.raises(TeacherIdentityError):
        TeacherIdentityV1(
            served_model_id="teacher", base_model_sha256=H, tokenizer_vocab_sha256=H, tokenizer_config_sha256=H,
            adapter=None, vocab_size=100, max_top_k=4, max_model_len=64, max_prompt_logprob_candidates=320,
            implementation="vllm:0.25.0\n", inference_config_sha256=H,
        )


# ---- item 8 -------------------------------------------------------------------------------
# "Each option must use one unambiguous --key=value token, except for the launcher's small set of
#  vetted valueless switches."


@pytest.mark.parametrize(
    "tokens",
    [
        ["--enable-prefix-caching", "--no-enable-prefix-caching"],
        ["--no-enable-chunked-prefill", "--enable-chunked-prefill"],
        ["--enable_prefix_caching", "--no-enable-prefix-caching"],
        ["--seed=1", "--seed=2"],
        ["--seed=1", "--seed=1"],
    ],
)
def test_contradictory_or_repeated_vllm_options_refused(tokens):
    with pytest.raises(OptionError, match="more than once"):
        parse_vllm_options(tokens)


def test_one_form_of_a_switch_is_accepted():
    assert parse_vllm_options(["--no-enable-prefix-caching"]).inference == ("--no-enable-prefix-caching",)


@pytest.mark.parametrize(
    "own",
    [
        ["--served-model-id=a", "--served-model-id=b"],
        ["--served-model-id=a", "--served-model-id", "b"],
        ["--max-top-k=4", "--max-top-k=8"],
        ["--manifest-only", "--manifest-only"],
    ],
)
def test_repeated_launcher_flags_refused(tiny_model, roots, capsys, own):
    args = [f"--model-path={tiny_model}", f"--snapshot-root={roots['snapshot']}", f"--cache-root={roots['cache']}",
            "--max-model-len=64", *own]
    if not any(a.startswith("--served-model-id") for a in own):
        args.append("--served-model-id=t")
    if not any(a.startswith("--max-top-k") for a in own):
        args.append("--max-top-k=4")
    code, err = run_in_process(args, capsys)
    assert code == 2 and "more than once" in err
    assert os.listdir(roots["snapshot"]) == [] and os.listdir(roots["cache"]) == []
