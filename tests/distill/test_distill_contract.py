"""Frozen/strict models, schema discriminators, missing policy fields, tampered
estimates, student-rollout requirements and the capture-row rules."""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from kiln.distill.contract import (
    CAPTURE_TOKEN_SCHEMA,
    CONSUMPTION_EVENT_SCHEMA,
    PLAN_SCHEMA,
    SHARD_MANIFEST_SCHEMA,
    TOKENIZED_TEACHER_EXAMPLE_SCHEMA,
    CaptureTokenRow,
    ConsumptionEvent,
    Plan,
    ShardManifest,
    ThroughputProfile,
    TokenizedTeacherExample,
    complete_plan,
    parse_artifact,
    plan_sha256,
)
from kiln.distill.errors import ContractError, EstimateError, UnknownSchemaError

from tests.distill.conftest import FIXTURES


def _plan_obj() -> dict:
    return json.loads((FIXTURES / "plan.json").read_bytes())


def test_schema_strings_are_exact() -> None:
    assert PLAN_SCHEMA == "soup.autodistill.plan.v1"
    assert CAPTURE_TOKEN_SCHEMA == "soup.autodistill.capture-token.v1"
    assert SHARD_MANIFEST_SCHEMA == "soup.autodistill.shard-manifest.v1"
    assert CONSUMPTION_EVENT_SCHEMA == "soup.autodistill.consumption-event.v1"
    assert TOKENIZED_TEACHER_EXAMPLE_SCHEMA == "soup.autodistill.tokenized-teacher-example.v1"


def test_plan_round_trips_with_schema_alias_and_hash(expert_plan: Plan) -> None:
    raw = (FIXTURES / "plan.json").read_bytes()
    assert expert_plan.schema_id == PLAN_SCHEMA
    assert expert_plan.to_obj()["schema"] == PLAN_SCHEMA and "schema_id" not in expert_plan.to_obj()
    assert expert_plan.canonical_bytes() == raw
    assert plan_sha256(expert_plan) == hashlib.sha256(raw).hexdigest()


def test_models_are_frozen(expert_plan: Plan, expert_rows) -> None:
    with pytest.raises(ValidationError):
        expert_plan.run_id = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        expert_rows[0].position = 7  # type: ignore[misc]
    assert isinstance(expert_plan.teacher.weight_files, tuple)
    assert isinstance(expert_rows[0].selected_logprobs, tuple)


@pytest.mark.parametrize(
    "path",
    [(), ("capture",), ("probability",), ("consumption",), ("teacher",), ("tokenizer",), ("estimate",)],
)
def test_unknown_fields_are_rejected_at_every_level(path: tuple[str, ...]) -> None:
    obj = _plan_obj()
    target = obj
    for key in path:
        target = target[key]
    target["surprise"] = 1
    with pytest.raises(ContractError, match="surprise"):
        Plan.parse(obj)


@pytest.mark.parametrize(
    "section,field",
    [
        ("probability", "top_k"),
        ("probability", "temperature"),
        ("probability", "renormalize_selected"),
        ("probability", "logprob_bytes"),
        ("probability", "entropy_bytes"),
        ("consumption", "replay"),
        ("consumption", "trajectory"),
        ("consumption", "rollout_checkpoint_sha256"),
        ("capture", "max_forced_ids"),
        ("capture", "truncation"),
        (None, "throughput_profile"),
    ],
)
def test_missing_policy_fields_are_rejected(section: str | None, field: str) -> None:
    obj = _plan_obj()
    del (obj[section] if section else obj)[field]
    with pytest.raises(ContractError, match=field):
        Plan.parse(obj)


def test_renormalized_policy_is_refused() -> None:
    obj = _plan_obj()
    obj["probability"]["renormalize_selected"] = True
    with pytest.raises(ContractError, match="renormalize_selected"):
        Plan.parse(obj)


def test_strict_types_do_not_coerce() -> None:
    obj = _plan_obj()
    obj["probability"]["top_k"] = "1"
    with pytest.raises(ContractError, match="top_k"):
        Plan.parse(obj)
    obj = _plan_obj()
    obj["capture"]["planned_tokens"] = True
    with pytest.raises(ContractError, match="planned_tokens"):
        Plan.parse(obj)


