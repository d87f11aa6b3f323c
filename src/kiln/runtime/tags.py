"""Tags a chat template writes around calls and reasoning (``<tool_call>``, ``<think>``), as a tokenizer spells them.

Real tokenizers often hold such a tag as one added token (Qwen3's ``<tool_call>``, ``</think>``;
DeepSeek's ``<｜tool▁calls▁begin｜>``); others spell it as ordinary text pieces. A grammar that forces
a tag must name the token itself when there is one: grammar engines (llguidance) keep added tokens
apart from text, so a text literal ``"<tool_call>"`` never matches the single token a model trained on
the template writes. :class:`TagSpelling` answers both questions for one tokenizer, validated by
encoding the tag and reading it back.
"""

from __future__ import annotations

import json
from typing import Any


class TagSpelling:
    """How one tokenizer spells tags (cached per tag)."""

    def __init__(self, tokenizer: Any | None):
        self._tok = tokenizer
        self._ids: dict[str, int | None] = {}

    def single_token(self, tag: str) -> int | None:
        """The ID of the one token ``tag`` encodes to when it is an added token, else ``None``."""
        if tag in self._ids:
            return self._ids[tag]
        tid = None
        tok = self._tok
        if tok is not None:
            try:
                added = tok.get_added_vocab()
                ids = list(tok(tag, add_special_tokens=False)["input_ids"])
            except Exception:  # a tokenizer without added-vocab support: text spelling
                added, ids = {}, []
            if tag in added and ids == [added[tag]]:
                tid = int(added[tag])
        self._ids[tag] = tid
        return tid

    def lark(self, tag: str) -> str:
        """A Lark (llguidance) expression matching ``tag`` as the model writes it: ``<[id]>`` for a
        single added token, else the quoted text."""
        tid = self.single_token(tag)
        return f"<[{tid}]>" if tid is not None else json.dumps(tag, ensure_ascii=False)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``: text a stream holds back,
    since the next piece may complete the tag."""
    if tag[:1] not in text[-(len(tag) - 1):]:  # the common case: no tag can be starting
        return 0
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
