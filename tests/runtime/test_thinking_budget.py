"""Thinking budgets in the engine, on real tokenizers: the span closes after N reasoning tokens through the
normal decode path, and the answer is what the model writes after that closing.

Models are tiny random Qwen3s around DeepSeek V3's tokenizer with an R1-style prompt (``<think>\\n`` opens the
span; ``</think>`` is text pieces there) and around Qwen3's (``</think>`` one added token).
"""

from __future__ import annotations

import json

import pytest

from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.loader import load_model
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, closing_ids, with_thinking_budget
from tests.realtok import real_model_dir
from tests.serving.test_reasoning import r1_template

MESSAGES = [{"role": "user", "content": "Is 7 prime?"}]


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3"])
def engine(request):
    if request.param == "qwen3":
        model, parser = real_model_dir("qwen3"), Qwen3ReasoningParser()
    else:
        model = real_model_dir("deepseek_v3", chat_template=r1_template(), tag="r1")
        parser = DeepSeekR1ReasoningParser()
    eng = Engine(load_model(model), EngineConfig(max_model_len=1024)).start()
    prompt = eng.encode_chat(MESSAGES)
    if request.param == "qwen3":  # the answer writes no <think> itself: open the span in the prompt
        prompt = prompt + eng.encode_text("<think>\n")
    yield eng, parser, prompt
    eng.stop()


def _greedy(eng, prompt, n, parser=None, opened=True, budget=None, constraint=None):
    params = [SamplingParams(max_tokens=n, temperature=0.0, constraint=constraint)]
    if parser is not None:
        params = with_thinking_budget(params, parser, opened, budget, eng.tokens)
    return eng.generate(prompt, params, timeout=120)[0]


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_budget_closes_the_span_and_the_answer_continues(engine, budget):
    eng, parser, prompt = engine
    assert parser.opened_by(eng.tokens.decode(prompt[-16:]))
    closing = closing_ids(parser, eng.tokens)
    assert eng.tokens.decode(closing) == "\n</think>\n\n"
    out = _greedy(eng, prompt, budget + len(closing) + 8, parser, budget=budget).token_ids
    free = _greedy(eng, prompt, max(budget, 1)).token_ids
    assert out[:budget] == free[:budget]  # the reasoning is the model's own
    assert out[budget:budget + len(closing)] == closing  # then the validated closing sequence
    answer = out[budget + len(closing):]
    assert len(answer) == 8
    assert _greedy(eng, prompt + out[:budget + len(closing)], len(answer)).token_ids == answer
    text = eng.tokens.decode(out)
    reasoning, content = parser.split(text, True)
    assert (content or "") == eng.tokens.decode(answer).lstrip("\n")
    assert (reasoning or "") == eng.tokens.decode(out[:budget]).strip("\n")


def test_unlimited_budget_leaves_the_model_alone(engine):
    eng, parser, prompt = engine
    assert _greedy(eng, prompt, 12, parser, budget=None).token_ids == _greedy(eng, prompt, 12).token_ids


def test_grammar_starts_after_the_budget_closed_the_span(engine):
    """A JSON-schema grammar applies to the answer only: the reasoning before it stays free."""
    from kiln.runtime.constrained import GrammarCompiler

    eng, parser, prompt = engine
    tok = eng.tokens
    comp = GrammarCompiler(tok.tokenizer, tok.vocab_size, tok.eos_ids)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    grammar = comp.json_schema(schema, "response_format")
    out = _greedy(eng, prompt, 60, parser, budget=4, constraint=comp.matcher(grammar))
    free = _greedy(eng, prompt, 4).token_ids
    assert out.token_ids[:4] == free
    reasoning, content = parser.split(out.text, True)
    assert out.finish_reason == "stop", out.text
    assert json.loads(content) in ({"ok": True}, {"ok": False})


def test_span_the_answer_opens_is_budgeted_too():
    """Without an open prompt, a Qwen3 answer that starts with ``<think>`` (one added token, after optional
    whitespace) opens the span; the budget counts from the token after it, and an answer that starts with
    anything else is never touched."""
    import torch
    from transformers import AutoTokenizer

    from kiln.runtime.thinking import ThinkingBudget
    from kiln.runtime.tokenization import Tokenization

    tokens = Tokenization(AutoTokenizer.from_pretrained(real_model_dir("qwen3")))
    parser = Qwen3ReasoningParser()
    closing = closing_ids(parser, tokens)

    def forced_after(text: str, budget: int) -> int | None:
        ids = tokens.encode_text(text)
        b = ThinkingBudget(budget=budget, opened=False, closing=closing, start_tag=parser.START,
                           end_tag=parser.END, token_text=tokens.token_text)
        for k in range(len(ids) + 1):
            logits = torch.zeros(1, tokens.vocab_size)
            ThinkingBudget.mask_rows(logits, [(0, b, ids[:k])])
            if torch.isinf(logits).any():
                assert int(logits.argmax()) == closing[0] and torch.isfinite(logits).sum() == 1
                return k
        return None

    opened_at = len(tokens.encode_text("\n<think>"))
    assert forced_after("\n<think>\nsome careful thought about it", 3) == opened_at + 3
    assert forced_after("<think>\nshort</think>\n\nthe answer goes on and on", 3) is None  # closed by the model
    assert forced_after("no span here, just an answer that goes on", 1) is None
