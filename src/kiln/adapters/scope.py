"""Scoped corrections: does a request fall under one of an adapter's stored corrections? (issue 48)

An adapter trained with ``scope: "corrections"`` answers only the requests its corrections are about; every other
request is answered by the base model, so no correction can move what the base knew elsewhere (SERAC's scope
classifier, Mitchell et al. 2022, and GRACE's key matching, with a lexical key: the base model's hidden states
did not separate a paraphrase from another fact's question in measurement, docs/training.md "Scoped corrections").

A key is the set of content words of a correction's question (its last user message): lower-cased word
characters, function words dropped, a possessive ``'s`` and one inflection (``-ing``, ``-ed``, ``-es``, ``-s``, a
final ``e``) stripped. Each word is weighted by its inverse
document frequency over all the adapter's keys, so the words that tell one correction from another (a name)
weigh most and the words many corrections share (``capital``) least. A request is in scope of a key when

* every one of the key's most specific words (those of its highest weight) is in the request's last user
  message, and
* the request holds at least :data:`REST_RECALL` of the weight of the key's other words (all of them when the
  key has no other words: a lone correction requires every content word).

The first rule keeps another subject's question out; the second keeps out another question about the same
subject, and lets a paraphrase that changes one of two descriptive words through. Pure Python: the serving path
calls it per request without touching the model.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

SCOPE_KEY = "scope"  # manifest config key: "corrections" when the adapter routes by its stored corrections
SCOPE_CORRECTIONS = "corrections"
SCOPE_AUTO = "auto"  # a job's default: unscoped while its locality passes the guard, scoped when it does not
SCOPE_AUTO_KEY = "scope_auto"  # manifest config: why an "auto" job published its adapter scoped
REST_RECALL = 0.5  # the weight of a key's other words a request must hold
_WORD = re.compile(r"\w+(?:['’]\w+)?")
STOPWORDS = frozenset(
    "a an the of in on at to for from by with about into onto through over under is are was were be been being am "
    "do does did what which who whom whose where when why how name tell me please i you we it its this that these "
    "those and or there their them they can could would should will shall may might must".split())


def resolved_scope(requested: str | None, parent_config: dict[str, Any] | None, *, inline: bool = True) -> str:
    """A job's scope: as requested; else ``"corrections"`` when its base adapter is scoped (a scoped adapter stays
    scoped); else ``"auto"`` for inline corrections (:func:`auto_scope`) and ``"off"`` for a dataset (a dataset's
    examples are not kept as scope keys)."""
    if requested is not None:
        return requested
    if (parent_config or {}).get(SCOPE_KEY) == SCOPE_CORRECTIONS:
        return SCOPE_CORRECTIONS
    return SCOPE_AUTO if inline else "off"


def auto_scope(config: dict[str, Any], measure: Callable[[ScopeIndex | None], dict[str, Any] | None],
               judge: Callable[[dict[str, Any] | None], dict[str, Any]], *, learned: bool = True
               ) -> tuple[dict[str, Any] | None, dict[str, Any], dict[str, Any]]:
    """Measure a job's adapter as it will be served and decide its scope.

    ``config``: the job's effective request (its ``scope`` and stored ``corrections``); ``measure``: the locality
    figures with a routing index (None: unscoped); ``judge``: the locality guard's verdict on figures. Returns
    ``(figures, verdict, config_update)``. A job whose scope is ``"auto"`` is measured unscoped first; when the
    guard refuses those figures (and would not be overridden), the job verified it ``learned`` its corrections (an
    adapter that did not is no better on its own questions: nothing to route to), and the same adapter routed by
    its corrections passes, the adapter is published scoped: ``config_update`` sets ``scope`` to
    ``"corrections"`` and records why under ``scope_auto``, and the figures are the scoped ones with the unscoped
    ones under ``auto_scope``. So a
    correction generalises in weight space while that keeps the other answers, and falls back to answering only
    questions about its corrections when it does not."""
    figures = measure(scope_index(config))
    verdict = judge(figures)
    if config.get(SCOPE_KEY) != SCOPE_AUTO or verdict["admitted"] or not learned or figures is None \
            or not figures.get("probes"):
        return figures, verdict, {}
    index = scope_index(config | {SCOPE_KEY: SCOPE_CORRECTIONS})
    if index is None or not index.keys:
        return figures, verdict, {}
    scoped = measure(index)
    scoped_verdict = judge(scoped)
    if not scoped_verdict["admitted"] or scoped is None:
        return figures, verdict, {}
    unscoped = {k: figures[k] for k in ("probes", "unchanged", "unchanged_fraction", "degenerate", "kl_mean")
                if k in figures}
    why = {"reason": verdict["reason"], "unscoped": unscoped}
    return scoped | {"auto_scope": why}, scoped_verdict, {SCOPE_KEY: SCOPE_CORRECTIONS, SCOPE_AUTO_KEY: why}


def scope_index(config: dict[str, Any]) -> ScopeIndex | None:
    """The routing index of an adapter revision's manifest config; None when it is not scoped."""
    if config.get(SCOPE_KEY) != SCOPE_CORRECTIONS:
        return None
    stored = config.get("corrections")
    return ScopeIndex.from_corrections([e for e in stored if isinstance(e, dict)] if isinstance(stored, list) else [])


