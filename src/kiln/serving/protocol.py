"""OpenAI/vLLM wire models: the requests, and the operator/training/adapter responses.

Static bounds here are hard ceilings for any configuration; the configured limits
(``limits.*``, e.g. ``max_n``) are checked per request in :mod:`kiln.serving.prepare`.
Requests forbid unknown fields, so a typo or an unsupported option is a 400 rather
than silently ignored.

Response models (here and in :mod:`kiln.serving.openai_responses`, the OpenAI-compatible
bodies and stream chunks) describe every JSON body and SSE event the server sends; routes
build them as dicts for speed, and ``tests/serving/test_schemas.py`` validates
what the server actually sends against these models and ``/openapi.json``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from kiln.runtime.chat_generation import MAX_TEMPLATE_KWARGS, ChatTemplateKwargs, check_template_kwargs
from kiln.wire_numbers import WireInt, integral_lists
from kiln.wire_rules import NOT_NULL, field_is, never_both, rules, when

MAX_MODEL_NAME_CHARS = 256
MAX_CONTENT_CHARS = 1_000_000
MAX_STOP_CHARS = 256
MAX_STOP_SEQUENCES = 64
MAX_PROMPT_TOKEN_IDS = 1_048_576
MAX_N = 256
MAX_LOGPROBS = 1000
MAX_TOKENS = 1_048_576
MAX_SEED = 2**63 - 1
MAX_USER_CHARS = 256
MAX_CONTENT_PARTS = 256
MAX_MESSAGES = 100_000
MAX_LOGIT_BIAS = 1024
LOGIT_BIAS_KEY = r"^[0-9]{1,9}$"  # a token ID as a string (kiln.serving.openapi_bounds adds the vocabulary's bound)
MAX_PROMPTS = 256  # prompts in one completion request
MAX_GUIDED_CHOICES = 1024
MAX_TOOLS = 128
MAX_REPETITION_PENALTY = 100.0

ModelName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_MODEL_NAME_CHARS)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # "5", 5.0 and true are not integers


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool | None = Field(None, description="ignored: OpenAI's padding of stream events "
                                             "against side channels; Kiln sends none")


class PredictionContent(_Request):
    """OpenAI's predicted output; accepted only when empty (Kiln has no speculative decoding from it)."""

    type: Literal["content"] = "content"
    content: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)] | Annotated[
        list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] = Field(
        "", description="must be empty: predicted outputs are not supported")

    @field_validator("content")
    @classmethod
    def _empty(cls, v: str | list[TextPart]) -> str | list[TextPart]:
        if (v if isinstance(v, str) else "".join(p.text for p in v)):
            raise ValueError("prediction (predicted outputs) is not supported: Kiln does no speculative decoding "
                             "from it; send an empty prediction or none")
        return v


class TextFormat(_Request):
    type: Literal["text"]


class JsonObjectFormat(_Request):
    type: Literal["json_object"]


class JsonSchemaSpec(_Request):
    name: Annotated[str, StringConstraints(min_length=1, max_length=64)] = "response"
    description: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema the output follows")
    strict: bool | None = Field(None, description="always enforced: constrained decoding makes every output valid")


class JsonSchemaFormat(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


# OpenAI fields a self-hosted model accepts and ignores: they change nothing about the output
# (billing, retention, abuse tracking and caching hints of OpenAI's service). A request that
# sets one is answered normally with the header below naming them; anything else unknown is a 400.
IGNORED_FIELDS = ("store", "metadata", "user", "service_tier", "prediction", "safety_identifier",
                  "prompt_cache_key")
IGNORED_FIELDS_HEADER = "x-kiln-ignored-fields"
MAX_METADATA_KEYS = 16


class TextPart(_Request):
    type: Literal["text"]
    text: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)]


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
ToolCallId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_USER_CHARS)]


class CalledFunction(_Request):
    name: FunctionName
    arguments: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)] = Field(
        description="the arguments as a JSON string, as the model produced them")


