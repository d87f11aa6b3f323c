"""One evaluation on the engine (steps 1-5 of :mod:`kiln.evals.service`): load a private adapter, generate
every row beside live traffic, judge, score and aggregate, unload; with the provenance a replay checks.

:class:`Evaluation` is the engine-facing half of :class:`kiln.evals.service.EvalService` (which owns the
suites, the queue, the worker and the run kinds built from evaluations).
"""

from __future__ import annotations

import logging
import platform
import secrets
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from kiln.errors import Conflict, Unavailable
from kiln.evals import gate as gates
from kiln.evals import schemas as s
from kiln.evals.scorers import Scorers, judge_prompt, judge_verdict
from kiln.evals.store import RunStore, suite_digest
from kiln.runtime.chat_generation import ChatGeneration

if TYPE_CHECKING:
    from kiln.runtime.engine import Engine
    from kiln.runtime.loader import LoadedModel
    from kiln.adapters.activation import AdapterActivation
    from kiln.runtime.memory_budget import MemoryBudget

log = logging.getLogger("kiln.evals")

ROW_TIMEOUT_S = 600.0  # one generated row; an engine that stalls longer fails the run
PRIVATE_PREFIX = "kiln-eval-"


@dataclass(frozen=True)
class Resolved:
    """A target made concrete: the adapter revision (None: the base model) and its files."""

    adapter: str | None
    revision: str | None
    path: Path | None
    scope: Any = None  # the revision's routing index when it is scoped (kiln.adapters.scope); None: unscoped

    def routed(self, name: str | None, messages: list[Any]) -> str | None:
        """The engine name that answers ``messages`` as the server would: ``name`` (the private load), or the base
        model (None) for a scoped adapter when the last user message is out of its corrections' scope."""
        return name if name is None or self.scope is None or self.scope.covers(messages) else None

    def identity(self, base_sha: str) -> dict[str, Any]:
        return {"adapter": self.adapter, "revision": self.revision, "base_model_sha256": base_sha}


def runtime_provenance(engine: Any, loaded: Any) -> dict[str, Any]:
    """What the numbers of a run depend on besides the model and the suite."""
    import importlib.metadata as md

    def ver(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    out: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                           "kiln": ver("kiln"), "torch": ver("torch"), "transformers": ver("transformers"),
                           "peft": ver("peft"), "device": str(getattr(loaded, "device", "")),
                           "dtype": str(getattr(loaded, "dtype", ""))}
    try:
        import torch

        out["torch_threads"] = torch.get_num_threads()
        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - provenance is best effort for optional fields
        pass
    return out


