"""Wire models for ``/v1/train/*`` requests (pydantic only; no torch).

Every field is bounded here; cross-field checks that need the model (token
lengths, target modules, the adapter store) happen in :mod:`kiln.training.queue.service`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from kiln.adapters.manifest import MAX_LORA_RANK  # the one rank limit
from kiln.adapter_names import NAME_RE as ADAPTER_NAME_RE
from kiln.adapter_names import NAME_SCHEMA
from kiln.evals.schemas import SUITE_NAME_SCHEMA, PostEval, Scorer, _check_suite_name
from kiln.runtime.chat_generation import ChatGenerationFields, ReasoningLossField
from kiln.wire_rules import NOT_NULL, field_is, never_both, rules

MAX_MESSAGE_CHARS = 32_768
MAX_MESSAGES_PER_EXAMPLE = 64
MAX_INLINE_EXAMPLES = 1_000
MAX_GROUPS = 1_000
MAX_COMPLETIONS_PER_GROUP = 64
MAX_COMPLETION_CHARS = 32_768
MAX_EPOCHS = 1_000
MAX_BATCH_SIZE = 256
MAX_TARGET_MODULES = 32
MAX_SEQ_LEN = 8_192
MAX_PATH_CHARS = 1_024
MAX_ABS_REWARD = 1e6
MAX_ROLLOUT_PROMPTS = 256
MAX_ROLLOUT_ITERATIONS = 1_000
MAX_ROLLOUT_TOKENS = 8_192  # = MAX_SEQ_LEN: the job's context (prompt + max_tokens <= max_seq_len) is the cap
MAX_REWARD_URL_CHARS = 2_048
MAX_REWARD_TIMEOUT_S = 300.0
MAX_REWARD_RESPONSE_BYTES = 16 * 1024 * 1024

# Defaults tuned so a one-example correction on the built-in model is learned
# (greedy answer reproduced) in well under a second of training on 2 CPU cores.
# When `epochs` is omitted an SFT job trains until its targets are the greedy
# answer (checked every DEFAULT_LEARNED_EVERY steps, by a logit margin), at
# most DEFAULT_LEARNED_MAX_STEPS steps.
DEFAULT_LEARNED_EVERY = 5
DEFAULT_LEARNED_MARGIN = 1.0
DEFAULT_LEARNED_MAX_STEPS = 300
MAX_STEPS = 1_000_000
DEFAULT_LEARNING_RATE = 2e-3  # SFT (and judge training): see DEFAULT_ANCHOR_WEIGHT and docs/training.md "Locality"
DEFAULT_LORA_RANK = 16
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
# SFT's default targets (kiln.training.core.plan.correction_target_modules): the MLP, where a correction's fact
# is kept with the least change elsewhere (docs/training.md, "Locality"); the attention ones for other kinds
MLP_TARGET_MODULES = ("gate_proj", "up_proj", "down_proj")
# the Gated DeltaNet projections of a Qwen3.5 hybrid (transformers 5.23 names): added to the default
# targets of a model that has them, so its linear-attention layers are adapted too
LINEAR_ATTENTION_TARGET_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
DEFAULT_MIN_STEPS = 20  # when `epochs` is omitted: enough epochs for this many steps...
DEFAULT_MAX_EPOCHS = 50  # ...but never more than this many epochs
DEFAULT_SEQ_LEN = 1_024

# The KL-to-base anchor (kiln.training.core.anchor, docs/training.md "Locality"): the base model's own questions and
# greedy answers, rehearsed each step under forward KL to the base so a job changes what it targets and little
# else. Measured on the built-in model (bench/locality.py): see the defaults' rationale in docs/training.md.
DEFAULT_ANCHOR_WEIGHT = 8.0
# SFT's AdamW weight decay: keeps the adapter at the smallest weights that hold its corrections, so a chain of
# sequential corrections drifts less (docs/training.md, "Locality"); the other kinds: 0
DEFAULT_SFT_WEIGHT_DECAY = 1.0
DEFAULT_ANCHOR_QUESTIONS = 64
DEFAULT_ANCHOR_PER_STEP = 8
# Pre-scored GRPO: off by default (not measured: the groups are the user's). GRPO with rollouts (`prompts` and a
# `reward`): on at the SFT weight, with DEFAULT_GRPO_ROLLOUT_LEARNING_RATE and DEFAULT_GRPO_ROLLOUT_ITERATIONS
# when the request does not set them. Issue 48, the built-in model rewarded for one word ("wheels", never said
# by the base on those prompts): the previous defaults (1 iteration, lr 1e-3, no anchor) failed (every group
# zero-variance); lr 0.02 x 12 without the anchor reached 1.0 and left 0/10 base answers; lr 5e-3 x 30 with the
# anchor at weight 8 reached 0.72 with 10/10 kept and none degenerate; lr 1e-2 x 60 with it 0.97, 10/10 kept
# (bench/locality.py --grpo; docs/training.md "GRPO").
DEFAULT_GRPO_ANCHOR_WEIGHT = 0.0
DEFAULT_GRPO_ROLLOUT_ANCHOR_WEIGHT = DEFAULT_ANCHOR_WEIGHT
DEFAULT_GRPO_ROLLOUT_LEARNING_RATE = 1e-2
DEFAULT_GRPO_ROLLOUT_ITERATIONS = 60
DEFAULT_GRPO_LEARNING_RATE = 1e-3  # pre-scored groups
MAX_ANCHOR_QUESTIONS = 1_024
MAX_ANCHOR_PROMPTS = 64  # the caller's own anchor questions (beside the ones the base model writes)
MAX_ANCHOR_PER_STEP = 256
# Sequential corrections: an SFT job continuing `base_adapter` replays the corrections stored with its revision
# (the manifest config's `corrections`), at most this many bytes of canonical JSON (the oldest are dropped first).
MAX_CORRECTION_BYTES = 128 * 1024

JOB_ID_RE = re.compile(r"^job-[0-9a-f]{16}$")


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChatMessage(_Wire):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=MAX_MESSAGE_CHARS)
    # assistant turns (vLLM's field): the turn's reasoning, rendered by templates that show it (Qwen3's
    # <think> block); left out of dumps when unset, so recipes and digests of turns without it do not change
    reasoning_content: str | None = Field(None, max_length=MAX_MESSAGE_CHARS)

    @model_validator(mode="after")
    def _reasoning_on_assistant(self) -> ChatMessage:
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        return self

    @model_serializer(mode="wrap")
    def _drop_unset_reasoning(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("reasoning_content", "") is None:
            del out["reasoning_content"]
        return out


class SFTExample(_Wire):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES_PER_EXAMPLE)

    @model_validator(mode="after")
    def _has_assistant(self) -> SFTExample:
        if not any(m.role == "assistant" for m in self.messages):
            raise ValueError("an SFT example needs at least one assistant message (the loss is on assistant tokens)")
        return self


class Turn(_Wire):
    """One later step of a multi-turn completion: what the policy was told, then what it answered."""

    observation: str = Field(max_length=MAX_COMPLETION_CHARS, description="the user message after the previous action")
    text: str = Field(max_length=MAX_COMPLETION_CHARS, description="the policy's next action")


class Completion(_Wire):
    text: str = Field(max_length=MAX_COMPLETION_CHARS)
    reward: float = Field(ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD, allow_inf_nan=False)
    turns: list[Turn] | None = Field(
        None, min_length=1, max_length=MAX_MESSAGES_PER_EXAMPLE,
        description="multi-turn episodes (OpenEnv): later steps after `text`; every action is trained with the "
                    "conversation before it as its prompt and the completion's advantage (docs/openenv.md)")

    @model_serializer(mode="wrap")
    def _omit_unset_turns(self, handler: Any) -> Any:
        out = handler(self)  # a single-turn completion dumps as before (its digests do not change)
        if isinstance(out, dict) and out.get("turns") is None:
            out.pop("turns", None)
        return out


class GRPOGroup(_Wire):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES_PER_EXAMPLE)
    completions: list[Completion] = Field(min_length=2, max_length=MAX_COMPLETIONS_PER_GROUP)

    @model_validator(mode="after")
    def _ends_with_prompt(self) -> GRPOGroup:
        if self.messages[-1].role == "assistant":
            raise ValueError("a GRPO group's messages are the prompt: the last one must not be an assistant turn")
        return self


MAX_LOCALITY_PROMPTS = 64  # the job's own probe prompts (kiln.training.core.locality.MAX_USER_PROBES)
MAX_LOCALITY_PROMPT_CHARS = 2_000


class LocalityRequest(_Wire):
    """How the job measures its adapter's locality and whether the locality guard may hold it back
    (docs/training.md, "Locality")."""

    measure: bool = Field(True, description="measure the adapter's locality at the job's end (the server's "
                                            "locality.measure must be on too)")
    prompts: list[Annotated[str, Field(min_length=1, max_length=MAX_LOCALITY_PROMPT_CHARS)]] | None = Field(
        None, min_length=1, max_length=MAX_LOCALITY_PROMPTS,
        description="your own probe questions (user messages), answered by the base model and the adapter beside "
                    "the ones the base model writes itself")
    eval_suite: Annotated[str, Field(json_schema_extra=SUITE_NAME_SCHEMA)] | None = Field(
        None, description="an eval suite whose examples' prompts (the first 64) are probes too")
    override: bool = Field(False, description="activate (auto_load, post_eval activate_on_pass / "
                                              "set_default_on_pass) even when the locality guard would hold the "
                                              "adapter back")

    _suite_name = field_validator("eval_suite")(classmethod(lambda cls, v: v if v is None else _check_suite_name(v)))


class _TrainCommon(_Wire):
    # _post_eval_owns_activation, as JSON Schema
    model_config = ConfigDict(json_schema_extra=rules(never_both(field_is("post_eval", NOT_NULL),
                                                                 field_is("auto_load", {"const": True}))))

    adapter: str = Field(description="name the trained adapter is published under", json_schema_extra=NAME_SCHEMA)
    base_adapter: str | None = Field(None, description="continue training from this published adapter",
                                     json_schema_extra=NAME_SCHEMA)
    epochs: int | None = Field(None, ge=1, le=MAX_EPOCHS, description="default: enough for DEFAULT_MIN_STEPS steps")
    learning_rate: float = Field(DEFAULT_LEARNING_RATE, gt=0, le=1.0)
    lora_rank: int | None = Field(None, ge=1, le=MAX_LORA_RANK)
    lora_alpha: float | None = Field(None, gt=0, le=4096)
    lora_target_modules: Annotated[list[Annotated[str, Field(json_schema_extra={"pattern": "^[A-Za-z0-9_.]{1,64}$"})]],
                                   Field(min_length=1, max_length=MAX_TARGET_MODULES,
                                         json_schema_extra={"uniqueItems": True})] | None = None
    seed: int = Field(0, ge=0, le=2**31 - 1)
    batch_size: int = Field(8, ge=1, le=MAX_BATCH_SIZE)
    max_seq_len: int = Field(DEFAULT_SEQ_LEN, ge=8, le=MAX_SEQ_LEN)
    checkpoint_interval: int = Field(0, ge=0, le=1_000_000, description="steps between checkpoints; 0: none")
    max_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="cap on optimizer steps")
    auto_load: bool = False
    resume_from_job: Annotated[str, Field(json_schema_extra={"pattern": JOB_ID_RE.pattern})] | None = Field(
        None, description="continue an interrupted job from its last checkpoint")
    post_eval: PostEval | None = Field(None, description="evaluate the published adapter against a baseline and "
                                       "activate it only on a `promoted` verdict with activate_on_pass (docs/evals.md)")
    locality: LocalityRequest | None = Field(None, description="the locality measure's probe prompts, turning it "
                                             "off, and the locality guard's override (docs/training.md, "
                                             "\"Locality\")")
    anchor_weight: float | None = Field(
        None, ge=0, le=100, allow_inf_nan=False,
        description="weight of the KL-to-base anchor: the base model's own questions and answers, rehearsed each "
                    "step so the adapter keeps what the base knew (docs/training.md, \"Locality\"); 0: off; "
                    "default: DEFAULT_ANCHOR_WEIGHT for SFT and OPD (beside its rehearsal), 0 for GRPO and KD")
    weight_decay: float | None = Field(
        None, ge=0, le=100, allow_inf_nan=False,
        description="AdamW's decoupled weight decay on the adapter (towards the base model); default "
                    "DEFAULT_SFT_WEIGHT_DECAY for SFT, 0 for the other kinds (docs/training.md, \"Locality\")")
    anchor_questions: int | None = Field(None, ge=0, le=MAX_ANCHOR_QUESTIONS,
                                         description="questions the base model writes for the anchor; default "
                                                     "DEFAULT_ANCHOR_QUESTIONS")
    anchor_prompts: list[Annotated[str, Field(min_length=1, max_length=MAX_LOCALITY_PROMPT_CHARS)]] | None = Field(
        None, min_length=1, max_length=MAX_ANCHOR_PROMPTS,
        description="your own questions (user messages) for the anchor: the base model answers each greedily and "
                    "every step rehearses them in turn with its own questions; what a correction must not change")
    anchor_per_step: int | None = Field(None, ge=1, le=MAX_ANCHOR_PER_STEP,
                                        description="anchor rows per optimizer step; default DEFAULT_ANCHOR_PER_STEP")

    @model_validator(mode="after")
    def _post_eval_owns_activation(self) -> _TrainCommon:
        if self.post_eval is not None and self.auto_load:
            raise ValueError("with post_eval, activation is post_eval.activate_on_pass; leave auto_load false")
        return self

    @field_validator("adapter", "base_adapter")
    @classmethod
    def _adapter_name(cls, v: str | None) -> str | None:
        if v is not None and not ADAPTER_NAME_RE.fullmatch(v):
            raise ValueError("adapter names are 1-64 characters: letters, digits, '.', '_', '-', starting alphanumeric")
        return v

    @field_validator("lora_target_modules")
    @classmethod
    def _modules(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        for name in v:
            if not re.fullmatch(r"[A-Za-z0-9_.]{1,64}", name):
                raise ValueError(f"invalid target module name {name!r}")
        if len(set(v)) != len(v):
            raise ValueError("lora_target_modules has duplicates")
        return sorted(v)

    @field_validator("resume_from_job")
    @classmethod
    def _job_id(cls, v: str | None) -> str | None:
        if v is not None and not JOB_ID_RE.match(v):
            raise ValueError("resume_from_job must be a job ID like 'job-0123456789abcdef'")
        return v


class SFTRequest(_TrainCommon, ReasoningLossField):
    examples: list[SFTExample] | None = Field(None, min_length=1, max_length=MAX_INLINE_EXAMPLES)
    dataset_path: str | None = Field(None, max_length=MAX_PATH_CHARS, description="JSONL file inside the data dir")
    until_learned: bool | None = Field(
        None, description="stop once every assistant turn is the greedy answer; default: on when epochs is omitted")
    learned_check_every: int | None = Field(
        None, ge=1, le=10_000, description="steps between learned checks; default: once per pass over the "
                                           "examples, at most DEFAULT_LEARNED_EVERY")
    learned_margin: float = Field(DEFAULT_LEARNED_MARGIN, ge=0, le=100, allow_inf_nan=False,
                                  description="logit margin by which each target token must be the greedy choice")
    packing: bool = Field(True, description="pack each batch's examples into fewer sequences (position_ids restart "
                                            "per example) so padding is not computed; same loss up to float rounding")
    gradient_checkpointing: bool = Field(False, description="recompute each decoder layer in backward instead of "
                                                            "keeping its activations (less memory, slower steps)")
    replay_corrections: bool = Field(
        True, description="with base_adapter and inline examples: train on the corrections stored with the base "
                          "adapter's revision too, so earlier corrections are kept (docs/training.md, \"Sequential "
                          "corrections\")")
    scope: Literal["auto", "corrections", "off"] | None = Field(
        None, description="\"corrections\": the published adapter answers only requests about its stored corrections "
                          "(their questions' words, kiln.adapters.scope); every other request addressed to it is "
                          "answered by the base model. \"auto\": unscoped while the job's locality passes the guard, "
                          "scoped when only that keeps the base's other answers. \"off\": never scoped. Default: "
                          "\"corrections\" when the base adapter is scoped, else \"auto\" for inline examples and "
                          "\"off\" for a dataset (docs/training.md, \"Scoped corrections\")")

    @model_validator(mode="after")
    def _one_source(self) -> SFTRequest:
        if (self.examples is None) == (self.dataset_path is None):
            raise ValueError("give exactly one of `examples` (inline) or `dataset_path` (JSONL in the data dir)")
        if self.scope in ("corrections", "auto") and self.examples is None:
            raise ValueError(f"scope \"{self.scope}\" routes by stored corrections: give inline `examples`")
        return self


class RolloutPrompt(_Wire):
    """One prompt Kiln samples a group of completions for (GRPO with rollouts)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES_PER_EXAMPLE)
    reference: str | None = Field(None, max_length=MAX_COMPLETION_CHARS,
                                  description="what a scorer reward compares against; sent to file/HTTP rewards")

    @model_validator(mode="after")
    def _ends_with_prompt(self) -> RolloutPrompt:
        if self.messages[-1].role == "assistant":
            raise ValueError("a rollout prompt's last message must not be an assistant turn")
        return self