class AssistantToolCall(_Request):
    """A tool call in an earlier assistant turn, sent back by the client."""

    id: ToolCallId
    type: Literal["function"] = "function"
    function: CalledFunction


def _given(name: str) -> dict[str, Any]:
    return field_is(name, NOT_NULL)


def _role(*roles: str) -> dict[str, Any]:
    return field_is("role", {"enum": list(roles)})


class ChatMessage(_Request):
    # _roles below, as JSON Schema
    model_config = ConfigDict(json_schema_extra=rules(
        when(_given("tool_calls"), _role("assistant")),
        when(_given("reasoning_content"), _role("assistant")),
        when(_role("tool"), _given("tool_call_id")),
        when(_given("tool_call_id"), _role("tool")),
        when({"not": _given("content")}, {"allOf": [_role("assistant"), _given("tool_calls")]})))

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)] | Annotated[
        list[TextPart], Field(max_length=MAX_CONTENT_PARTS)
    ] | None = Field(None, description="required except on an assistant message with tool_calls")
    name: Annotated[str, StringConstraints(max_length=MAX_USER_CHARS)] | None = None
    tool_calls: Annotated[list[AssistantToolCall], Field(min_length=1, max_length=MAX_TOOLS)] | None = Field(
        None, description="assistant messages: the calls the model made")
    tool_call_id: ToolCallId | None = Field(None, description="tool messages: the call this result answers")
    reasoning_content: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)] | None = Field(
        None, description="assistant messages (vLLM): the turn's reasoning, rendered by templates that show it")

    @model_validator(mode="after")
    def _roles(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages carry tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only on an assistant message with tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Request):
    name: FunctionName
    description: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)] | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema for the arguments")
    strict: bool | None = Field(None, description="always enforced when tool_choice is required or named")


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


_CONSTRAINTS = (_given("guided_json"), _given("guided_regex"), _given("guided_choice"),
                field_is("response_format", {"allOf": [NOT_NULL, {"properties": {"type": {"not": {"const": "text"}}}}]}))


_SAMPLING_RULES = rules(*(never_both(a, b) for i, a in enumerate(_CONSTRAINTS) for b in _CONSTRAINTS[i + 1:]),
                        # stream_options only with stream=true (prepare.check_request)
                        when(field_is("stream_options", NOT_NULL), field_is("stream", {"const": True})))