class Evaluation:
    """Runs one suite against one target on the engine (mixed into :class:`kiln.evals.service.EvalService`,
    which provides the attributes below and ``_check_cancel`` / ``_resolve``)."""

    engine: Engine
    loaded: LoadedModel
    settings: Any  # kiln.config.Settings: serving.reasoning_parser / thinking_token_budget
    allow_code: bool
    runs: RunStore
    metrics: Any
    memory: MemoryBudget | None  # memory admission of submissions (kiln.runtime.memory_budget); None: none
    activation: AdapterActivation  # private loads: quarantine, memory reservation, canary
    _gating: bool  # the run being executed is a post-train gate (its job's own reservation is not in its way)

    @contextmanager
    def _loaded(self, resolved: Resolved) -> Iterator[str | None]:
        """The engine name to generate with: ``None`` for the base, else a private load of the revision."""
        if resolved.adapter is None:
            yield None
            return
        name = f"{PRIVATE_PREFIX}{secrets.token_hex(6)}"
        assert resolved.adapter is not None and resolved.path is not None and resolved.revision is not None
        with self.activation.private(
                name, resolved.adapter, resolved.revision, resolved.path,
                what=f"the eval's private load of {resolved.adapter!r} revision {resolved.revision[:12]}",
                ignore_kinds=frozenset({"training"}) if self._gating else frozenset()):
            yield name

    def _verify_loaded(self, name: str | None, resolved: Resolved) -> None:
        """Before generation: the engine serves exactly the resolved revision under ``name``."""
        if name is None:
            return
        live = self.engine.active_adapters().get(name)
        if live != resolved.revision:
            raise Conflict(f"loaded {name} is revision {live}, expected {resolved.revision}",
                           code="loaded_revision_mismatch")

    def _evaluate(self, run_id: str, suite: s.SuiteSpec, target: s.Target, *, resolved: Resolved | None = None,
                  cancel_id: str | None = None, expect: dict[str, Any] | None = None) -> dict[str, Any]:
        cancel_id = cancel_id or run_id
        resolved = resolved or self._resolve(target)
        judges = [(i, sc) for i, sc in enumerate(suite.scorers) if isinstance(sc, s.JudgeScorer)]
        judge_res = {i: self._resolve(sc.judge) for i, sc in judges}
        gen = suite.generation
        k = gen.samples
        seeds = [[gen.seed + i * k + j for j in range(k)] for i in range(len(suite.examples))]
        with ExitStack() as stack:
            name = stack.enter_context(self._loaded(resolved))
            judge_names = {i: stack.enter_context(self._loaded(r)) for i, r in judge_res.items()}
            if expect is not None:  # strict replay: the loaded candidate and judges are the recorded ones
                self._expect(expect, resolved, judge_res)
            self._verify_loaded(name, resolved)
            for i, r in judge_res.items():
                self._verify_loaded(judge_names[i], r)
            t0 = time.perf_counter()
            contract = self._contract(gen)
            messages = [[m.model_dump() for m in ex.messages] for ex in suite.examples]
            prompts = [contract.prompt_ids(m) for m in messages]
            # a scoped candidate answers as served: the base model answers the examples out of its scope
            names = [resolved.routed(name, m) for m in messages]
            completions = self._generate(cancel_id, prompts, seeds, gen, names, progress=run_id, contract=contract)
            gen_s = time.perf_counter() - t0
            verdicts: dict[int, list[list[tuple[bool, str]]]] = {}
            for i, sc in judges:
                verdicts[i] = self._judge(cancel_id, suite, sc, completions, judge_names[i])
        self._check_cancel(cancel_id)
        scorers = Scorers(suite, allow_code_execution=self.allow_code, sandbox=self._sandbox())
        examples = []
        ids = suite.example_ids()
        for i, ex in enumerate(suite.examples):
            samples = []
            for j, comp in enumerate(completions[i]):
                per = []
                for si, spec in enumerate(suite.scorers):
                    if si in verdicts:
                        ok, raw = verdicts[si][i][j]
                        per.append({"scorer": si, "type": "judge", "passed": ok, "detail": raw[:200]})
                    else:
                        sc_ = scorers.score(si, spec, comp["text"], ex)
                        per.append({"scorer": si, "type": spec.type, **sc_.as_dict()})
                samples.append({"seed": seeds[i][j], "completion": comp["text"], "reasoning": comp["reasoning"],
                                "finish_reason": comp["finish"], "tokens": comp["tokens"],
                                "passed": all(p["passed"] for p in per), "scores": per})
            passed, score = _aggregate(suite.aggregation, samples)
            examples.append({"id": ids[i], "passed": passed, "score": score, "samples": samples})
            self.metrics.samples(len(samples))
        n = len(examples)
        n_pass = sum(1 for e in examples if e["passed"])
        reasoning = contract.describe(prompts)
        aggregate = {"aggregation": suite.aggregation, "examples": n, "passed": n_pass,
                     "accuracy": n_pass / n if n else 0.0,
                     "mean_score": sum(e["score"] for e in examples) / n if n else 0.0,
                     "wilson_lower_95": gates.wilson_lower(n_pass, n), "generation_s": round(gen_s, 4),
                     "thinking": reasoning["thinking"]}
        provenance = {
            "suite_name": suite.name, "suite_sha256": suite_digest(suite),
            "generation": gen.model_dump(mode="json"), "reasoning": reasoning, "seeds": seeds,
            "base_model_sha256": self.loaded.base_model_sha256, "model_id": self.loaded.model_id,
            "candidate": resolved.identity(self.loaded.base_model_sha256),
            "judges": [{"scorer": i, **judge_res[i].identity(self.loaded.base_model_sha256)} for i, _ in judges],
            "scorers": [sc.model_dump(mode="json") for sc in suite.scorers],
            "runtime": runtime_provenance(self.engine, self.loaded),
        }
        if any(isinstance(sc, s.CodeScorer) for sc in suite.scorers):
            from kiln.evals.sandbox import isolation

            provenance["code_isolation"] = isolation()
        return {"target": resolved.identity(self.loaded.base_model_sha256), "aggregate": aggregate,
                "examples": examples, "provenance": provenance}

    def _expect(self, prov: dict[str, Any], resolved: Resolved, judge_res: dict[int, Resolved]) -> None:
        cand = prov["candidate"]
        if (resolved.adapter, resolved.revision) != (cand["adapter"], cand["revision"]):
            raise Conflict(f"replay loaded {resolved.adapter}@{resolved.revision}, recorded "
                           f"{cand['adapter']}@{cand['revision']}", code="replay_candidate_mismatch")
        for j in prov["judges"]:
            r = judge_res.get(j["scorer"])
            if r is None or (r.adapter, r.revision) != (j["adapter"], j["revision"]):
                raise Conflict("replay loaded a different judge than the recorded one", code="replay_judge_mismatch")
        if prov["base_model_sha256"] != self.loaded.base_model_sha256:
            raise Conflict("the served base model changed since admission", code="replay_base_mismatch")

    def _sandbox(self) -> Any:
        if not self.allow_code:
            return None
        from kiln.evals.sandbox import run_python

        return run_python

    def _contract(self, gen: s.GenerationSettings) -> ChatGeneration:
        """How this suite's prompts are rendered and its answers read (kiln.runtime.chat_generation)."""
        return ChatGeneration.for_engine(self.engine, self.settings.serving, gen.chat_template_kwargs, gen.budget(),
                                         param="generation.thinking_token_budget")

    def _generate(self, cancel_id: str, prompts: list[list[int]], seeds: list[list[int]],
                  gen: s.GenerationSettings, adapter: str | None | list[str | None], *, progress: str | None = None,
                  contract: ChatGeneration | None = None) -> list[list[dict[str, Any]]]:
        """Submit every row (windowed by the engine's queue) and collect the finished texts, each split into its
        answer (``text``) and ``reasoning``; a row's tokens are capped by the context left after its prompt.
        ``adapter``: one engine name for every prompt, or one per prompt (None: the base model)."""
        from kiln.runtime.engine import EngineOverloaded
        from kiln.runtime.sampling import SamplingParams

        adapters = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        window = max(1, self.engine.config.max_queued_rows // 2)
        out: list[list[dict[str, Any]] | None] = [None] * len(prompts)
        pending: list[tuple[int, Any]] = []
        done = 0

        def drain_one() -> None:
            nonlocal done
            idx, sub = pending.pop(0)
            rows = self._collect(cancel_id, sub)
            for row in rows:
                answer = contract.split(row["text"], prompts[idx]) if contract is not None else None
                row["text"], row["reasoning"] = (answer.content, answer.reasoning) if answer else (row["text"], None)
            out[idx] = rows
            done += 1
            if progress is not None and (done % 8 == 0 or done == len(prompts)):
                self.runs.progress(progress, {"generated": done, "examples": len(prompts)})

        try:
            for i, ids in enumerate(prompts):
                self._check_cancel(cancel_id)
                room = max(1, self.engine.config.max_model_len - len(ids))
                params = [SamplingParams(max_tokens=min(gen.max_tokens, room), temperature=gen.temperature,
                                         top_p=gen.top_p, seed=seed, stop=tuple(gen.stop)) for seed in seeds[i]]
                if contract is not None:
                    params = contract.constrain(params, ids)
                while True:
                    in_flight = sum(len(p.streams) for _, p in pending)
                    if in_flight + len(params) > window and pending:
                        drain_one()
                        continue
                    try:
                        pending.append((i, self.engine.submit(ids, params, adapter=adapters[i], incremental=False)))
                        break
                    except EngineOverloaded:
                        if not pending:
                            time.sleep(0.05)
                            continue
                        drain_one()
            while pending:
                drain_one()
        finally:
            for _, sub in pending:
                sub.cancel()
        return [o or [] for o in out]

    def _collect(self, cancel_id: str, sub: Any) -> list[dict[str, Any]]:
        rows = []
        try:
            for stream in sub.streams:
                text: list[str] = []
                n_tokens = 0
                reason = None
                deadline = time.monotonic() + ROW_TIMEOUT_S
                while reason is None:
                    self._check_cancel(cancel_id)
                    chunk = stream.next_chunk_sync(0.5)
                    if chunk is None:
                        if time.monotonic() > deadline:
                            raise Unavailable(f"a generation row did not finish within {ROW_TIMEOUT_S:g} s",
                                              code="eval_generation_timeout")
                        continue
                    text.append(chunk.text)
                    n_tokens += len(chunk.tokens)
                    reason = chunk.finish_reason
                if reason == "error":
                    raise Unavailable("the engine failed while generating an eval row", code="engine_error")
                rows.append({"text": "".join(text), "finish": reason, "tokens": n_tokens})
        finally:
            sub.cancel()
        return rows

    def _judge(self, cancel_id: str, suite: s.SuiteSpec, sc: s.JudgeScorer, completions: list[list[dict[str, Any]]],
               judge: str | None) -> list[list[tuple[bool, str]]]:
        if sc.mode == "preference":  # the answer against the reference, from the judge's A/B logprobs
            from kiln.evals.judge_preference import preference_verdicts

            return preference_verdicts(self.engine, judge, suite, completions, sc.threshold,
                                       check=lambda: self._check_cancel(cancel_id))
        prompts, seeds, shape = [], [], []
        gen = s.GenerationSettings(temperature=0.0, max_tokens=sc.max_tokens)
        contract = self._contract(gen)  # a thinking judge's verdict is read from its answer
        for i, ex in enumerate(suite.examples):
            question = next((m.content for m in reversed(ex.messages) if m.role == "user"), "")
            for comp in completions[i]:
                rubric = judge_prompt(sc, question, ex.reference, comp["text"])
                prompts.append(contract.prompt_ids([{"role": "user", "content": rubric}]))
                seeds.append([0])
            shape.append(len(completions[i]))
        flat = self._generate(cancel_id, prompts, seeds, gen, judge, contract=contract)
        out, pos = [], 0
        for n in shape:
            row = []
            for _ in range(n):
                verdict = judge_verdict(flat[pos][0]["text"])
                row.append((verdict.passed, verdict.detail or ""))
                pos += 1
            out.append(row)
        return out

def _aggregate(aggregation: str, samples: list[dict[str, Any]]) -> tuple[bool, float]:
    """One example's (passed, score) from its k samples."""
    k = len(samples)
    passes = sum(1 for x in samples if x["passed"])
    if aggregation == "pass@k":
        return passes > 0, 1.0 if passes else 0.0
    if aggregation == "majority@k":
        counts = Counter(" ".join(x["completion"].split()).casefold() for x in samples)
        top = max(counts.values())
        winner = next(x for x in samples if counts[" ".join(x["completion"].split()).casefold()] == top)
        return bool(winner["passed"]), 1.0 if winner["passed"] else 0.0
    score = passes / k if k else 0.0
    return score >= 0.5, score