class ScorerReward(_Wire):
    """Reward 1.0 when the eval scorer passes against the prompt's reference, else 0.0."""

    type: Literal["scorer"]
    scorer: Scorer


class PythonReward(_Wire):
    """``reward(messages, completion, reference) -> float`` from a Python file under the data dir, run in the
    evals sandbox (needs ``eval.allow_code_execution = true``)."""

    type: Literal["python"]
    path: str = Field(min_length=1, max_length=MAX_PATH_CHARS, description="relative to the data dir")
    timeout_s: float = Field(30.0, gt=0, le=MAX_REWARD_TIMEOUT_S, description="per scoring batch")
    memory_mb: int = Field(512, ge=64, le=4_096)


class HTTPReward(_Wire):
    """POST the completions to a reward endpoint on loopback (IP literal); redirects are not followed."""

    type: Literal["http"]
    url: str = Field(min_length=1, max_length=MAX_REWARD_URL_CHARS)
    timeout_s: float = Field(30.0, gt=0, le=MAX_REWARD_TIMEOUT_S)
    max_response_bytes: int = Field(1024 * 1024, ge=1024, le=MAX_REWARD_RESPONSE_BYTES)


Reward = Annotated[ScorerReward | PythonReward | HTTPReward, Field(discriminator="type")]
# GRPORequest fields that only apply with `prompts` (left out of a pre-scored job's plan when unset).
ROLLOUT_FIELDS = ("prompts", "reward", "group_size", "iterations", "max_tokens", "temperature", "top_p",
                  "chat_template_kwargs", "thinking_token_budget")