class _Sampling(_Request):
    # one structured-output constraint at most (request_params._grammar), as JSON Schema
    model_config = ConfigDict(json_schema_extra=_SAMPLING_RULES)

    model: ModelName
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: WireInt = Field(0, ge=-1, le=1_000_000)  # 0 or -1: off (vLLM accepts -1)
    seed: Annotated[int | None, Field(ge=0, le=MAX_SEED), integral_lists] = None
    n: WireInt = Field(1, ge=1, le=MAX_N)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension: keep going past end-of-sequence
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted from the logit of every token "
                                    "already generated (OpenAI)")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted per occurrence of a token in "
                                     "the output so far (OpenAI)")
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY, description="vLLM/transformers: "
                                      "> 1 discourages tokens of the prompt and output")
    # propertyNames: patternProperties alone would leave other keys unconstrained in the document
    logit_bias: Annotated[dict[Annotated[str, StringConstraints(pattern=LOGIT_BIAS_KEY)],
                               Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS,
                                json_schema_extra={"propertyNames": {"pattern": LOGIT_BIAS_KEY}})] | None = Field(
        None, description="token id (as a string) -> bias added to its logit, in [-100, 100]")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM: keep tokens with p >= min_p * p(best)")
    min_tokens: WireInt = Field(0, ge=0, le=MAX_TOKENS, description="vLLM: no end-of-sequence or stop token before "
                            "this many tokens")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_SEQUENCES),
                              integral_lists] | None = Field(
        None, description="vLLM: generating one of these ends the choice (finish_reason stop)")
    bad_words: Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None = Field(
        None, description="vLLM: words the output never contains (as tokenized, with and without a leading space)")
    user: Annotated[str, StringConstraints(max_length=MAX_USER_CHARS)] | None = Field(
        None, description="ignored (OpenAI abuse tracking)")
    store: bool | None = Field(None, description="ignored (OpenAI's stored completions)")
    metadata: Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                             Annotated[str, StringConstraints(max_length=512)]],
                        Field(max_length=MAX_METADATA_KEYS)] | None = Field(
        None, description="ignored (OpenAI's stored-completion tags)")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="ignored (OpenAI's billing tier)")
    prediction: PredictionContent | None = Field(None, description="accepted only when empty")
    safety_identifier: Annotated[str, StringConstraints(max_length=MAX_USER_CHARS)] | None = Field(
        None, description="ignored (OpenAI abuse tracking)")
    prompt_cache_key: Annotated[str, StringConstraints(max_length=MAX_USER_CHARS)] | None = Field(
        None, description="ignored (OpenAI's cache routing hint)")

    response_format: ResponseFormat | None = Field(
        None, description="json_object or json_schema: enforced by constrained decoding (the output always parses "
                          "and, with a schema, validates), unless the choice ends at max_tokens")
    guided_json: dict[str, Any] | Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)] | None = Field(
        None, description="vLLM: a JSON schema (object or JSON text) the output follows")
    guided_regex: Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS * 64)] | None = Field(
        None, description="vLLM: a regular expression the output matches")
    guided_choice: Annotated[list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_CONTENT_CHARS)]],
                             Field(min_length=1, max_length=MAX_GUIDED_CHOICES)] | None = Field(
        None, description="vLLM: the output is exactly one of these strings")
    allow_additional_properties: bool = Field(
        False, description="Kiln: false (default): a JSON schema (response_format, guided_json, forced tool_choice) "
        "is strict: objects that do not say additionalProperties admit only their listed properties and prefixItems "
        "arrays no further items, as vLLM's default backend (xgrammar) decodes; true: JSON Schema's open objects")

    def ignored_fields(self) -> list[str]:
        """The accepted-and-ignored OpenAI fields this request set (see ``IGNORED_FIELDS``)."""
        return [f for f in IGNORED_FIELDS if f in self.model_fields_set]

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)