def test_unknown_major_version_and_kind_are_rejected() -> None:
    obj = _plan_obj()
    obj["schema"] = "soup.autodistill.plan.v2"
    with pytest.raises(UnknownSchemaError, match="major version v2"):
        Plan.parse(obj)
    with pytest.raises(UnknownSchemaError, match="major version v2"):
        parse_artifact(obj)
    obj["schema"] = "soup.autodistill.mystery.v1"
    with pytest.raises(UnknownSchemaError):
        parse_artifact(obj)
    del obj["schema"]
    with pytest.raises(UnknownSchemaError):
        Plan.parse(obj)


def test_parse_artifact_dispatches(expert_plan: Plan, expert_rows) -> None:
    assert parse_artifact((FIXTURES / "plan.json").read_bytes()) == expert_plan
    assert parse_artifact(expert_rows[0].to_obj()) == expert_rows[0]
    ledger = (FIXTURES / "ledger-student-rollout.jsonl").read_bytes().split(b"\n")[0]
    assert isinstance(parse_artifact(ledger), ConsumptionEvent)
    manifest = (FIXTURES / "shard-teacher-expert" / "manifests" / "3-available.json").read_bytes()
    assert isinstance(parse_artifact(manifest), ShardManifest)


def test_duplicate_keys_and_nan_are_rejected() -> None:
    raw = (FIXTURES / "plan.json").read_bytes()
    with pytest.raises(ContractError, match="duplicate"):
        Plan.parse(raw[:-1] + b',"run_id":"x"}')
    row = (FIXTURES / "rows-teacher-expert.jsonl").read_bytes().split(b"\n")[0]
    with pytest.raises(ContractError):
        CaptureTokenRow.parse(row.replace(b'"entropy":0.8979457248567798', b'"entropy":NaN'))


@pytest.mark.parametrize(
    "field,value",
    [
        ("dense_bytes", 23),
        ("sparse_upper_bytes", 47),
        ("sparse_ids_max", 3),
        ("seconds_min", 1.0),
        ("excludes_metadata", False),
    ],
)
def test_tampered_estimate_is_rejected(field: str, value: object) -> None:
    obj = _plan_obj()
    obj["estimate"][field] = value
    with pytest.raises(ContractError):
        Plan.parse(obj)


def test_changed_planned_tokens_without_new_estimate_is_rejected() -> None:
    obj = _plan_obj()
    obj["capture"]["planned_tokens"] = 3
    with pytest.raises(ContractError, match="estimate"):
        Plan.parse(obj)
    del obj["estimate"]
    rebuilt = complete_plan(obj)
    assert rebuilt.estimate.dense_bytes == 3 * 3 * 4
    assert plan_sha256(rebuilt) != plan_sha256(Plan.parse(_plan_obj()))


def test_complete_plan_refuses_a_supplied_wrong_estimate() -> None:
    obj = _plan_obj()
    obj["estimate"]["dense_bytes"] += 1
    with pytest.raises(EstimateError, match="differs"):
        complete_plan(obj)


def _profile(plan: Plan, **changes) -> dict:
    prof = {
        "backend": plan.capture.backend,
        "teacher_fingerprint_sha256": plan.teacher.digest(),
        "dtype": plan.capture.dtype,
        "quantization": plan.capture.quantization,
        "sequence_length_min": 1,
        "sequence_length_max": 64,
        "hardware_class": "cpu-2core",
        "tokens_per_second_min": 0.5,
        "tokens_per_second_max": 2.0,
    }
    prof.update(changes)
    return prof


