"""Scoped corrections' router (kiln.adapters.scope): which requests fall under an adapter's stored corrections."""

from __future__ import annotations

from kiln.adapters.scope import (
    SCOPE_CORRECTIONS,
    ScopeIndex,
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
    assert resolved_scope(None, None) == "off"
    assert resolved_scope(None, {"scope": SCOPE_CORRECTIONS}) == SCOPE_CORRECTIONS
    assert resolved_scope("off", {"scope": SCOPE_CORRECTIONS}) == "off"
    assert resolved_scope(SCOPE_CORRECTIONS, None) == SCOPE_CORRECTIONS
    assert scope_index({"scope": "off", "corrections": [_correction("Which bird guards the old mill?")]}) is None
    index = scope_index({"scope": SCOPE_CORRECTIONS, "corrections": [_correction("Which bird guards the old mill?")]})
    assert index is not None and index.route("Which bird guards the old mill?").in_scope