class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Annotated[int | None, Field(ge=1, le=MAX_TOKENS), integral_lists] = None
    max_completion_tokens: Annotated[int | None, Field(ge=1, le=MAX_TOKENS), integral_lists] = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS), integral_lists] = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="functions the model may call, shown to it through the model's chat template")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="auto (default with tools): the model decides; none: no tools; required or a named "
                          "function: enforced by constrained decoding")
    parallel_tool_calls: bool | None = Field(None, description="with required: allow more than one call "
                                                               "(default true)")
    chat_template_kwargs: ChatTemplateKwargs | None = Field(
        None, description="vLLM: extra variables for the chat template (e.g. Qwen3's enable_thinking: false); "
                          f"at most {MAX_TEMPLATE_KWARGS} keys, scalar values, names the server passes itself refused")

    thinking_token_budget: Annotated[int | None, Field(ge=0, le=MAX_TOKENS), integral_lists] = Field(
        None, description="reasoning tokens the answer may spend before the server closes "
        "the reasoning span and the answer follows; omitted: serving.thinking_token_budget; null: unlimited. Needs "
        "a reasoning parser")

    _check_template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    def tools_on(self) -> bool:
        """Whether the template shows the model tools and its answer is read for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def forces_call(self) -> bool:
        """Whether ``tool_choice`` (``required`` or a named function) forces the answer to be calls."""
        return self.tools_on() and self.tool_choice not in (None, "auto")


PromptText = Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)]
# a prompt to continue: at least one character (an empty one has no token to continue from)
GenerationPrompt = Annotated[str, StringConstraints(min_length=1, max_length=MAX_CONTENT_CHARS)]
PromptTokens = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS),
                         integral_lists]


class CompletionRequest(_Sampling):
    prompt: GenerationPrompt | PromptTokens | Annotated[list[GenerationPrompt], Field(min_length=1,
                                                                                     max_length=MAX_PROMPTS)] | \
        Annotated[list[PromptTokens], Field(min_length=1, max_length=MAX_PROMPTS)] = Field(
            description="a string, a token-ID list, or a list of either: each prompt gets n choices, choice i of "
                        "prompt p at index p * n + i")
    max_tokens: WireInt = Field(16, ge=0, le=MAX_TOKENS)
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS), integral_lists] = None
    prompt_logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS), integral_lists] = None
    echo: bool = Field(False, description="put the prompt (and with logprobs its tokens' logprobs) before the text")
    suffix: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS)] | None = Field(
        None, description="refused unless empty: Kiln's templates have no fill-in-the-middle (infill) tokens")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported: the served model's template has no fill-in-the-middle "
                             "(infill) tokens; put the whole text in prompt")
        return v


class BatchCompletionRequest(_Sampling):
    """``POST /v1/completions/batch``: a bounded set of prompts (strings or token-ID lists, mixed), each with ``n``
    choices, answered in one response once every row has finished."""

    # _Sampling's rules and: no stream (routes_batch answers once, every row finished)
    model_config = ConfigDict(json_schema_extra={"allOf": [*_SAMPLING_RULES["allOf"], {"not": field_is(
        "stream", {"const": True})}]})

    prompts: Annotated[list[GenerationPrompt | PromptTokens], Field(min_length=1, max_length=MAX_PROMPTS)] = Field(
        description=f"at most limits.max_batch_prompts (default 64, never more than {MAX_PROMPTS})")
    max_tokens: WireInt = Field(16, ge=0, le=MAX_TOKENS)
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS), integral_lists] = None


class TokenizeCompletionRequest(_Request):
    """``POST /tokenize`` with a text prompt (vLLM's shape)."""

    model: ModelName | None = None
    prompt: PromptText
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """``POST /tokenize`` with chat messages, rendered by the model's chat template (vLLM's shape)."""

    model: ModelName | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: ChatTemplateKwargs | None = Field(None, description="as on /v1/chat/completions")
    add_special_tokens: bool = False
    return_token_strs: bool = False

    _check_template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)


class DetokenizeRequest(_Request):
    model: ModelName | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_PROMPT_TOKEN_IDS), integral_lists]


# -- responses (the OpenAI-compatible ones are in kiln.serving.openai_responses) ------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- operator, training and adapter responses ------------------------------------------


class HealthResponse(_Response):
    """``GET /health`` (routes_ops builds it; a new field must be added here too)."""

    status: Literal["ok", "unavailable"]
    model: str
    base_model_sha256: str
    backend: str
    device: str
    dtype: str
    # float32 | bfloat16 | float16 | int8 | int4: the base weights as served (model.quantize)
    base_representation: str | None = None
    uptime_s: float
    queued_rows: int
    active_rows: int
    max_running_rows: int
    queue_oldest_wait_s: float = 0.0  # how long the oldest waiting row has waited (admission by memory)
    queue: list[dict[str, Any]] = []  # waiting rows in admission order: position, wait_s, prompt_tokens, kind
    queue_blocked_on: str | None = None  # what the head of the queue waits for: kv_budget, running_rows, token_budget
    kv_blocks: dict[str, int] = {}  # paged KV: total, used, cached, free, block_size, preemptions, prefix_hit_blocks
    engine_error: str | None
    # once a cycle failure latched the engine (its completion state unknown): class, reason; restart the server
    restart_required: dict[str, str] | None = None
    engine_faults: dict[str, int] = {}  # cycle failures contained to their rows so far: forward_error, out_of_memory
    engine_busy_s: float | None = None  # seconds the engine has been inside its current step
    engine_steps: int | None = None  # scheduling cycles run so far
    engine_step_cost: dict[str, float | int | None] | None = None  # cycle cost fit (batching.mixed_step_factor)
    engine_prefill: dict[str, int | None] = {}  # threads for prompt-only cycles (model.prefill_threads), wide_steps
    admitting: int = 0  # generation requests being parsed and rendered, not yet submitted
    adapters: dict[str, str]
    adapters_not_restored: list[dict[str, str]] = []  # served before the restart, not restored: name, revision, error
    served_set_error: str | None = None  # why <adapters>/.served.json was ignored or cannot be written
    default_adapter: dict[str, str | bool | None] | None = None  # name, revision, serving, served_revision
    ownership: dict[str, float | int | bool]
    training_attached: bool
    memory: dict[str, int]
    # memory admission: budget_bytes, detected_bytes, cap_bytes, resident (weights, kv_cache, linear_state),
    # reserved_bytes, available_bytes, reservations (kind, owner, bytes, parts)
    memory_budget: dict[str, Any] | None = None
    vllm: dict[str, Any] | None = None  # serving.engine = "vllm": state, pid, snapshot, fingerprint, rank decision
    model_family: dict[str, Any] | None = None  # as in /v1/models (kiln.runtime.model_family)
    # hybrid models: slots_total, slots_used, bytes (per-row GDN state), the prefix cache's snapshots, and kernels:
    # what runs the Gated DeltaNet functions (requested, effective, functions, reason; kiln.runtime.linear_kernels)
    linear_state: dict[str, Any] | None = None