def test_measured_profile_gives_seconds_and_must_match(expert_plan: Plan) -> None:
    obj = _plan_obj()
    del obj["estimate"]
    obj["throughput_profile"] = _profile(expert_plan)
    obj["throughput_profile_sha256"] = ThroughputProfile.parse(obj["throughput_profile"]).digest()
    plan = complete_plan(obj)
    assert (plan.estimate.seconds_min, plan.estimate.seconds_max) == (1.0, 4.0)
    bad = copy.deepcopy(obj)
    bad["throughput_profile_sha256"] = "0" * 64
    with pytest.raises(ContractError, match="throughput_profile_sha256"):
        complete_plan(bad)
    other = copy.deepcopy(obj)
    other["throughput_profile"] = _profile(expert_plan, dtype="bfloat16")
    other["throughput_profile_sha256"] = ThroughputProfile.parse(other["throughput_profile"]).digest()
    with pytest.raises(ContractError, match="not compatible.*dtype"):
        complete_plan(other)


def test_student_rollout_policy_requirements(rollout_plan: Plan) -> None:
    obj = json.loads((FIXTURES / "plan-student-rollout.json").read_bytes())
    assert rollout_plan.consumption.replay == "forbidden"
    chained = copy.deepcopy(obj)
    chained["consumption"]["replay"] = "chained"
    with pytest.raises(ContractError, match="consume-once"):
        Plan.parse(chained)
    unbound = copy.deepcopy(obj)
    unbound["consumption"]["rollout_checkpoint_sha256"] = None
    with pytest.raises(ContractError, match="rollout_checkpoint_sha256"):
        Plan.parse(unbound)
    expert = _plan_obj()
    expert["consumption"]["rollout_checkpoint_sha256"] = "a" * 64
    with pytest.raises(ContractError, match="only to student-rollout"):
        Plan.parse(expert)


def test_student_rollout_rows_force_the_sampled_token(rollout_rows) -> None:
    row = rollout_rows[0].to_obj()
    assert row["sampled_token_id"] in row["forced_ids"] and row["target_token_id"] is None
    both = dict(row, target_token_id=row["sampled_token_id"])
    with pytest.raises(ContractError, match="leave target_token_id null"):
        CaptureTokenRow.parse(both)
    unforced_id = next(i for i in range(3) if i not in row["forced_ids"])
    with pytest.raises(ContractError, match="forced_ids"):
        CaptureTokenRow.parse(dict(row, sampled_token_id=unforced_id))


def test_tokenized_example_requires_a_prompt() -> None:
    line = (FIXTURES / "dataset.jsonl").read_bytes().strip()
    ex = TokenizedTeacherExample.parse(line)
    assert ex.prompt_token_ids == (2, 0)
    with pytest.raises(ContractError, match="prompt_token_ids"):
        TokenizedTeacherExample.parse(dict(ex.to_obj(), prompt_token_ids=[]))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"state": "complete"}, "predecessor"),
        ({"previous_manifest_sha256": "0" * 64}, "no predecessor"),
        ({"rows": 5}, "sums"),
        ({"quarantine_reason": "x"}, "quarantine_reason"),
    ],
)
def test_manifest_local_rules(change: dict, match: str) -> None:
    staging = json.loads((FIXTURES / "shard-teacher-expert" / "manifests" / "0-staging.json").read_bytes())
    with pytest.raises(ContractError, match=match):
        ShardManifest.parse(dict(staging, **change))


def test_payload_paths_must_be_safe() -> None:
    avail = json.loads((FIXTURES / "shard-teacher-expert" / "manifests" / "3-available.json").read_bytes())
    for bad in ("../escape.jsonl", "/abs/rows.jsonl", "payload/./rows.jsonl", "payload\\rows.jsonl"):
        obj = copy.deepcopy(avail)
        obj["payloads"][0]["path"] = bad
        with pytest.raises(ContractError, match="path"):
            ShardManifest.parse(obj)


def test_consumption_event_local_rules() -> None:
    first, second = [
        json.loads(x) for x in (FIXTURES / "ledger-student-rollout.jsonl").read_bytes().split(b"\n")[:2]
    ]
    with pytest.raises(ContractError, match="checkpoint"):
        ConsumptionEvent.parse(dict(second, checkpoint_sha256=None))
    with pytest.raises(ContractError, match="only a commit"):
        ConsumptionEvent.parse(dict(first, checkpoint_sha256="a" * 64))
    # replay_of belongs only on a reservation; committed->reserved always needs it.
    with pytest.raises(ContractError, match="replay_of belongs only"):
        ConsumptionEvent.parse(dict(second, replay_of="a" * 64))
    with pytest.raises(ContractError, match="needs replay_of"):
        ConsumptionEvent.parse(dict(first, sequence=2, prior_state="committed"))
    # A reservation from 'available' may carry replay_of (after a released replay);
    # whether it must, or may not, depends on the ledger's history, checked there.
    assert ConsumptionEvent.parse(dict(first, replay_of="a" * 64)).action == "replay"
    assert ConsumptionEvent.parse(first).action == "reserve"


