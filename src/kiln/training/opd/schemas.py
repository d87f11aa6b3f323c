"""Wire model for ``POST /v1/train/opd`` (pydantic only; no torch).

Bounded here; what needs the model, the adapter store or the teacher registry
(token lengths, the teacher's top-K ceiling, the alias being usable) is checked
in :func:`kiln.training.opd.job.prepare_opd` before the job is queued.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from kiln.runtime.chat_generation import ChatGenerationFields
from kiln.training.schemas import MAX_MESSAGES_PER_EXAMPLE, MAX_PATH_CHARS, ChatMessage, _TrainCommon, _Wire

MAX_OPD_PROMPTS = 1_000
MAX_SAMPLES_PER_PROMPT = 64
MAX_OPD_NEW_TOKENS = 8_192  # = MAX_SEQ_LEN: the job's context (prompt + max_tokens <= the limit) is the cap
MAX_OPD_TOP_K = 1 << 20

OPDLoss = Literal["forward", "tail", "renormalized", "sampled_token"]
# `steps` omitted: enough steps to sample about this many completion tokens PER PROMPT (each step samples batch
# prompts x samples_per_prompt x max_tokens), and never less than one pass over the prompts x `epochs`; with
# `until_learned` (the default then) the job stops earlier, once every prompt's teacher path is the student's
# greedy answer. On the built-in model a one-answer teacher is learned in 42-57 steps of 4 x 32 tokens without
# the teacher-path row and 27-32 with it (bench/opd_transfer.py); ten answers at once reach 8/10 in 75-150 steps
# of 4 prompts (30-60 visits of each prompt; docs/training.md), so the budget gives 96 visits of each prompt.
DEFAULT_OPD_TOKEN_BUDGET = 12_288
DEFAULT_OPD_LEARNING_RATE = 1e-2
# `ce_weight` omitted with teacher_path: CE on the teacher's greedy answer (sequence-level KD) beside forward KL on
# the samples. Ten answers at once on the built-in model: 8/10 with 0 (every variant, up to 200 steps: the two
# misses are where the teacher's own top-1 has p 0.04 vs 0.01), 10/10 at step 120 with 1.0 (3/10 unrelated
# answers degenerate), 10/10 at step 100 with 3.0 (0/10); one answer: learned at step 8 with 3.0 (bench/opd_transfer.py).
DEFAULT_OPD_PATH_CE_WEIGHT = 3.0
DEFAULT_OPD_TEMPERATURE = 0.5
# `anchor_weight` omitted: the KL-to-base anchor (kiln.training.core.anchor) at the SFT weight, beside rehearsal.
# Issue 48: with rehearsal alone the OPD defaults' student (teacher: an SFT correction with the defaults) was held
# back by the locality guard; with the anchor it keeps the base's probe answers (docs/training.md, "Locality").
DEFAULT_OPD_ANCHOR_WEIGHT = 8.0
# `rehearsal` omitted on policy: the base model writes this many questions of its own and its answers to them are
# rehearsed beside the job's prompts (kiln.training.core.rehearsal), keeping the student near the base model away
# from the job's prompts; off policy, or continuing a `base_adapter`: 0.
DEFAULT_OPD_REHEARSAL = 64
MAX_OPD_REHEARSAL = 1_024
# rehearsal rows per prompt and step. Ten facts at once on the built-in model, rehearsal questions that are one of
# the ten unrelated prompts the bench checks left out (held out): 1 row left 3, 1, 0 /10 unrelated answers
# degenerate at the until_learned stop, 3 rows 0, 0, 0 /10 (bench/opd_transfer.py --facts --rehearse-exclude).
DEFAULT_OPD_REHEARSAL_PER_PROMPT = 3


def budget_steps(n_prompts: int, batch_size: int, samples_per_prompt: int, max_tokens: int) -> int:
    """Optimizer steps that sample about DEFAULT_OPD_TOKEN_BUDGET tokens per prompt."""
    per_step = min(batch_size, n_prompts) * samples_per_prompt * max_tokens
    return math.ceil(n_prompts * DEFAULT_OPD_TOKEN_BUDGET / per_step)


class OPDPrompt(_Wire):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES_PER_EXAMPLE,
                                        description="the student's prompt (ends with a user turn)")
    teacher_messages: list[ChatMessage] | None = Field(
        None, max_length=MAX_MESSAGES_PER_EXAMPLE,
        description="extra messages only the teacher sees, placed before `messages` (e.g. a system hint)")
    gold: str | None = Field(None, max_length=32_768, description="a gold completion for the ce_weight term")

    @model_validator(mode="after")
    def _ends_with_prompt(self) -> "OPDPrompt":
        if self.messages[-1].role == "assistant":
            raise ValueError("an OPD prompt's last message must not be an assistant turn (the student answers it)")
        return self


class OPDRequest(_TrainCommon, ChatGenerationFields):
    teacher: str = Field(min_length=1, max_length=128, description="a registered teacher alias")
    prompts: list[OPDPrompt] | None = Field(None, min_length=1, max_length=MAX_OPD_PROMPTS,
                                            description="on_policy: the prompts the student answers")
    samples_per_prompt: int = Field(4, ge=1, le=MAX_SAMPLES_PER_PROMPT)
    temperature: float = Field(DEFAULT_OPD_TEMPERATURE, ge=0.0, le=10.0, allow_inf_nan=False,
                               description="the student's sampling temperature (the loss is at temperature 1)")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(32, ge=1, le=MAX_OPD_NEW_TOKENS)
    top_k: int = Field(8, ge=1, le=MAX_OPD_TOP_K, description="teacher candidates per position (<= its max_top_k)")
    loss: OPDLoss = "forward"
    until_learned: bool | None = Field(
        None, description="with teacher_path: stop once every prompt's teacher greedy answer is the student's greedy "
                          "answer; default: on when steps is omitted")
    teacher_path: bool = Field(
        True, description="add one row per prompt and step: the teacher's greedy answer (found through teacher "
                          "scoring calls), then the student's sample from it where it is cut at max_tokens "
                          "(kiln.training.opd_paths)")  # the OpenAPI text predates kiln.training.opd.paths
    ce_weight: float | None = Field(
        None, ge=0.0, le=100.0, description="weight of CE on `gold` completions, or with teacher_path on the "
        "teacher's greedy answer where a prompt has no gold (sequence-level KD); default: "
        "DEFAULT_OPD_PATH_CE_WEIGHT with teacher_path on policy, else 0")
    rehearsal: int | None = Field(  # the OpenAPI text names kiln.training.core.rehearsal by its old path
        None, ge=0, le=MAX_OPD_REHEARSAL,
        description="questions the base model writes itself (adapter disabled) whose base answers are rehearsed "
                    "beside the prompts (rehearsal_per_prompt rows per prompt and step), under forward KL to the "
                    "base model "
                    "(kiln.training.core.rehearsal); 0: off; default: DEFAULT_OPD_REHEARSAL on policy, else 0")
    rehearsal_per_prompt: int = Field(
        DEFAULT_OPD_REHEARSAL_PER_PROMPT, ge=1, le=MAX_SAMPLES_PER_PROMPT,
        description="with rehearsal: rehearsal rows added per prompt and step")
    training_mode: Literal["on_policy", "off_policy"] = "on_policy"
    teacher_jsonl: str | None = Field(
        None, max_length=MAX_PATH_CHARS,
        description="off_policy: a teacher JSONL inside the data dir, built from the teacher's off_policy_manifest")
    steps: int | None = Field(None, ge=1, le=100_000, description="optimizer steps (default: a budget of DEFAULT_OPD_TOKEN_BUDGET "
                                 "sampled tokens per prompt, at least one pass over the prompts)")
    learning_rate: float = Field(DEFAULT_OPD_LEARNING_RATE, gt=0, le=1.0)
    batch_size: int = Field(4, ge=1, le=256, description="prompts per step (each sampled samples_per_prompt times)")

    @model_validator(mode="before")
    @classmethod
    def _default_ce_weight(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("ce_weight") is None:
            on_path = data.get("training_mode", "on_policy") == "on_policy" and data.get("teacher_path", True) is True
            data = {**data, "ce_weight": DEFAULT_OPD_PATH_CE_WEIGHT if on_path else 0.0}
        if isinstance(data, dict) and data.get("rehearsal") is None:
            # the rehearsal rows' reference is the bare base model: a job continuing a published adapter
            # (base_adapter) would be pulled back to the base's answers away from its prompts, so it gets none
            on_policy = data.get("training_mode", "on_policy") == "on_policy"
            data = {**data, "rehearsal": DEFAULT_OPD_REHEARSAL if on_policy and not data.get("base_adapter") else 0}
        return data

    @model_validator(mode="after")
    def _checks(self) -> "OPDRequest":
        if self.training_mode == "off_policy":
            if self.teacher_jsonl is None or self.prompts is not None:
                raise ValueError("training_mode 'off_policy' takes `teacher_jsonl` (the teacher's scored corpus) "
                                 "and no `prompts`")
            if self.loss == "sampled_token" or self.ce_weight > 0 or self.rehearsal:
                raise ValueError("off_policy trains with loss 'tail' or 'renormalized', no ce_weight and no "
                                 "rehearsal (sampled_token is an on-policy estimator)")
            return self
        if self.prompts is None or self.teacher_jsonl is not None:
            raise ValueError("training_mode 'on_policy' takes `prompts` and no `teacher_jsonl`")
        if self.ce_weight > 0 and not self.teacher_path and any(p.gold is None for p in self.prompts):
            raise ValueError("ce_weight > 0 needs a `gold` completion on every prompt, or teacher_path (CE on the "
                             "teacher's greedy answer)")
        return self
