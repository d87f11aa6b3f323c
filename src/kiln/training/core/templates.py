"""Which tokens of a rendered conversation are the assistant's, for any chat template.

Templates with ``{% generation %}`` markers say so themselves (transformers'
``return_assistant_tokens_mask``). Most real templates (Qwen3's, Llama 3's) have
no markers, so the spans are found by rendering the conversation turn by turn:
the assistant's part of turn ``i`` is the text between the rendering of
``messages[:i]`` with the generation prompt and the rendering of
``messages[:i+1]``; both must be prefixes of the whole conversation's rendering.
Text spans become token masks through the tokenizer's offsets, and each span
ends at its first end-of-turn token (the newline a template puts after
``<|im_end|>`` is glue, not something the model generates).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

from kiln.errors import InvalidRequest

_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateError(InvalidRequest, ValueError):
    code = "invalid_training_data"


def has_generation_markers(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(_MARKER.search(template))


def end_of_turn_ids(tokenizer: Any, model_config: Any = None) -> frozenset[int]:
    """The token IDs that end an assistant turn: the tokenizer's EOS and the model's generation EOS IDs."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    return frozenset(ids)


def _render(tokenizer: Any, messages: Sequence[dict[str, Any]], *, generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def assistant_char_spans(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the ``[start, end)`` character span of every assistant turn."""
    full = _render(tokenizer, messages, generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], generation_prompt=True)
        end = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if not (full.startswith(start) and full.startswith(end) and len(end) > len(start)):
            raise TemplateError(
                f"the chat template renders message {i} differently once later turns follow, so its "
                "assistant tokens cannot be located",
                hint="add {% generation %} markers around assistant content in the chat template",
            )
        spans.append((len(start), len(end)))
    return full, spans


def _trim_at_end_of_turn(ids: Sequence[int], mask: list[int], end_ids: Iterable[int]) -> list[int]:
    """Within each run of 1s, keep tokens up to and including the first end-of-turn token."""
    end = frozenset(end_ids)
    out = list(mask)
    ended = False
    for t, m in enumerate(mask):
        if not m:
            ended = False
        elif ended:
            out[t] = 0
        elif ids[t] in end:
            ended = True
    return out


def assistant_tokens(tokenizer: Any, messages: Sequence[dict[str, Any]], *,
                     end_ids: Iterable[int] = ()) -> tuple[list[int], list[int]]:
    """``(input_ids, mask)`` for a conversation; mask 1 on the tokens the assistant generates."""
    messages = [dict(m) for m in messages]
    if has_generation_markers(tokenizer):
        enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), [int(x) for x in enc["assistant_masks"]]
        if any(mask):
            return ids, mask
    return assistant_tokens_by_diff(tokenizer, messages, end_ids=end_ids)


def assistant_tokens_by_diff(tokenizer: Any, messages: Sequence[dict[str, Any]], *,
                             end_ids: Iterable[int] = ()) -> tuple[list[int], list[int]]:
    """The turn-by-turn rendering method alone (no markers), for any template."""
    full, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]]
    return ids, _trim_at_end_of_turn(ids, mask, end_ids)
