"""Structured output in the batched sampler: a row with a grammar constraint only ever picks tokens
the grammar allows, so what it generates always parses and validates (random small schemas and
seeds, random logits standing in for a model), and its batch-mates are untouched."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.runtime.sampling import SamplingParams, make_generator, select_tokens

MAX_STEPS = 400


@pytest.fixture(scope="module")
def compiler(builtin_model_dir):
    from transformers import AutoTokenizer

    from kiln.runtime.constrained import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(builtin_model_dir)
    return tok, GrammarCompiler(tok, len(tok), [tok.eos_token_id])


class Row:
    def __init__(self, eos: int):
        self.prompt, self.generated, self.eos_ids = [1], [], frozenset({eos})


def _leaf() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.builds(lambda hi: {"type": "string", "maxLength": hi}, st.integers(0, 6)),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda vals: {"enum": vals}, st.lists(st.sampled_from(["a", "b c", 1, 2.5, True, None]),
                                                        min_size=1, max_size=3, unique=True)),
    )


schemas = st.recursive(
    _leaf(),
    lambda inner: st.one_of(
        st.builds(lambda items, hi: {"type": "array", "items": items, "maxItems": hi}, inner, st.integers(0, 3)),
        st.builds(lambda props, req: {"type": "object", "properties": props, "additionalProperties": False,
                                      "required": sorted(props)[:req]},
                  st.dictionaries(st.sampled_from(["a", "b", "name", "x_1"]), inner, min_size=1, max_size=3),
                  st.integers(0, 3)),
    ),
    max_leaves=5,
)


def _generate(tok, compiler, grammar, seed: int, temperature: float) -> tuple[str, bool]:
    eos = tok.eos_token_id
    vocab = len(tok)
    row = Row(eos)
    neighbour = Row(eos)
    p = SamplingParams(max_tokens=MAX_STEPS, temperature=temperature, constraint=compiler.matcher(grammar))
    free = SamplingParams(max_tokens=MAX_STEPS, temperature=0)
    g = torch.Generator().manual_seed(seed)
    gen = make_generator(seed)
    for _ in range(MAX_STEPS):
        logits = torch.randn(2, vocab, generator=g) * 4
        logits[:, eos] -= 2.0  # a model that does not rush to end
        out = select_tokens(logits, [p, free], [gen, None], torch.Generator().manual_seed(seed), [row, neighbour])
        assert out[1].token_id == int(logits[1].argmax())  # the unconstrained neighbour is unaffected
        t = out[0].token_id
        if t == eos:
            return tok.decode(row.generated), True
        row.generated.append(t)
    return tok.decode(row.generated), False


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=schemas, seed=st.integers(0, 2**31), temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]))
def test_constrained_rows_always_parse_and_validate(compiler, schema, seed, temperature):
    tok, comp = compiler
    text, ended = _generate(tok, comp, comp.json_schema(schema, "response_format"), seed, temperature)
    assert ended, f"no end within {MAX_STEPS} tokens: {text!r}"
    jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice(compiler):
    import re

    tok, comp = compiler
    for seed in range(5):
        text, ended = _generate(tok, comp, comp.json_schema(None, "response_format"), seed, 1.0)
        if ended:  # an open-ended object may outlast MAX_STEPS on random logits
            assert isinstance(json.loads(text), dict)
        text, ended = _generate(tok, comp, comp.regex(r"[a-c]{2,4}-[0-9]{1,3}", "guided_regex"), seed, 1.0)
        assert ended and re.fullmatch(r"[a-c]{2,4}-[0-9]{1,3}", text)
        options = ["yes", "no", "maybe (later)"]
        text, ended = _generate(tok, comp, comp.choice(options, "guided_choice"), seed, 0.0)
        assert ended and text in options


def test_bad_grammars_are_invalid_requests(compiler):
    from kiln.errors import InvalidRequest

    _, comp = compiler
    with pytest.raises(InvalidRequest) as exc:
        comp.json_schema({"type": "objectx"}, "response_format")
    assert exc.value.param == "response_format"
    with pytest.raises(InvalidRequest):
        comp.regex("[", "guided_regex")


def test_prefetched_masks_follow_the_rows_real_history(compiler):
    """The sampler tells a constraint the token it picked and the next mask is prepared off
    thread; when the row keeps another token (or none), the mask still follows the history."""
    tok, comp = compiler
    grammar = comp.regex(r"(ab|ac|bc)+", "guided_regex")
    vocab = len(tok)
    allowed = {t for t in range(vocab) if tok.decode([t]) in ("a", "b", "c")}
    p = SamplingParams(max_tokens=10, temperature=0, constraint=comp.matcher(grammar))
    row = Row(tok.eos_token_id)

    def masked_row() -> torch.Tensor:
        logits = torch.zeros(1, vocab)
        p.constraint.mask_rows(logits, [(0, p.constraint, row.generated)])
        return torch.isfinite(logits[0])

    a, b, c = (tok.convert_tokens_to_ids(ch) for ch in "abc")
    for picked, kept in ((a, a), (b, c), (a, None), (b, b)):
        logits = torch.full((1, vocab), -10.0)
        logits[0, picked] = 10.0  # the grammar allows it at this point
        assert select_tokens(logits, [p], [None], None, [row])[0].token_id == picked
        if kept is not None:
            row.generated.append(kept)
        fresh = comp.matcher(grammar)
        logits = torch.zeros(1, vocab)
        fresh.mask_rows(logits, [(0, fresh, row.generated)])
        assert torch.equal(masked_row(), torch.isfinite(logits[0]))
    assert {t for t in torch.nonzero(masked_row()).flatten().tolist()} <= allowed | {tok.eos_token_id}