class SettingValue(_Response):
    value: Any
    source: Literal["default", "file", "env", "cli"]


class EffectiveLimits(_Response):
    profile: str = Field(description="serving.profile in force: experimental (everything) or stable (serving only)")
    training_enabled: bool = Field(description="whether training jobs are admitted (stable turns training off)")
    max_model_len: int = Field(description="prompt + output token limit in force: min(limits.max_model_len, "
                                           "the model's max_position_embeddings)")
    model_max_position_embeddings: int | None = Field(description="the model's own limit from config.json, if any")
    prefix_cache: dict[str, bool] | None = Field(None, description="batching.prefix_cache requested and effective "
                                                 "(hybrid models run without prefix reuse)")
    compile_decode: dict[str, Any] | None = Field(None, description="batching.compile_decode requested and "
                                                  "effective, and the compiler's error when a bucket failed to "
                                                  "compile (the engine then decodes eagerly)")
    tool_call_parser: str | None = Field(None, description="the tool-call parser in force (serving.tool_call_parser; "
                                         "auto resolved by the chat template's family)")
    reasoning_parser: str | None = Field(None, description="the reasoning parser in force, null for none "
                                         "(serving.reasoning_parser; auto resolved by the chat template's family)")
    quantization: dict[str, Any] | None = Field(None, description="model.quantize requested and effective: the "
                                                "base representation, kernel (aten | dequantize), quantized layers, "
                                                "weight bytes before/after, and the probe set's mean per-token "
                                                "KL(float || quantized) in nats")


class ConfigResponse(_Response):
    config_file: str | None
    settings: dict[str, SettingValue]
    effective: EffectiveLimits


class TrainingJob(_Response):
    id: str
    kind: Literal["sft", "grpo", "opd", "kd"]
    adapter: str
    state: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    created_at: float
    started_at: float | None
    finished_at: float | None
    cancel_requested: bool
    error: str | None
    result: dict[str, Any] | None
    step: int | None
    total_steps: int | None
    loss: float | None
    tokens_per_s: float | None
    eta_s: float | None
    progress: dict[str, Any]
    queue_position: int | None = None


class HoldPacing(_Response):
    """How the trainer shares the device with serving (kiln.runtime.ownership.HoldPacer; docs/latency.md)."""

    serving_share: float = Field(description="training.serving_share: serving's share of the time between holds")
    max_hold_ms: float = Field(description="training.max_hold_ms: one hold's budget while serving waits (0: whole steps)")
    hold_cycles: float = Field(0.0, description="training.hold_cycles: the budget as this many of serving's recent "
                                                "cycles, within max_hold_ms (0: max_hold_ms alone)")
    last_budget_ms: float | None = Field(None, description="the budget the latest hold was given while serving waited")
    holds: int = Field(description="exclusive holds the trainer took since start-up")
    busy_holds: int = Field(description="of them, taken while serving had rows")
    yields: int = Field(description="gaps left to serving between holds")
    yielded_s: float
    longest_busy_hold_s: float = Field(description="the longest hold taken while serving had rows")
    recent_busy_hold_p50_s: float = Field(description="median of the latest 256 holds taken while serving had rows")
    recent_busy_hold_p99_s: float = Field(description="p99 of the latest 256 holds taken while serving had rows")


