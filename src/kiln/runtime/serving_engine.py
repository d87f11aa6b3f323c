"""The seam between the HTTP/training layers and whichever engine runs the model.

:class:`ServingEngine` is what ``KilnState.engine`` is: the built-in engine
(:class:`kiln.runtime.engine.Engine`) and the supervised vLLM facade
(:class:`kiln.runtime.vllm_engine.VllmEngine`) both implement it, and callers use only these
members (``tests/runtime/test_serving_engine.py`` checks both classes against this list). What only
one engine has (the built-in engine's ``prefix_cache`` and ``run_job``, vLLM's ``describe``) stays
off the seam. Stdlib only: the engines' own modules carry the heavy imports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

# instance attributes every engine sets in __init__: settings, tokenization, accelerator ownership
ENGINE_ATTRIBUTES = ("config", "tokens", "ownership")


@runtime_checkable
class ServingEngine(Protocol):
    config: Any  # EngineConfig: max_model_len, batching limits
    tokens: Any  # kiln.runtime.tokenization.Tokenization: render, encode, decode
    ownership: Any  # kiln.runtime.ownership.AcceleratorOwnership
    on_adapters_changed: Callable[[dict[str, str]], None] | None  # the served-set recorder

    # lifecycle and state
    def start(self) -> None: ...
    def stop(self) -> None: ...
    @property
    def running(self) -> bool: ...
    @property
    def steps(self) -> int: ...
    @property
    def max_request_rows(self) -> int: ...  # more rows in one request can never be admitted: 400, not 429
    def stats(self) -> dict[str, Any]: ...
    def health(self) -> tuple[bool, str | None]: ...

    # generation and scoring
    def admission(self) -> Any: ...
    def submit(self, prompt_ids: list[int], params: list[Any], *, adapter: str | None = None, loop: Any = None,
               incremental: bool = True, private_revision: str | None = None) -> Any: ...
    def generate(self, prompt_ids: list[int], params: Any, *, adapter: str | None = None,
                 timeout: float | None = None) -> list[Any]: ...
    def score_prompt(self, prompt_ids: list[int], top_k: int, *, adapter: str | None = None) -> Any: ...

    # tokenization pass-throughs (both engines inherit them from TokenFacade)
    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True) -> str: ...
    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...
    def encode_text(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...
    def token_text(self, token_id: int) -> str: ...
    def first_out_of_vocab(self, token_ids: list[int]) -> int | None: ...
    def too_long(self, text: str, limit: int) -> int | None: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def eos_ids(self) -> frozenset[int]: ...
    @property
    def chat_template(self) -> str | None: ...

    # adapters: the served set, and the trainer's private PEFT adapters
    def activate_adapter(self, name: str, path: Path, revision: str) -> None: ...
    def deactivate_adapter(self, name: str) -> None: ...
    def active_adapters(self) -> dict[str, str]: ...
    def peft_model(self) -> Any: ...
    def delete_private_adapter(self, private_name: str) -> None: ...


class TokenFacade:
    """The tokenization half of the seam, delegated to ``self.tokens`` (a
    :class:`kiln.runtime.tokenization.Tokenization`): callers render, encode, decode and check token IDs
    through the engine and never reach its ``tokens`` or the tokenizer's internals."""

    tokens: Any

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True) -> str:
        return self.tokens.render_chat(messages, tools, template_kwargs, add_generation_prompt)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokens.encode_chat(messages)

    def encode_text(self, text: str) -> list[int]:
        return self.tokens.encode_text(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokens.decode(token_ids)

    def token_text(self, token_id: int) -> str:
        return self.tokens.token_text(token_id)

    def first_out_of_vocab(self, token_ids: list[int]) -> int | None:
        return self.tokens.first_out_of_vocab(token_ids)

    def too_long(self, text: str, limit: int) -> int | None:
        return self.tokens.too_long(text, limit)

    @property
    def vocab_size(self) -> int:
        return self.tokens.vocab_size

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (for the grammar compiler, the tool parsers and ``/tokenize``)."""
        return self.tokens.tokenizer

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.tokens.eos_ids

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template text (``None`` when it has none or it is not a string)."""
        template = getattr(self.tokens.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None


def seam_members() -> list[str]:
    """The member names of :class:`ServingEngine` (methods and properties), for the conformance test."""
    return sorted(n for n, v in vars(ServingEngine).items()
                  if not n.startswith("_") and (callable(v) or isinstance(v, property)))