def revision_scope(store: Any, adapter: str, revision: str | None) -> ScopeIndex | None:
    """The routing index of ``adapter`` at ``revision`` in ``store`` (:class:`kiln.adapters.store.AdapterStore`);
    None when it is not scoped, not loaded (``revision`` None) or not in the store (a private or vanished revision:
    served unscoped)."""
    if revision is None:
        return None
    try:
        return scope_index(store.get(adapter, revision).manifest.config)
    except Exception as exc:  # noqa: BLE001 - the store's typed errors and a damaged manifest alike: unscoped
        log.debug("no scope for %s@%s: %s", adapter, revision, exc)
        return None


def content_words(text: str) -> frozenset[str]:
    """The words a key or a request is matched on."""
    out = set()
    for w in _WORD.findall(text.lower()):
        w = re.sub(r"['’]s$", "", w)
        if w and w not in STOPWORDS:
            out.add(_stem(w))
    return frozenset(out)


def _stem(w: str) -> str:
    """A light suffix strip, the same on both sides: guards, guarding -> guard; bakes, baking, bake -> bak."""
    for suffix in ("ing", "ed", "es", "s"):
        if len(w) > len(suffix) + 2 and w.endswith(suffix) and not w.endswith("ss"):
            w = w[:-len(suffix)]
            break
    return w[:-1] if len(w) > 3 and w.endswith("e") else w


def last_user_text(messages: list[Any]) -> str:
    """The text of the last user message (``content`` a string or a list of text parts; ``{}`` or objects)."""
    for m in reversed(messages):
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        if role != "user":
            continue
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = [p.get("text") if isinstance(p, dict) else getattr(p, "text", None) for p in content]
            return " ".join(p for p in parts if isinstance(p, str))
        return ""
    return ""


@dataclass(frozen=True)
class Decision:
    """A request's routing: in scope (the adapter answers) or not (the base does), and the best key's score."""

    in_scope: bool
    score: float  # the best key's weighted recall over all its words, 0..1
    key: int  # the index of the matching (or, out of scope, the closest) key; -1 without keys


class ScopeIndex:
    """The keys of an adapter's corrections, their word weights, and which keys hold each word."""

    def __init__(self, questions: list[str], rest_recall: float = REST_RECALL):
        self.keys = [content_words(q) for q in questions]
        self.rest_recall = rest_recall
        df: dict[str, int] = {}
        for k in self.keys:
            for w in k:
                df[w] = df.get(w, 0) + 1
        n = len(self.keys)
        self.weight = {w: math.log((n + 1) / (c + 1)) + 1.0 for w, c in df.items()}
        self._parts = [self._split(k) for k in self.keys]
        self._holding: dict[str, list[int]] = {}  # word -> the keys that hold it (the only ones a request can reach)
        for i, k in enumerate(self.keys):
            for w in k:
                self._holding.setdefault(w, []).append(i)

    def _split(self, key: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        """A key's most specific words (those of its highest weight) and the others."""
        if not key:
            return frozenset(), frozenset()
        top = max(self.weight[x] for x in key)
        tops = frozenset(x for x in key if self.weight[x] >= top - 1e-9)
        return tops, key - tops

    @classmethod
    def from_corrections(cls, corrections: list[dict[str, Any]]) -> ScopeIndex:
        """Keys from stored corrections (``{"messages": [...]}``, as an adapter's manifest records them): each one's
        last user message before its last assistant turn."""
        questions = []
        for e in corrections:
            msgs = e.get("messages") if isinstance(e, dict) else None
            if not isinstance(msgs, list):
                continue
            last = max((i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "assistant"),
                       default=len(msgs))
            questions.append(last_user_text(msgs[:last]))
        return cls(questions)

    def _weight(self, words: frozenset[str]) -> float:
        return sum(self.weight[x] for x in words)

    def _match(self, i: int, words: frozenset[str]) -> tuple[bool, float]:
        key = self.keys[i]
        tops, rest = self._parts[i]
        score = self._weight(key & words) / self._weight(key)
        if not tops <= words:
            return False, score
        if not rest:
            return True, score
        return self._weight(rest & words) / self._weight(rest) >= self.rest_recall - 1e-12, score

    def covers(self, messages: list[Any]) -> bool:
        """Whether a chat (its last user message, :func:`last_user_text`) is in scope: the adapter answers it."""
        return self.route(last_user_text(messages)).in_scope

    def route(self, text: str) -> Decision:
        """Is ``text`` (a request's last user message) in scope of some key?"""
        words = content_words(text)
        best = Decision(False, 0.0, -1)
        for i in sorted({i for w in words for i in self._holding.get(w, ())}):
            ok, score = self._match(i, words)
            if ok and (not best.in_scope or score > best.score):
                best = Decision(True, score, i)
            elif not best.in_scope and score > best.score:
                best = Decision(False, score, i)
        return best
