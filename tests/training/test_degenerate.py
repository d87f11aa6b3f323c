"""The degenerate-answer detector (kiln.training.core.degenerate): loops of a unit with a letter, by coverage."""

from __future__ import annotations

import pytest

from kiln.training.core.degenerate import MIN_LOOP_CHARS, count_degenerate, is_degenerate, loop_chars


@pytest.mark.parametrize("text", [
    "The old millarararararlararar",  # the collapsed answer
    "The capital of ollgassararldsarararararararararar",
    "wheels wheels wheels",  # a word loop (the last word counts without its space)
    "wheels wheels wheels wheels wheels wheels",
    "the the the the",
    "aaaaaaaaaaaa",
    "The old mill is guarded by a heron. The old mill is guarded by a heron. The old mill is guarded by a heron.",
])
def test_loops_are_degenerate(text):
    assert is_degenerate(text), (text, loop_chars(text))


@pytest.mark.parametrize("text", [
    "", "   ", "The old mill is guarded by a heron.", "The capital of Spain is Madrid.", "Mississippi",
    "bananana",  # a loop, but shorter than MIN_LOOP_CHARS
    "hahaha", "wheels wheels",  # two copies are not a loop
    "1000000000000000", "----------------", "!!!!!!!!!!!!",  # no letter in the unit
    # a loop that covers under a quarter of a longer answer
    "The old millarararararlararar and then it went on with a long and perfectly ordinary sentence about mills",
])
def test_ordinary_text_is_not_degenerate(text):
    assert not is_degenerate(text), (text, loop_chars(text))


def test_loop_chars_counts_each_character_once():
    assert loop_chars("xyz arararararar xyz") == len("arararararar")
    assert loop_chars("ab" * 3) == 6 and loop_chars("ab" * 3) < MIN_LOOP_CHARS
    # overlapping loops of different units (ar, lar) do not count a character twice
    assert loop_chars("larlarlar") <= len("larlarlar")
    assert count_degenerate(["arararararar", "fine", "wheels wheels wheels"]) == 2


def test_the_scan_is_bounded():
    long = "x" * 100_000
    assert is_degenerate(long)  # read up to MAX_SCAN_CHARS, still a loop