# ----------------------------------------------------- exact, uncapped byte counts

QWEN_VOCAB = 152_064


def _realistic_config(tokens: int, vocab: int) -> dict:
    obj = _plan_obj()
    del obj["estimate"]
    obj["capture"]["planned_tokens"] = tokens
    obj["tokenizer"]["vocab_size"] = vocab
    obj["probability"].update(top_k=64, logprob_bytes=2)
    return obj


def test_a_realistic_plan_builds_with_exact_byte_counts() -> None:
    plan = complete_plan(_realistic_config(10**10, QWEN_VOCAB))
    dense = 10**10 * QWEN_VOCAB * 2
    assert dense == 3_041_280_000_000_000 > 10**15
    assert plan.estimate.dense_bytes == dense
    assert plan.estimate.sparse_upper_bytes == 10**10 * (65 * (4 + 2) + 4 + 4)
    raw = plan.canonical_bytes()
    assert b'"dense_bytes":3041280000000000,' in raw  # an exact JSON integer, no float, no exponent
    assert Plan.parse(raw) == plan and Plan.parse(raw).canonical_bytes() == raw


def test_byte_counts_have_no_artificial_ceiling() -> None:
    from kiln.distill import estimate

    # The largest estimate the input limits allow is far above 2**64 and stays exact.
    top = complete_plan(_realistic_config(estimate.MAX_PLANNED_TOKENS, estimate.MAX_VOCAB_SIZE))
    assert top.estimate.dense_bytes == estimate.MAX_PLANNED_TOKENS * estimate.MAX_VOCAB_SIZE * 2 > 2**64
    assert str(top.estimate.dense_bytes).encode() in top.canonical_bytes()
    obj = _plan_obj()
    obj["teacher"]["weight_files"][0]["size"] = 2**70  # a file size above the old 2**50 cap
    assert Plan.parse(obj).teacher.weight_files[0].size == 2**70
    avail = json.loads((FIXTURES / "shard-teacher-expert" / "manifests" / "3-available.json").read_bytes())
    avail["payloads"][0]["bytes"] = 10**16
    assert ShardManifest.parse(avail).payloads[0].bytes == 10**16
    avail["payloads"][0]["bytes"] = 0
    with pytest.raises(ContractError, match="bytes"):
        ShardManifest.parse(avail)


def test_a_rate_that_overflows_seconds_is_refused_not_infinite(expert_plan: Plan) -> None:
    from kiln.distill.estimate import estimate_numbers

    args = dict(tokens=10**13, vocab_size=3, top_k=1, max_forced=1, id_bytes=4, logprob_bytes=4, tail_bytes=4,
                entropy_bytes=4)
    with pytest.raises(EstimateError, match="Infinity"):
        estimate_numbers(**args, throughput_min=1e-300, throughput_max=1.0)
    obj = _plan_obj()
    del obj["estimate"]
    obj["throughput_profile"] = _profile(expert_plan, tokens_per_second_min=5e-324)
    obj["throughput_profile_sha256"] = ThroughputProfile.parse(obj["throughput_profile"]).digest()
    with pytest.raises(ContractError, match="Infinity"):
        complete_plan(obj)


def test_contract_modules_import_no_heavy_runtime() -> None:
    probe = (
        "import sys, kiln.distill.contract, kiln.distill.shards, kiln.distill.ledger, kiln.distill.dataset, "
        "kiln.distill.cli\n"
        "heavy = {'torch', 'transformers', 'peft', 'vllm', 'mlx', 'numpy', 'safetensors'}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