class GRPORequest(_TrainCommon, ChatGenerationFields, ReasoningLossField):
    groups: list[GRPOGroup] | None = Field(None, min_length=1, max_length=MAX_GROUPS,
                                           description="pre-scored completion groups")
    prompts: list[RolloutPrompt] | None = Field(
        None, min_length=1, max_length=MAX_ROLLOUT_PROMPTS,
        description="prompts Kiln samples `group_size` completions for and scores with `reward`")
    reward: Reward | None = Field(None, description="with `prompts`: a scorer, a sandboxed Python file or an HTTP "
                                                    "endpoint on loopback")
    group_size: int | None = Field(None, ge=2, le=MAX_COMPLETIONS_PER_GROUP, description="default 8")
    iterations: int | None = Field(None, ge=1, le=MAX_ROLLOUT_ITERATIONS,
                                   description="sample -> score -> update rounds; default "
                                               "DEFAULT_GRPO_ROLLOUT_ITERATIONS")
    max_tokens: int | None = Field(None, ge=1, le=MAX_ROLLOUT_TOKENS, description="per completion; default 64")
    temperature: float | None = Field(None, gt=0, le=2.0, allow_inf_nan=False, description="default 1.0")
    top_p: float | None = Field(None, gt=0, le=1.0, description="default 1.0")
    clip_epsilon: float = Field(0.2, gt=0, lt=1)
    scale_rewards: bool = Field(True, description="divide centred rewards by the group's std")
    kl_coef: float = Field(0.0, ge=0, le=100)
    kl_estimator: Literal["k1", "k3"] = "k3"
    learning_rate: float = Field(DEFAULT_GRPO_LEARNING_RATE, gt=0, le=1.0,
                                 description="default DEFAULT_GRPO_LEARNING_RATE with `groups`, "
                                             "DEFAULT_GRPO_ROLLOUT_LEARNING_RATE with `prompts`")

    @model_validator(mode="after")
    def _one_source(self) -> GRPORequest:
        if (self.groups is None) == (self.prompts is None):
            raise ValueError("give exactly one of `groups` (pre-scored) or `prompts` with a `reward`")
        if self.prompts is not None and self.reward is None:
            raise ValueError("`prompts` needs a `reward` (scorer, python or http)")
        if self.groups is not None:
            extra = [k for k in ROLLOUT_FIELDS if getattr(self, k) is not None and k != "groups"]
            if extra:
                raise ValueError(f"{extra} only apply with `prompts`")
        return self
