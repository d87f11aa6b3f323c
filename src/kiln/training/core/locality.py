"""Locality: how much a trained adapter changed what the model answers away from what the job taught.

Every training job measures it at its end, before publication (:class:`kiln.training.core.recipe.TrainingRecipe`),
and its figures go into the job's result, the adapter's training receipt, ``GET /v1/adapters``, the dashboard
and ``/metrics``; the locality guard (:mod:`kiln.adapters.locality_guard`) holds back activation under its
thresholds. The measure:

* **probe set** (:func:`probe_set`): (a) ``probes`` questions the base model writes itself, sampled seeded from
  the chat template's user-turn prefix exactly as OPD's rehearsal questions are
  (:func:`kiln.training.core.rehearsal.write_questions`), and (b) the job's own probes (the request's
  ``locality.prompts`` and its ``locality.eval_suite``'s prompts, :func:`user_probes`), each answered greedily by
  the base model (all adapters disabled), at most
  ``max_tokens`` tokens. It is cached per base model and probe settings (:data:`_CACHE`), so only the first job
  of a process writes the questions;
* **measures** (:func:`measure`), with the job's adapter active, under the caller's exclusive ownership:
  ``unchanged`` (probes whose greedy answer is token for token the base's) and ``unchanged_fraction``;
  ``kl_mean``: KL(base || adapter) per answer token, teacher-forced on the base's answers (one batched forward
  with the adapter, one without), in nats, and ``kl_max`` (the largest probe's mean); ``degenerate``: probes
  whose adapter answer is degenerate (:func:`kiln.training.core.degenerate.is_degenerate`) while the base's answer
  is not, and ``base_degenerate`` (the base's own degenerate answers, for context);
* ``changed``: up to ``MAX_EXAMPLES`` changed answers (question, base, adapter; cut at ``MAX_EXAMPLE_CHARS``).

torch is imported inside the functions that use it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.canonical import canonical_sha256
from kiln.training.core.degenerate import is_degenerate

DEFAULT_PROBES = 16  # questions the base model writes
DEFAULT_MAX_TOKENS = 24  # per answer
MAX_PROBES = 256
MAX_USER_PROBES = 64
MAX_PROBE_CHARS = 2_000
MAX_EXAMPLES = 3  # changed answers kept in the result
MAX_EXAMPLE_CHARS = 160
CACHE_ENTRIES = 8  # probe sets kept per process (one per base model and settings)
PROBE_SEED_OFFSET = 7_919  # the probe questions' seed differs from a job's rehearsal seed


@dataclass(frozen=True)
class TextCodec:
    """What the probe set needs of the tokenizer: the chat template as text (``render``: messages -> text,
    without a generation prompt), a chat prompt's token IDs (``encode_chat``), plain text's (``encode_text``),
    and ``decode``."""

    render: Callable[[list[dict[str, Any]]], str]
    encode_chat: Callable[[list[dict[str, Any]]], list[int]]
    encode_text: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def text_codec(tokenizer: Any, engine: Any = None) -> TextCodec:
    """The serving engine's own chat encoding when it has one (so probes are prompted as served requests are),
    else the tokenizer's chat template (``kiln train run``, tests)."""
    def chat(messages: list[dict[str, Any]]) -> list[int]:
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    has = engine is not None and hasattr(engine, "encode_chat")
    return TextCodec(
        render=lambda m: tokenizer.apply_chat_template(m, tokenize=False),
        encode_chat=engine.encode_chat if has else chat,
        encode_text=engine.encode_text if has else (lambda t: tokenizer.encode(t, add_special_tokens=False)),
        decode=engine.decode if has else (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)))


@dataclass(frozen=True)
class ProbeSet:
    """The probes and the base model's greedy answers (token IDs, through the end-of-turn token)."""

    sha256: str  # digest of the prompts and the base's answers: which probe set a figure is about
    questions: tuple[str, ...]  # each probe's question text
    prompts: tuple[tuple[int, ...], ...]
    answers: tuple[tuple[int, ...], ...]
    base_degenerate: tuple[bool, ...]
    user: int  # how many probes (the last ones) came from the request

    def __len__(self) -> int:
        return len(self.prompts)


_CACHE: OrderedDict[str, ProbeSet] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def probe_key(base_model_sha256: str, *, probes: int, max_tokens: int, seed: int, user_prompts: Sequence[Any]) -> str:
    """The cache key of a probe set: the base model and everything that chooses the probes."""
    return canonical_sha256({"base": base_model_sha256, "probes": probes, "max_tokens": max_tokens, "seed": seed,
                             "user": list(user_prompts)})


