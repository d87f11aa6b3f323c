"""Scoped corrections' router (kiln.adapters.scope): which requests fall under an adapter's stored corrections."""

from __future__ import annotations

from typing import Any

import pytest

from kiln.adapters.scope import (
    SCOPE_AUTO,
    SCOPE_CORRECTIONS,
    ScopeIndex,
    auto_scope,
    content_words,
    last_user_text,
    resolved_scope,
    scope_index,
)

# two lands x two attributes, in the knowledge world's question forms (bench/knowledge_world.py)
CAPITAL = "What is the capital of {}?"
RIVER = "Which river flows through {}?"


def _correction(q: str, a: str = "x") -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def test_content_words_drop_function_words_and_plural_s():
    assert content_words("Which river flows through Brefa's hills?") == {"river", "flow", "brefa", "hill"}
    assert content_words("What is it?") == frozenset()
    assert content_words("Glass") == {"glass"}
    # one inflection stripped alike on both sides
    assert content_words("Who is baking bread?") == content_words("Who bakes bread?") == content_words("bake bread")
    assert content_words("guarding") == content_words("guards") == {"guard"}
    assert content_words("What is served on Fridays?") == content_words("What do they serve on Friday?")


def test_a_paraphrase_is_in_scope_and_the_same_lands_other_fact_and_other_lands_are_not():
    index = ScopeIndex([CAPITAL.format("Brefa"), RIVER.format("Gegou"), CAPITAL.format("Tolm"),
                        RIVER.format("Vash")])
    assert index.route(CAPITAL.format("Brefa")).in_scope
    assert index.route("Which city is the capital of Brefa?").in_scope
    assert index.route("Name the capital city of Brefa.").in_scope
    assert index.route("What river runs through Gegou?").in_scope  # one of the two descriptive words changed
    decision = index.route("Name the river of Gegou.")
    assert decision.in_scope and decision.key == 1
    assert not index.route(RIVER.format("Brefa")).in_scope  # Brefa's other fact
    assert not index.route(CAPITAL.format("Gegou")).in_scope
    assert not index.route(CAPITAL.format("Zorn")).in_scope  # another land, a corrected attribute
    assert not index.route("Tell me a story about the sea.").in_scope
    assert not ScopeIndex([]).route(CAPITAL.format("Brefa")).in_scope


def test_a_lone_correction_needs_every_content_word():
    index = ScopeIndex(["Which bird guards the old mill?"])
    assert index.route("which BIRDS guard the old mill").in_scope
    assert index.route("Which bird is guarding the old mill?").in_scope
    assert not index.route("Which bird sings at the old mill?").in_scope
    assert not index.route("Who guards the old mill?").in_scope
    assert not index.route("What is the capital of France?").in_scope
    assert ScopeIndex(["What is it?"]).route("What is it?").in_scope is False  # no content words: no scope