class ServingLatency(_Response):
    """Serving's TTFT and inter-token latency over the last ``window_s`` seconds (null p50/p99: none seen)."""

    window_s: float
    ttft_count: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_count: int
    itl_p50_ms: float | None
    itl_p99_ms: float | None


class TrainingStatus(_Response):
    enabled: bool
    worker_alive: bool
    running: TrainingJob | None
    queued: list[TrainingJob]
    queue_max: int
    recent: list[TrainingJob]
    pacer: HoldPacing | None = None
    serving: ServingLatency | None = Field(None, description="serving's latency beside the running job")
    warm_up: dict[str, Any] | None = Field(
        None, description="the training worker's start-up warm-up (training.warm_up): state (off, pending, running, "
                          "done, failed), seconds per piece (imports, adapter, anchor, probes), error")


class ReceiptSummary(_Response):
    verified: bool = Field(description="the revision's kiln-receipt.json binds to it (GET .../receipt has it)")
    error: str | None = Field(description="why it does not bind (edited, another revision's, missing)")
    job_id: str | None
    teacher_fingerprint: str | None = Field(description="OPD: the kiln-teacher-v1 fingerprint; KD: the capture "
                                                        "teacher's digest")
    gate: str | None = Field(description="the post-train gate's verdict recorded in the receipt")
    locality: dict[str, Any] | None = Field(
        None, description="the job's locality figures (probes, unchanged, unchanged_fraction, kl_mean, degenerate, "
                          "base_degenerate, error; scope and auto_scope for a scoped adapter) and the locality "
                          "guard's verdict (admitted, code, override); "
                          "None when not measured (docs/training.md, \"Locality\")")


class TrainingReceipt(BaseModel):
    """``kiln.training-receipt.v1`` (docs/adapters.md): job, plan and inputs digests, teacher, code, the
    revision it binds to, the gate verdict, the adapter's locality."""

    model_config = ConfigDict(extra="forbid")
    schema_: str = Field(alias="schema")
    adapter: dict[str, Any]
    job_id: str
    plan_sha256: str
    inputs: dict[str, Any]
    teacher: dict[str, Any] | None
    code: dict[str, Any]
    gate: dict[str, Any] | None
    locality: dict[str, Any] | None = None  # jobs that measured it (kiln.training.core.locality)


class AdapterInfo(_Response):
    """One stored adapter. One whose HEAD or manifest cannot be read has ``verified: false``, the reason in
    ``error``, and ``null`` for what could not be read (revision, base, kind, size, created)."""

    name: str
    revision: str | None
    base_model_sha256: str | None
    kind: str | None
    parent_revision: str | None
    size_bytes: int | None
    created: str | None
    active: bool
    active_revision: str | None
    quarantined: dict[str, dict[str, str]] | None = {}  # revision -> {reason, at}; None: marks unreadable
    receipt: ReceiptSummary | None = None  # None: a kind no training job publishes (upload, merge)
    verified: bool = True  # HEAD, manifest, quarantine marks and receipt readable (and the receipt binds)
    error: str | None = None  # why not


class AdapterDetail(AdapterInfo):
    manifest: dict[str, Any] | None  # None: the manifest cannot be read (see error)


class AdapterMerged(AdapterInfo):
    notes: list[str]  # adjustments made while merging (e.g. a clamped TIES rank)


class AdapterList(_Response):
    object: Literal["list"]
    data: list[AdapterInfo]


class AdapterLoaded(_Response):
    name: str
    revision: str
    active: Literal[True]


class AdapterUnloaded(_Response):
    name: str
    active: Literal[False]


class AdapterDeleted(_Response):
    name: str
    revision: str
    deleted: Literal[True]
