"""Degenerate answers: text caught in a loop ("The old millarararararlararar", "wheels wheels wheels").

One definition, on text (so it is the same for every tokenizer and for any caller holding strings: the
locality measure of every job, ``bench/locality.py``):

* a **loop** is a stretch of the text that is one *unit* of 1 to ``MAX_UNIT_CHARS`` characters, the unit
  holding at least one letter, written back to back at least ``MIN_REPEATS`` times. The text is scanned with one space appended, so a word loop's last word counts
  ("wheels wheels wheels");
* an answer is **degenerate** when its loops cover at least ``MIN_LOOP_CHARS`` characters *and* at least
  ``MIN_LOOP_SHARE`` of the answer (its stripped length).

So "arararararar" (12 characters of "ar") and "wheels wheels wheels" are degenerate; "Mississippi",
"bananana", "hahaha", "1000000" and "----------" are not (too short, or no letter in the unit). Only the first
``MAX_SCAN_CHARS`` characters are read. Standard library only.
"""

from __future__ import annotations

MIN_REPEATS = 3  # copies of the unit back to back
MAX_UNIT_CHARS = 64  # longest unit looked for
MIN_LOOP_CHARS = 10  # characters the loops must cover...
MIN_LOOP_SHARE = 0.25  # ...and this share of the answer
MAX_SCAN_CHARS = 2048  # characters of an answer read


def loop_chars(text: str) -> int:
    """How many characters of ``text`` (its first ``MAX_SCAN_CHARS``) lie in a loop (see the module doc)."""
    s = text[:MAX_SCAN_CHARS] + " "
    n = len(s)
    covered = bytearray(n)
    for unit in range(1, min(MAX_UNIT_CHARS, n // MIN_REPEATS) + 1):
        run = 0  # positions i (ending here) with s[i] == s[i + unit]: the periodic stretch is run + unit long
        for i in range(n - unit + 1):
            if i < n - unit and s[i] == s[i + unit]:
                run += 1
                continue
            if run >= (MIN_REPEATS - 1) * unit:
                start = i - run
                if any(c.isalpha() for c in s[start:start + unit]):
                    covered[start:i + unit] = b"\x01" * (i + unit - start)
            run = 0
    return sum(covered[: n - 1])  # the appended space is not the answer's


def is_degenerate(text: str) -> bool:
    """Whether ``text`` is a degenerate answer: loops cover ``MIN_LOOP_CHARS`` characters and ``MIN_LOOP_SHARE``
    of it (see the module doc)."""
    looped = loop_chars(text)
    return looped >= MIN_LOOP_CHARS and looped >= MIN_LOOP_SHARE * len(text.strip()[:MAX_SCAN_CHARS])


def count_degenerate(texts: list[str]) -> int:
    """How many of ``texts`` are degenerate (:func:`is_degenerate`)."""
    return sum(1 for t in texts if is_degenerate(t))