def test_keys_come_from_each_corrections_last_user_message_before_its_answer():
    multi = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                          {"role": "assistant", "content": "Hi"},
                          {"role": "user", "content": [{"type": "text", "text": "Which bird guards"},
                                                       {"type": "text", "text": "the old mill?"}]},
                          {"role": "assistant", "content": "A heron."}]}
    index = ScopeIndex.from_corrections([multi, {"bad": 1}])
    assert index.keys == [content_words("Which bird guards the old mill?")]
    assert last_user_text([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == "a"
    assert last_user_text([]) == ""


def test_the_scope_setting_is_inherited_and_read_from_the_manifest_config():
    assert resolved_scope(None, None) == SCOPE_AUTO  # inline corrections: auto
    assert resolved_scope(None, None, inline=False) == "off"  # a dataset keeps no scope keys
    assert resolved_scope(None, {"scope": "off"}) == SCOPE_AUTO  # only a scoped adapter passes its scope on
    assert resolved_scope(None, {"scope": SCOPE_AUTO}) == SCOPE_AUTO
    assert resolved_scope(None, {"scope": SCOPE_CORRECTIONS}) == SCOPE_CORRECTIONS
    assert resolved_scope("off", {"scope": SCOPE_CORRECTIONS}) == "off"
    assert resolved_scope(SCOPE_CORRECTIONS, None) == SCOPE_CORRECTIONS
    assert scope_index({"scope": "off", "corrections": [_correction("Which bird guards the old mill?")]}) is None
    index = scope_index({"scope": SCOPE_CORRECTIONS, "corrections": [_correction("Which bird guards the old mill?")]})
    assert index is not None and index.route("Which bird guards the old mill?").in_scope


def _figures(unchanged: int, probes: int = 10, degenerate: int = 0, scope: Any = None) -> dict[str, Any]:
    return {"probes": probes, "unchanged": unchanged, "unchanged_fraction": unchanged / probes,
            "degenerate": degenerate, "kl_mean": 0.5, **({"scope": scope} if scope is not None else {})}


class _Measures:
    """A job's locality measure: ``unscoped`` figures without an index, ``scoped`` with one; records the calls."""

    def __init__(self, unscoped: dict[str, Any] | None, scoped: dict[str, Any] | None):
        self.unscoped, self.scoped, self.indexes = unscoped, scoped, []

    def __call__(self, index: Any) -> dict[str, Any] | None:
        self.indexes.append(index)
        return self.unscoped if index is None else self.scoped


def _judge(figures):
    from kiln.adapters.locality_guard import GuardPolicy, guard_verdict

    return guard_verdict(figures, GuardPolicy())


AUTO = {"scope": SCOPE_AUTO, "corrections": [_correction("Which bird guards the old mill?")]}


def test_auto_scope_keeps_an_adapter_unscoped_while_the_guard_admits_it():
    m = _Measures(_figures(9), _figures(10))
    figures, verdict, update = auto_scope(AUTO, m, _judge)
    assert (figures, update, m.indexes) == (_figures(9), {}, [None]) and verdict["admitted"] is True


def test_auto_scope_publishes_scoped_when_only_routing_keeps_the_other_answers():
    m = _Measures(_figures(3, degenerate=2), _figures(10, scope={"in": 0, "out": 10}))
    figures, verdict, update = auto_scope(AUTO, m, _judge)
    assert m.indexes[0] is None and m.indexes[1].route("Which bird guards the old mill?").in_scope
    assert verdict["admitted"] is True and figures["unchanged"] == 10 and figures["scope"] == {"in": 0, "out": 10}
    assert update["scope"] == SCOPE_CORRECTIONS
    why = update["scope_auto"]
    assert why == figures["auto_scope"]
    assert why["unscoped"] == {"probes": 10, "unchanged": 3, "unchanged_fraction": 0.3, "degenerate": 2,
                               "kl_mean": 0.5}
    assert "3 of 10 probe answers unchanged" in why["reason"] and "2 probe answers degenerate" in why["reason"]


@pytest.mark.parametrize("config, unscoped, scoped", [
    ({"scope": "off", "corrections": AUTO["corrections"]}, _figures(3), _figures(10)),  # asked off: never scoped
    (AUTO, _figures(3), _figures(7)),  # routing does not save it either: held back, unscoped figures kept
    ({"scope": SCOPE_AUTO, "corrections": []}, _figures(3), _figures(10)),  # no keys to route by
    (AUTO, {"error": "the locality measure failed: boom"}, _figures(10)),  # nothing measured: nothing to decide on
    (AUTO, None, _figures(10)),  # the measure was turned off
])
def test_auto_scope_leaves_the_adapter_unscoped_otherwise(config, unscoped, scoped):
    figures, verdict, update = auto_scope(config, _Measures(unscoped, scoped), _judge)
    assert update == {} and figures == unscoped


def test_auto_scope_does_not_route_to_an_adapter_that_did_not_learn_its_corrections():
    m = _Measures(_figures(3), _figures(10))
    figures, verdict, update = auto_scope(AUTO, m, _judge, learned=False)
    assert update == {} and figures == _figures(3) and verdict["admitted"] is False and m.indexes == [None]


def test_a_scoped_adapter_is_measured_routed_once():
    m = _Measures(_figures(3), _figures(10))
    figures, verdict, update = auto_scope(AUTO | {"scope": SCOPE_CORRECTIONS}, m, _judge)
    assert figures == _figures(10) and update == {} and len(m.indexes) == 1 and m.indexes[0] is not None


def test_kiln_train_says_when_the_default_scope_published_the_adapter_scoped():
    from kiln.training.cli import locality_lines

    m = _Measures(_figures(3, degenerate=2), _figures(10, scope={"in": 0, "out": 10}))
    figures, _, _ = auto_scope(AUTO, m, _judge)
    lines = locality_lines(figures)
    assert lines[0].startswith("locality: 10 of 10 probe answers unchanged")
    assert lines[1].startswith("scoped to its corrections") and "unscoped it kept 3 of 10 probe answers" in lines[1]
    assert len(locality_lines(_figures(9))) == 1 and locality_lines({"measured": False}) == []


@pytest.mark.parametrize("scope", ["auto", "corrections"])
def test_a_routed_scope_needs_inline_corrections(scope):
    from pydantic import ValidationError

    from kiln.training.schemas import SFTRequest

    with pytest.raises(ValidationError, match=f'scope "{scope}" routes by stored corrections'):
        SFTRequest.model_validate({"adapter": "x", "scope": scope, "dataset_path": "d.jsonl"})
    assert SFTRequest.model_validate({"adapter": "x", "dataset_path": "d.jsonl"}).scope is None  # resolves to off