def probe_set(peft_model: Any, codec: TextCodec, *, base_model_sha256: str, probes: int = DEFAULT_PROBES,
              max_tokens: int = DEFAULT_MAX_TOKENS, seed: int = 0, user_prompts: Sequence[Any] = (), pad_id: int,
              end_ids: Sequence[int]) -> ProbeSet:
    """The probe set for this base model and settings: from the process cache, else written now (the base
    model writes ``probes`` questions, then answers them and ``user_prompts``: questions, or conversations ending
    with the user's turn, as an eval suite's examples are). Call under exclusive ownership."""
    key = probe_key(base_model_sha256, probes=probes, max_tokens=max_tokens, seed=seed, user_prompts=user_prompts)
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    made = _write_probe_set(peft_model, codec, probes=probes, max_tokens=max_tokens, seed=seed,
                            user_prompts=user_prompts, pad_id=pad_id, end_ids=end_ids)
    with _CACHE_LOCK:
        _CACHE[key] = made
        while len(_CACHE) > CACHE_ENTRIES:
            _CACHE.popitem(last=False)
    return made


Probe = str | Sequence[dict[str, Any]]  # a user question, or a conversation ending with the user's turn


def _conversation(probe: Probe) -> list[dict[str, Any]]:
    if isinstance(probe, str):
        return [{"role": "user", "content": probe.strip()}]
    return [{"role": m["role"], "content": m["content"]} for m in probe]


def _write_probe_set(peft_model: Any, codec: TextCodec, *, probes: int, max_tokens: int, seed: int,
                     user_prompts: Sequence[Probe], pad_id: int, end_ids: Sequence[int]) -> ProbeSet:
    from kiln.training.core.rehearsal import greedy_answers, user_turn_prefix, write_questions

    device = next(peft_model.parameters()).device
    written = write_questions(peft_model, user_turn_prefix(codec.render, codec.encode_text), probes, max_tokens,
                              seed=seed + PROBE_SEED_OFFSET, pad_id=pad_id, end_ids=end_ids, device=device)
    convs = [_conversation(t) for t in dict.fromkeys(codec.decode(q).strip() for q in written) if t]
    own = len(convs)
    for c in (_conversation(u) for u in user_prompts):
        if c and c[-1]["content"] and c not in convs:
            convs.append(c)
    prompts = [codec.encode_chat(c) for c in convs]
    with peft_model.disable_adapter():
        answers = greedy_answers(peft_model, prompts, max_tokens=max_tokens, pad_id=pad_id, end_ids=end_ids,
                                 device=device) if prompts else []
    kept = [(i, c[-1]["content"], p, a) for i, (c, p, a) in enumerate(zip(convs, prompts, answers)) if a]
    ends = set(end_ids)
    return ProbeSet(
        sha256=canonical_sha256({"prompts": [p for _, _, p, _ in kept], "answers": [a for *_, a in kept]}),
        questions=tuple(q for _, q, _, _ in kept), prompts=tuple(tuple(p) for _, _, p, _ in kept),
        answers=tuple(tuple(a) for *_, a in kept),
        base_degenerate=tuple(is_degenerate(codec.decode([t for t in a if t not in ends])) for *_, a in kept),
        user=sum(1 for i, *_ in kept if i >= own))


def measure(peft_model: Any, adapter: str, probes: ProbeSet, codec: TextCodec, *, max_tokens: int, pad_id: int,
            end_ids: Sequence[int], in_scope: Sequence[bool] | None = None) -> dict[str, Any]:
    """The locality figures of adapter ``adapter`` (loaded in ``peft_model``) on ``probes`` (module doc). Call
    under exclusive ownership; the previously active adapter is active again afterwards. ``in_scope``: per probe,
    whether a scoped adapter (``kiln.adapters.scope``) answers it; the others are answered by the base model when
    served, so they count as the base's answer with KL 0 (``scope`` in the figures counts both)."""
    import torch

    from kiln.training.core.step import completion_logits
    from kiln.training.core.rehearsal import greedy_answers
    from kiln.training.core.lora import release_private

    t0 = time.perf_counter()
    if not len(probes):
        return summary(probes, [], [], 0.0, 0.0, 0, codec, end_ids, time.perf_counter() - t0)
    device = next(peft_model.parameters()).device
    pairs = list(zip(probes.prompts, probes.answers))
    previous = peft_model.active_adapter
    peft_model.base_model.set_adapter(adapter, inference_mode=True)
    try:
        answers = greedy_answers(peft_model, [list(p) for p in probes.prompts], max_tokens=max_tokens,
                                 pad_id=pad_id, end_ids=end_ids, device=device)
        with torch.no_grad():
            tuned = completion_logits(peft_model, pairs, device).float().log_softmax(-1)
            with peft_model.disable_adapter():
                base = completion_logits(peft_model, pairs, device).float().log_softmax(-1)
    finally:
        release_private(peft_model, adapter, previous)
    per_token = (base.exp() * (base - tuned)).sum(-1).clamp_min(0.0)  # KL(base || adapter) at each answer token
    lengths = [len(a) for a in probes.answers]
    if in_scope is not None:  # out of scope the base answers: its own answer, no divergence
        answers = [a if routed else list(b) for a, b, routed in zip(answers, probes.answers, in_scope)]
        per_token = torch.cat([x if routed else torch.zeros_like(x)
                               for x, routed in zip(per_token.split(lengths), in_scope)])
    per_probe = [float(x.mean()) for x in per_token.split(lengths)]
    figures = summary(probes, answers, per_probe, float(per_token.mean()), max(per_probe), len(per_token), codec,
                      end_ids, time.perf_counter() - t0)
    if in_scope is not None:
        figures["scope"] = {"in": sum(in_scope), "out": len(in_scope) - sum(in_scope)}
    return figures


