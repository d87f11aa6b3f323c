"""Prompt rendering, tokenization and detokenization for the engine and the routes.

The routes never reach the tokenizer themselves: they call these methods through the
engine's pass-throughs (:class:`kiln.runtime.serving_engine.TokenFacade`), so one object decides how a
chat is rendered, how text becomes IDs and how an ID is shown in a logprob entry.
"""

from __future__ import annotations

import functools
from typing import Any

ENCODE_HOLDING_GIL_MAX_CHARS = 1000  # ~1 ms of tokenizing at most while holding the GIL
TOKEN_TEXT_CACHE_MAX = 1 << 20  # entries; a vocabulary is far smaller, this only bounds a huge one


class Tokenization:
    def __init__(self, tokenizer: Any, model: Any = None):
        self.tokenizer = tokenizer
        self._backend = self._backend_tokenizer()
        self.vocab_size = len(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_ids = self._eos_ids(model)
        self._token_text: dict[int, str] = {}

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages`` (and ``tools``, OpenAI's tool list, for templates
        that show them; ``template_kwargs``, extra template variables such as ``enable_thinking``), ready
        for the assistant's turn (unless ``add_generation_prompt`` is false)."""
        extra = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **extra)

    def warm(self) -> None:
        """Render a one-message chat once, so the chat template is compiled (jinja, ~20-25 ms for a
        Qwen-style template here) at start-up instead of during the first request. A template that
        refuses this chat is compiled all the same; its refusal waits for a real request."""
        try:
            self.render_chat([{"role": "user", "content": "Hello"}])
        except Exception:  # the template's own checks (roles, order): compiled before they ran
            pass

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The chat template's text, tokenized as ``apply_chat_template(tokenize=True)`` would."""
        return self.encode_text(self.render_chat(messages, tools, template_kwargs))

    def encode_text(self, text: str) -> list[int]:
        """Short texts go straight to the Rust tokenizer's single ``encode``: ~80 us less than the
        wrapper, and it keeps the GIL (the wrapper's batch encode releases it, and a caller on the
        event loop then waits to win it back from the engine thread). Long texts take the wrapper,
        which lets the engine thread run while they are encoded."""
        if self._backend is not None and len(text) <= ENCODE_HOLDING_GIL_MAX_CHARS:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the text bytes one token covers: the longest vocabulary entry's UTF-8
        bytes (a byte-level or SentencePiece piece spells its bytes with at least as many), doubled
        for normalizers that expand text. A text of ``b`` bytes has at least ``b / max_token_bytes``
        tokens, so :meth:`too_long` can refuse it without tokenizing."""
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in self.tokenizer.get_vocab()), default=1)
        return 2 * max(longest, 1)

    def too_long(self, text: str, limit: int) -> int | None:
        """A lower bound on ``text``'s token count when that bound alone exceeds ``limit``, else ``None``
        (cheap: a length and, for long texts, one UTF-8 encode)."""
        if len(text) <= limit:  # every token covers at least one character
            return None
        least = len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes
        return least if least > limit else None

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_text(self, token_id: int) -> str:
        """One token's text as logprob entries show it (cached)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._token_text) < TOKEN_TEXT_CACHE_MAX:
                self._token_text[token_id] = text
        return text

    def first_out_of_vocab(self, token_ids: list[int]) -> int | None:
        """The first ID outside ``[0, vocab_size)``, or ``None``."""
        return next((t for t in token_ids if not 0 <= t < self.vocab_size), None)

    def _backend_tokenizer(self) -> Any:
        """The Rust tokenizer when calling it directly is equivalent to the wrapper, else ``None``."""
        if getattr(self.tokenizer, "split_special_tokens", False):
            return None
        return getattr(self.tokenizer, "backend_tokenizer", None)

    def _eos_ids(self, model: Any) -> frozenset[int]:
        ids: set[int] = set()
        gc = getattr(model, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)
