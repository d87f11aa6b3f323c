"""Kiln's tokenization paths on each real family's tokenizer (Qwen3, Llama 3.1, Gemma 3, DeepSeek V3): streamed
detokenization of multi-byte text, stop strings, chat-template rendering, and SFT assistant spans.

The tokenizer files come from :mod:`tests.realtok` (fetched once, skipped offline); no model is needed.
"""

from __future__ import annotations

import pytest

from tests.realtok import FAMILIES, real_tokenizer_dir

TEXT = "Grüße aus Köln 🙂, 東京は晴れ — 3 × 4 = 12.\nNext line  with  spaces."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wie heißt du? 🙂"},
        {"role": "assistant", "content": "Ich heiße Kiln 🔥."}]


@pytest.fixture(scope="module", params=FAMILIES)
def tokens(request):
    from transformers import AutoTokenizer

    from kiln.runtime.tokenization import Tokenization

    return request.param, Tokenization(AutoTokenizer.from_pretrained(real_tokenizer_dir(request.param)))


def test_streamed_detokenization_releases_whole_characters(tokens):
    from kiln.runtime.textstream import TextStream

    _, tok = tokens
    ids = tok.encode_text(TEXT)
    stream = TextStream(tok.tokenizer)
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == TEXT == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # a multi-byte character is never split across pieces


@pytest.mark.parametrize("stop", ["Köln", "🙂", "晴れ", "\nNext"])
def test_stop_strings_cut_before_the_stop(tokens, stop):
    from kiln.runtime.textstream import TextStream

    _, tok = tokens
    stream = TextStream(tok.tokenizer, stop=(stop,))
    out = []
    for t in tok.encode_text(TEXT):
        out.append(stream.push(t))
        if stream.stopped:
            break
    out.append(stream.flush())
    assert stream.stopped and "".join(out) == TEXT[:TEXT.index(stop)]


def test_chat_rendering_matches_transformers(tokens):
    family, tok = tokens
    hf = tok.tokenizer
    messages = CHAT[:2] if family != "gemma3" else CHAT[1:2]  # Gemma folds the system turn into the user's
    ids = tok.encode_chat(messages)
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    expected = list(expected["input_ids"])
    assert ids == expected
    assert tok.decode(ids).count("Wie heißt du? 🙂") == 1


def test_sft_assistant_span_is_the_answer(tokens):
    from kiln.training.core.templates import assistant_tokens, end_of_turn_ids

    family, tok = tokens
    hf = tok.tokenizer
    messages = CHAT if family != "gemma3" else CHAT[1:]
    ends = end_of_turn_ids(hf)
    ids, mask = assistant_tokens(hf, messages, end_ids=ends)
    span = [t for t, m in zip(ids, mask) if m]
    learnt = hf.decode(span)
    assert learnt.startswith("Ich heiße Kiln 🔥.") or learnt.startswith("<think>")  # Qwen3: its empty span first
    assert "Ich heiße Kiln 🔥." in learnt and "Wie heißt du" not in learnt
    assert span[-1] in ends  # the turn's end token is learnt, nothing after it
