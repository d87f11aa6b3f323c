"""The job-kind registry is the one list of kinds: routes, dispatch and the plan's payload all come from it,
and the one ``seal_plan`` makes the digests every kind records (docs/training.md, "The job as a recipe")."""

from __future__ import annotations

import pytest

from kiln.canonical import canonical_json_bytes, domain_digest
from kiln.training.core.plan import INPUTS_DOMAIN, PLAN_DOMAIN, RUN_ONLY_FIELDS, seal_plan
from kiln.training.kd.schemas import KDRequest
from kiln.training.opd.schemas import OPDRequest
from kiln.training.queue import kinds
from kiln.training.schemas import GRPORequest, SFTRequest

MSGS = [{"role": "user", "content": "q"}]


def test_every_wire_kind_has_one_route_and_the_routes_come_from_the_registry():
    from kiln.serving.routes_training import router

    submit = sorted(r.path for r in router.routes if r.path.startswith("/v1/train/") and "POST" in r.methods)
    assert submit == sorted(f"/v1/train/{k.kind}" for k in kinds.wire_kinds())
    assert {k.kind for k in kinds.KINDS} == {"sft", "grpo", "opd", "kd"}
    assert {k.kind: k.schema for k in kinds.wire_kinds()} == {
        "sft": SFTRequest, "grpo": GRPORequest, "opd": OPDRequest, "kd": KDRequest}
    for kind in kinds.wire_kinds():
        route = next(r for r in router.routes if r.path == f"/v1/train/{kind.kind}")
        assert route.endpoint.__doc__ == kind.summary and route.status_code == 202


def test_dispatch_picks_the_kind_by_schema_and_request_and_runs_plans_by_payload():
    scored = GRPORequest.model_validate({"adapter": "g", "groups": [{"messages": MSGS, "completions": [
        {"text": "a", "reward": 1.0}, {"text": "b", "reward": 0.0}]}]})
    rollouts = GRPORequest.model_validate({"adapter": "g", "prompts": [{"messages": MSGS, "reference": "a"}],
                                           "reward": {"type": "scorer", "scorer": {"type": "contains"}}})
    assert kinds.kind_of(scored).name == "grpo" and kinds.kind_of(rollouts).name == "grpo_rollouts"
    assert kinds.kind_of(SFTRequest.model_validate({"adapter": "s", "examples": [{"messages": MSGS + [
        {"role": "assistant", "content": "a"}]}]})).name == "sft"
    assert len({k.data for k in kinds.KINDS}) == len(kinds.KINDS)  # a plan's payload names its kind
    assert kinds.schema_for("kd") is KDRequest
    with pytest.raises(KeyError):
        kinds.schema_for("nope")


def test_seal_plan_is_the_documented_digest():
    eff = {"adapter": "a", "epochs": 2, "auto_load": True, "resume_from_job": None, "checkpoint_interval": 0,
           "locality": {"override": True}}
    inputs = [{"messages": MSGS}]
    inputs_sha, plan_sha = seal_plan("sft", eff, inputs, "e" * 64)
    assert inputs_sha == domain_digest(INPUTS_DOMAIN, b"sft", canonical_json_bytes(inputs))
    config = {"adapter": "a", "epochs": 2}  # the run-only fields are left out
    assert set(RUN_ONLY_FIELDS) == {"auto_load", "resume_from_job", "checkpoint_interval", "locality"}
    assert plan_sha == domain_digest(PLAN_DOMAIN, canonical_json_bytes(
        {"kind": "sft", "config": config, "inputs_sha256": inputs_sha, "base_model_sha256": "e" * 64}))
    assert (eff["inputs_sha256"], eff["plan_sha256"]) == (inputs_sha, plan_sha)
    # another kind's digests differ for the same inputs (the kind is hashed into both)
    assert seal_plan("opd", dict(eff), inputs, "e" * 64)[0] != inputs_sha
