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


BOMB = "(y{1000}){1000}"  # a 15-byte regex whose lexer, unbounded, takes seconds and ~200 MB


@pytest.mark.parametrize("build", [
    lambda c: c.regex(BOMB, "guided_regex"),
    lambda c: c.json_schema({"type": "string", "pattern": f"^{BOMB}$"}, "guided_json"),
    lambda c: c.json_schema({"$ref": "#"}, "guided_json"),  # admits no value at all
    lambda c: c.json_schema({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                            "guided_json"),  # every value is infinite
])
def test_grammars_that_cannot_complete_are_refused_before_generation(compiler, build):
    import asyncio

    from kiln.runtime.constrained import GrammarTooComplex

    _, comp = compiler
    before = comp.cached
    with pytest.raises(GrammarTooComplex) as exc:
        asyncio.run(comp.compile(lambda: build(comp), "guided_json"))
    assert exc.value.status == 400 and exc.value.code == "grammar_too_complex"
    assert comp.cached == before  # nothing of a refused grammar is kept


def test_a_grammar_that_gives_up_mid_generation_ends_the_row_marked(compiler):
    """A grammar whose limit is reached only after some tokens: the row is told to end (only the end
    token is left) and its constraint says why, so the engine reports an error finish, not ``stop``."""
    tok, comp = compiler
    grammar = comp.regex("a{0,40}" + BOMB, "guided_regex")  # the probe walks 'a's and passes
    p = SamplingParams(max_tokens=50, temperature=0, constraint=comp.matcher(grammar))
    row = Row(tok.eos_token_id)
    y = tok.convert_tokens_to_ids("y")
    for _ in range(20):
        logits = torch.zeros(1, len(tok))
        logits[0, y] = 5.0  # the model wants 'y': the lexer must grow for it
        t = select_tokens(logits, [p], [None], None, [row])[0].token_id
        if t == tok.eos_token_id:
            break
        row.generated.append(t)
    assert t == tok.eos_token_id and 0 < len(row.generated) < 20
    assert p.constraint.error and "lexer" in p.constraint.error


def test_compile_deadline_queue_and_byte_bounded_cache(builtin_model_dir):
    import asyncio
    import time

    from transformers import AutoTokenizer

    from kiln.errors import Unavailable
    from kiln.runtime.constrained import MAX_PENDING_COMPILES, GrammarCompiler, GrammarTooComplex

    tok = AutoTokenizer.from_pretrained(builtin_model_dir)
    comp = GrammarCompiler(tok, len(tok), [tok.eos_token_id], timeout_s=0.2, cache_bytes=300_000)
    outcomes: list[str] = []
    comp.observer = lambda outcome, seconds: outcomes.append(outcome)

    def slow() -> str:  # stands in for a grammar whose compilation outlasts the deadline
        time.sleep(0.5)
        return comp.regex("abc", "guided_regex")

    async def crowd() -> list:
        jobs = [comp.compile(slow, "guided_regex") for _ in range(MAX_PENDING_COMPILES + 1)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    out = asyncio.run(crowd())
    assert sum(isinstance(e, Unavailable) and e.retry_after for e in out) == 1
    assert all(isinstance(e, (GrammarTooComplex, Unavailable)) for e in out)
    assert any(isinstance(e, GrammarTooComplex) and "grammar_compile_timeout_s" in e.message for e in out)
    time.sleep(0.5 * MAX_PENDING_COMPILES)  # let the compile thread drain the abandoned jobs
    comp.timeout_s = 5.0
    for i in range(40):
        asyncio.run(comp.compile(lambda i=i: comp.regex(f"x{i}[a-c]+", "guided_regex"), "guided_regex"))
        count, nbytes = comp.cached
        assert nbytes <= 300_000 and count <= 40
    assert outcomes.count("compiled") >= 40 and count < 40  # least recently used grammars were dropped
