"""Wire models for ``/v1/openenv/*`` (pydantic only; no torch)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kiln.canonical import canonical_json_bytes
from kiln.adapter_names import NAME_SCHEMA
from kiln.openenv.discovery import check_env_url
from kiln.runtime.chat_generation import ChatGenerationFields

MAX_INSTRUCTIONS_CHARS = 8_192
MAX_GROUPS = 256
MAX_GROUP_SIZE = 64
MAX_EPISODE_STEPS = 64
MAX_ACTION_TOKENS = 8_192  # reasoning and action; the context left after the prompt caps it too
MAX_RESET_BYTES = 16_384
MAX_TRAINING_BYTES = 65_536
ROLLOUT_OWNED = ("groups",)  # GRPO fields the run fills in; a request that sets them is refused
RUN_ID_RE = re.compile(r"^oerun-[0-9a-f]{16}$")
RUN_STATES = ("queued", "discovering", "collecting", "revalidating", "training", "succeeded", "failed", "cancelled")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
ARTIFACT_SHA256_HEADER = "x-kiln-artifact-sha256"


# check_env_url's rule as a JSON Schema pattern (published in /openapi.json): loopback host, port 0-65535
_PORT = r"([0-9]{1,4}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
_LOOPBACK_URL = rf"^http://(127\.0\.0\.1|localhost|\[::1\])(:{_PORT})?/?$"

def _training_schema() -> dict[str, Any]:
    """``training`` as ``OpenEnvService.preflight`` validates it: GRPORequest's fields, less the groups the run
    collects and the fields only a prompts-and-reward job takes, each with GRPORequest's own schema, inlined
    (a ``$ref`` here would name a definition of another model's document)."""
    from kiln.training.schemas import ROLLOUT_FIELDS, GRPORequest

    grpo = GRPORequest.model_json_schema()
    names = sorted(set(GRPORequest.model_fields) - set(ROLLOUT_OWNED) - set(ROLLOUT_FIELDS))
    return {"required": ["adapter"], "additionalProperties": False, "allOf": grpo.get("allOf", []),
            "properties": {k: _inline(grpo["properties"][k], grpo.get("$defs", {})) for k in names}}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """``node`` with every ``{"$ref": "#/$defs/X"}`` replaced by ``X`` itself (the models are not recursive)."""
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _inline(v, defs) for k, v in node.items() if k != "$ref"}
    if "$ref" not in node:
        return out
    target = _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    return {"allOf": [target], **out} if out else target


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class OpenEnvRunRequest(_Wire, ChatGenerationFields):
    env_url: str = Field(description="the environment server, on loopback: http://127.0.0.1:<port>",
                         json_schema_extra={"pattern": _LOOPBACK_URL})
    instructions: str = Field("", max_length=MAX_INSTRUCTIONS_CHARS,
                              description="system prompt; the action schema is appended to it")
    group_size: int = Field(4, ge=2, le=MAX_GROUP_SIZE, description="episodes per group (one reset seed each group)")
    groups: int = Field(4, ge=1, le=MAX_GROUPS)
    max_steps: int = Field(8, ge=1, le=MAX_EPISODE_STEPS, description="Kiln's step cutoff per episode")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="group g resets with seed + g")
    reset: dict[str, Any] = Field(default_factory=dict, description="extra reset fields (a `seed` here is replaced)")
    temperature: float = Field(1.0, ge=0, le=2)
    max_action_tokens: int = Field(64, ge=1, le=MAX_ACTION_TOKENS)
    constrained: bool = Field(True, description="decode actions under the environment's action schema")
    protocol_error_reward: float = Field(-1.0, ge=-1e6, le=1e6, allow_inf_nan=False,
                                         description="added to the return of an invalid_model_action or protocol_error episode")
    policy_adapter: str | None = Field(None, max_length=64, json_schema_extra=NAME_SCHEMA,
                                       description="a loaded adapter that generates the actions (default: the base model)")
    training: dict[str, Any] = Field(description="the GRPO job's fields (POST /v1/train/grpo without `groups`)",
                                     json_schema_extra=lambda s: s.update(_training_schema()))
    idempotency_key: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$",
                                        description="a retry with the same key and request returns the original run; "
                                        "the same key with any other field changed is a 409")

    @field_validator("env_url")
    @classmethod
    def _url(cls, v: str) -> str:
        return check_env_url(v)

    @model_validator(mode="after")
    def _bounded(self) -> OpenEnvRunRequest:
        if len(canonical_json_bytes(self.reset)) > MAX_RESET_BYTES:
            raise ValueError(f"reset is over {MAX_RESET_BYTES} bytes")
        if len(canonical_json_bytes(self.training)) > MAX_TRAINING_BYTES:
            raise ValueError(f"training is over {MAX_TRAINING_BYTES} bytes")
        owned = [k for k in ROLLOUT_OWNED if k in self.training]
        if owned:
            raise ValueError(f"training.{owned[0]} is filled by the run from its episodes; remove it")
        if "adapter" not in self.training:
            raise ValueError("training.adapter is required: the name the trained adapter is published under")
        return self


class OpenEnvError(_Wire):
    code: str
    message: str


class OpenEnvRun(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["openenv.run"] = "openenv.run"
    state: Literal["queued", "discovering", "collecting", "revalidating", "training", "succeeded", "failed", "cancelled"]
    admission_seq: int
    queue_position: int | None = None
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    request: dict[str, Any]
    training_contract: dict[str, Any] = Field(description="the effective GRPO config materialised at preflight")
    environment: dict[str, Any] | None = None
    progress: dict[str, Any]
    returns: dict[str, Any] | None = None
    terminations: dict[str, int]
    artifacts: dict[str, dict[str, Any]] | None = Field(
        None, description="files published in the run directory: name -> {sha256, bytes} (after revalidation)")
    training_job: dict[str, Any] | None = None
    policy: dict[str, Any] | None = Field(
        None, description="the policy every action came from: {adapter, revision} (null, null: the base model), "
                          "pinned by the first action; another revision fails the run (policy_revision_changed)")
    error: OpenEnvError | None = None


class OpenEnvRunList(BaseModel):
    model_config = ConfigDict(extra="forbid")

    object: Literal["list"] = "list"
    data: list[OpenEnvRun]


class OpenEnvPreflight(BaseModel):
    model_config = ConfigDict(extra="forbid")

    object: Literal["openenv.preflight"] = "openenv.preflight"
    training_contract: dict[str, Any] = Field(description="the effective GRPO config a run with this request trains with")
    training_contract_sha256: str = Field(description="its digest (domain kiln.openenv-training-contract.v1)")
    environment: dict[str, Any] = Field(description="url, name, discovery_sha256, documents, action_schema")
    capacity: dict[str, Any] = Field(description="a point-in-time snapshot; capacity_reserved is always false")