def summary(probes: ProbeSet, answers: Sequence[Sequence[int]], per_probe_kl: Sequence[float], kl_mean: float,
            kl_max: float, tokens: int, codec: TextCodec, end_ids: Sequence[int], seconds: float) -> dict[str, Any]:
    """The figures a job reports (module doc) from the adapter's greedy ``answers`` and the KL figures."""
    ends = set(end_ids)

    def text(ids: Sequence[int]) -> str:
        return codec.decode([t for t in ids if t not in ends])

    unchanged = [tuple(a) == b for a, b in zip(answers, probes.answers)]
    adapter_texts = [text(a) for a in answers]
    degenerate = sum(1 for t, was in zip(adapter_texts, probes.base_degenerate) if not was and is_degenerate(t))
    changed = [{"question": _cut(q), "base": _cut(text(b)), "adapter": _cut(t)}
               for q, b, t, same in zip(probes.questions, probes.answers, adapter_texts, unchanged) if not same]
    n = len(probes)
    return {
        "probes": n,
        "user_probes": probes.user,
        "unchanged": sum(unchanged),
        "unchanged_fraction": round(sum(unchanged) / n, 4) if n else None,
        "kl_mean": round(kl_mean, 6) if n else None,
        "kl_max": round(kl_max, 6) if n else None,
        "degenerate": degenerate,
        "base_degenerate": sum(probes.base_degenerate),
        "tokens": tokens,
        "probe_set_sha256": probes.sha256,
        "changed": changed[:MAX_EXAMPLES],
        "seconds": round(seconds, 4),
    }


def _cut(s: str) -> str:
    return s if len(s) <= MAX_EXAMPLE_CHARS else s[: MAX_EXAMPLE_CHARS - 1] + "\u2026"


def job_locality(peft_model: Any, adapter: str, loaded: Any, engine: Any, section: Any, request: dict[str, Any],
                 exclusive: Callable[[], Any], suites: Any = None, scope: Any = None) -> dict[str, Any] | None:
    """A training job's locality figures (``adapter``: its private adapter in ``peft_model``), or None when the
    server's ``section`` (``settings.locality``) or the job's ``request`` (its ``locality`` field) turns the
    measure off. ``exclusive``: the job's exclusive-ownership context (the probes run under it); ``suites``: the
    eval suite store (``.get(name)``) a request's ``eval_suite`` is read from; ``scope``: a scoped adapter's
    :class:`kiln.adapters.scope.ScopeIndex` (probes out of its scope are served by the base model)."""
    if not section.measure or not request.get("measure", True):
        return None
    t0 = time.perf_counter()
    with exclusive():
        probes, codec, pad_id, end_ids = served_probe_set(peft_model, loaded, engine, section,
                                                          user_probes(request, suites))
        routed = None if scope is None else [scope.route(q).in_scope for q in probes.questions]
        figures = measure(peft_model, adapter, probes, codec, max_tokens=section.max_tokens, pad_id=pad_id,
                          end_ids=end_ids, in_scope=routed)
    return figures | {"seconds": round(time.perf_counter() - t0, 4)}


def served_probe_set(peft_model: Any, loaded: Any, engine: Any, section: Any,
                     user_prompts: Sequence[Probe] = ()) -> tuple[ProbeSet, TextCodec, int, list[int]]:
    """The probe set of the served model ``loaded`` with the server's ``section`` (``settings.locality``) and
    ``user_prompts`` (:func:`probe_set`, cached), with the codec, pad ID and end-of-turn IDs it was made with.
    Call under exclusive ownership: a job's measure and the start-up warm-up
    (:mod:`kiln.training.core.warmup`) both come here, so they share one cache entry."""
    from kiln.training.core.templates import end_of_turn_ids

    tok = loaded.tokenizer
    end_ids = sorted(end_of_turn_ids(tok, getattr(loaded.model, "generation_config", None)))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else end_ids[0]
    codec = text_codec(tok, engine)
    probes = probe_set(peft_model, codec, base_model_sha256=loaded.base_model_sha256, probes=section.probes,
                       max_tokens=section.max_tokens, seed=section.seed, user_prompts=user_prompts, pad_id=pad_id,
                       end_ids=end_ids)
    return probes, codec, pad_id, end_ids


def user_probes(request: dict[str, Any], suites: Any) -> list[Probe]:
    """The job's own probes: its ``prompts`` and the prompts of its ``eval_suite``'s examples (at most
    ``MAX_USER_PROBES`` of those, in order)."""
    out: list[Probe] = list(request.get("prompts") or [])
    name = request.get("eval_suite")
    if name:
        if suites is None:
            raise RuntimeError(f"eval suite {name!r}: evals are not available in this process")
        examples = suites.get(name).examples[:MAX_USER_PROBES]
        out += [[m.model_dump(include={"role", "content"}) for m in ex.messages] for ex in examples]
    return out
