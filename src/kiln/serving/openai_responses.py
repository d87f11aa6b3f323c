"""OpenAI-compatible response models: chat and text completions, their stream chunks, tokenize,
models and the error envelope.

Routes build these bodies as plain dicts in the models' field order (faster than dumping
pydantic models); the models document them in ``/openapi.json`` and the tests validate what
the server sends against them. Requests are in :mod:`kiln.serving.protocol`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kiln.serving.protocol import _Response  # the responses' common base (unknown fields refused)


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob]


class ToolCallFunction(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, description="with a reasoning parser (serving.reasoning_parser): "
                                                           "the answer's reasoning, apart from content (vLLM)")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Response):
    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class BatchChoice(_Response):
    index: int = Field(description="the choice's index among its prompt's n choices")
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class BatchResult(_Response):
    index: int = Field(description="the prompt's position in the request's prompts")
    choices: list[BatchChoice]


class BatchCompletionResponse(_Response):
    id: str
    object: Literal["text_completion.batch"] = "text_completion.batch"
    created: int
    model: str
    system_fingerprint: str
    results: list[BatchResult]
    usage: Usage


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class ModelPermission(_Response):
    """The legacy OpenAI permission object some clients still read (vLLM sends one per model)."""

    id: str
    object: Literal["model_permission"] = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kiln"
    root: str
    parent: str | None = None
    max_model_len: int
    base_model_sha256: str
    revision: str | None = None
    permission: list[ModelPermission] = Field(default_factory=list)
    # Kiln: kind (attention | hybrid), architecture, loaded_class, language_model_only (a multimodal
    # checkpoint of which only the language model is served), linear/full attention layer counts
    model_family: dict[str, Any] | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class DeltaFunction(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionChunk(_Response):
    """One SSE event of a streamed chat completion (``data: <this>``; the stream ends with ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the last event, with stream_options.include_usage (choices empty)


class CompletionChunkChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionChunk(_Response):
    """One SSE event of a streamed text completion (``data: <this>``; the stream ends with ``data: [DONE]``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ErrorBody(_Response):
    message: str
    type: str
    param: str | None
    code: str
    hint: str


class ErrorResponse(_Response):
    """Every error: the OpenAI envelope (``hint`` is Kiln's: what to do about it)."""

    error: ErrorBody
