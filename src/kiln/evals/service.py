"""The eval service: suites, a FIFO worker thread (separate from training), runs, comparisons,
strict replay and the post-train gate.

One evaluation (:meth:`EvalService._evaluate`):

1. **Load.** An adapter target is loaded from the adapter store into the engine under a private
   name ``kiln-eval-<hex>`` through the engine's own activation boundary (canary first), and its
   revision and base model are checked against the store before any row is generated. The base
   model needs no loading.
2. **Generate.** Every ``(example, sample)`` row is submitted to the engine at once (a window of
   at most half of ``batching.max_queued_rows`` rows in flight) and continuous batching runs them
   side by side with live traffic. Sample ``j`` of example ``i`` uses seed ``seed + i * k + j``.
3. **Judge.** Judge scorers submit one greedy row per sample to the judge (base or adapter,
   loaded the same way) and parse ``PASS``/``FAIL``.
4. **Score and aggregate** on the worker thread (CPU only, no accelerator ownership).
5. **Unload** the private adapters, whatever happened.

Every run records its provenance (suite digest, generation settings, seeds, base model and adapter
identities, scorer configuration, runtime versions and the raw completions) so it can be replayed.
"""

from __future__ import annotations

import logging
import platform
import queue
import secrets
import threading
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from kiln.errors import Conflict, InvalidRequest, KilnError, NotFound, Unavailable
from kiln.evals import gate as gates
from kiln.evals import schemas as s
from kiln.evals.scorers import Scorers, judge_prompt, judge_verdict, validate_suite
from kiln.evals.store import (
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    TERMINAL,
    RunStore,
    SuiteStore,
    suite_digest,
)

if TYPE_CHECKING:
    from kiln.adapters.store import AdapterStore
    from kiln.config import Settings
    from kiln.runtime.engine import Engine
    from kiln.runtime.loader import LoadedModel

log = logging.getLogger("kiln.evals")

QUEUE_MAX = 64
WORKER_JOIN_S = 30.0
ROW_TIMEOUT_S = 600.0  # one generated row; an engine that stalls longer fails the run
GATE_TIMEOUT_S = 3_600.0
MAX_JSONL_BYTES = 32 * 1024 * 1024
PRIVATE_PREFIX = "kiln-eval-"


class RunCancelled(Exception):
    pass


class EvalQueueFull(Unavailable):
    code = "eval_queue_full"
    default_hint = "retry after a queued evaluation has started, or cancel one"


@dataclass(frozen=True)
class Resolved:
    """A target made concrete: the adapter revision (None: the base model) and its files."""

    adapter: str | None
    revision: str | None
    path: Path | None

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


class EvalService:
    """Suites on disk, runs in SQLite, one FIFO worker thread. Built by the app, started in its lifespan."""

    def __init__(self, *, engine: Engine, store: AdapterStore, settings: Settings, model: LoadedModel,
                 registry: Any = None):
        from kiln.evals.metrics import EvalMetrics

        self.engine = engine
        self.adapters = store
        self.settings = settings
        self.loaded = model
        self.allow_code = bool(settings.eval.allow_code_execution)
        root = settings.eval_path
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root = root
        self.suites = SuiteStore(root / "suites")
        self.runs = RunStore(root / "runs.sqlite3")
        self.metrics = EvalMetrics(registry)
        self._queue: queue.Queue[str] = queue.Queue()
        self._stop = threading.Event()
        self._cancel: set[str] = set()
        self._cancel_lock = threading.Lock()
        self._running: str | None = None
        self._done: dict[str, threading.Event] = {}
        self._thread = threading.Thread(target=self._worker, name="kiln-evals", daemon=True)
        if self.runs.recovered:
            log.warning("failed %d eval run(s) interrupted by the previous shutdown", len(self.runs.recovered))

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with self._cancel_lock:
            if self._running:
                self._cancel.add(self._running)
        self._queue.put("")
        if self._thread.is_alive():
            self._thread.join(WORKER_JOIN_S)
        for ev in list(self._done.values()):
            ev.set()
        self.runs.close()

    # --------------------------------------------------------------- suites
    def put_suite(self, suite: s.SuiteSpec, *, replace: bool = False) -> dict[str, Any]:
        validate_suite(suite, allow_code_execution=self.allow_code)
        return self.suites.put(suite, replace=replace)

    def import_jsonl(self, *, name: str, jsonl: str | None, dataset_path: str | None, scorers: list[Any],
                     generation: dict[str, Any] | None, aggregation: str, description: str = "",
                     replace: bool = False) -> dict[str, Any]:
        """Build a suite from JSONL rows ``{"messages": [...], "reference": "...", "id": ...}``."""
        from kiln.canonical import strict_json_loads

        if (jsonl is None) == (dataset_path is None):
            raise InvalidRequest("give exactly one of `jsonl` (text) or `dataset_path` (in eval_dir/datasets)",
                                 code="invalid_import")
        text = jsonl if jsonl is not None else self._read_dataset(dataset_path or "")
        if len(text.encode("utf-8")) > MAX_JSONL_BYTES:
            raise InvalidRequest(f"the JSONL is larger than {MAX_JSONL_BYTES} bytes", code="dataset_too_large")
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            if len(rows) >= s.MAX_EXAMPLES:
                raise InvalidRequest(f"more than {s.MAX_EXAMPLES} examples", code="too_many_examples")
            try:
                rows.append(strict_json_loads(line))
            except ValueError as exc:
                raise InvalidRequest(f"line {lineno} is not JSON: {exc}", code="invalid_jsonl") from None
        try:
            suite = s.SuiteSpec.model_validate({"name": name, "description": description, "examples": rows,
                                                "scorers": scorers, "generation": generation or {},
                                                "aggregation": aggregation})
        except ValueError as exc:
            raise InvalidRequest(f"the imported suite is invalid: {exc}", code="invalid_suite") from None
        return self.put_suite(suite, replace=replace)

    def _read_dataset(self, rel: str) -> str:
        import os

        base = (self.root / "datasets").resolve()
        path = (base / rel)
        if os.path.isabs(rel) or ".." in Path(rel).parts or not str(path.resolve()).startswith(str(base) + os.sep):
            raise InvalidRequest("dataset_path must be a relative path inside eval_dir/datasets",
                                 code="dataset_outside_eval_dir")
        cur = base
        for part in Path(rel).parts:
            cur = cur / part
            if cur.is_symlink():
                raise InvalidRequest("dataset_path must not traverse symlinks", code="dataset_outside_eval_dir")
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise NotFound(f"no dataset {rel!r} in eval_dir/datasets", code="dataset_not_found") from None
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_JSONL_BYTES + 1)
        if len(data) > MAX_JSONL_BYTES:
            raise InvalidRequest(f"{rel} is larger than {MAX_JSONL_BYTES} bytes", code="dataset_too_large")
        return data.decode("utf-8")

    def _suite_of(self, name: str | None, inline: s.SuiteSpec | None) -> s.SuiteSpec:
        suite = inline if inline is not None else self.suites.get(name or "")
        validate_suite(suite, allow_code_execution=self.allow_code)
        return suite

    # ----------------------------------------------------------- admission
    def _admit(self, kind: str, request: dict[str, Any]) -> dict[str, Any]:
        pending = sum(1 for r in self.runs.list() if r.state == QUEUED)
        if pending >= QUEUE_MAX:
            raise EvalQueueFull(f"{pending} evaluations are queued (limit {QUEUE_MAX})")
        run = self.runs.create(kind, request)
        self._done[run.id] = threading.Event()
        self._queue.put(run.id)
        self.metrics.queued(kind)
        return run.public(full=False)

    def submit_run(self, req: s.RunRequest) -> dict[str, Any]:
        suite = self._suite_of(req.suite, req.inline_suite)
        self._check_target(req.target)
        return self._admit("run", {"suite_name": suite.name, "suite": suite.model_dump(mode="json"),
                                   "target": req.target.model_dump(mode="json")})

    def submit_comparison(self, req: s.CompareRequest) -> dict[str, Any]:
        suite = self._suite_of(req.suite, req.inline_suite)
        for t in req.targets:
            self._check_target(t)
        return self._admit("comparison", {"suite_name": suite.name, "suite": suite.model_dump(mode="json"),
                                          "targets": [t.model_dump(mode="json") for t in req.targets]})

    def submit_gate(self, candidate: s.AdapterRef, post_eval: s.PostEval) -> dict[str, Any]:
        suite = self._suite_of(post_eval.suite, None)
        self._check_target(s.Target(adapter=candidate.adapter, revision=candidate.revision))
        self._check_target(post_eval.baseline)
        return self._admit("gate", {"suite_name": suite.name, "suite": suite.model_dump(mode="json"),
                                    "candidate": candidate.model_dump(mode="json"),
                                    "post_eval": post_eval.model_dump(mode="json")})

    def submit_replay(self, req: s.ReplayRequest) -> dict[str, Any]:
        """Admission re-checks the recorded environment; a difference ends the replay as ``mismatch`` at once."""
        original = self.runs.get(req.run_id)
        if original.kind != "run" or original.state != SUCCEEDED or not original.result:
            raise Conflict(f"run {req.run_id} is a {original.state} {original.kind}; only succeeded runs replay",
                           code="not_replayable")
        prov = original.result["provenance"]
        differences = self._environment_differences(prov)
        request = {"replay_of": req.run_id, "suite_name": original.request.get("suite_name"),
                   "suite": original.request["suite"], "provenance": prov}
        if differences:
            result = {"replay": {"verdict": "mismatch", "stage": "admission", "differences": differences}}
            run = self.runs.create("replay", request, state=SUCCEEDED, result=result)
            self.metrics.finished("replay", SUCCEEDED, 0.0)
            return run.public(full=False)
        return self._admit("replay", request)

    def _environment_differences(self, prov: dict[str, Any]) -> list[dict[str, Any]]:
        diffs = []
        if prov["base_model_sha256"] != self.loaded.base_model_sha256:
            diffs.append({"field": "base_model_sha256", "recorded": prov["base_model_sha256"],
                          "now": self.loaded.base_model_sha256})
        now = runtime_provenance(self.engine, self.loaded)
        for key, recorded in sorted(prov["runtime"].items()):
            if now.get(key) != recorded:
                diffs.append({"field": f"runtime.{key}", "recorded": recorded, "now": now.get(key)})
        idents = [("candidate", prov.get("candidate"))] + [("judge", j) for j in prov.get("judges", [])]
        for role, ident in idents:
            if ident and ident.get("adapter"):
                try:
                    self.adapters.get(ident["adapter"], ident["revision"])
                except KilnError as exc:
                    diffs.append({"field": f"{role}.revision", "recorded": ident["revision"], "now": exc.message})
        return diffs

    def _check_target(self, target: s.Target) -> None:
        if target.adapter is not None:
            self._resolve(target)

    def _resolve(self, target: s.Target | s.AdapterRef | None, *, avoid: str | None = None) -> Resolved:
        """Pin a target to a revision: the given one, else the served one, else the store's HEAD."""
        from kiln.adapters.errors import AdapterNotFound

        if target is None or target.adapter is None:
            return Resolved(None, None, None)
        revision = target.revision or self.engine.active_adapters().get(target.adapter)
        try:
            record = self.adapters.get(target.adapter, revision)
        except AdapterNotFound as exc:
            raise NotFound(str(exc), code="adapter_not_found", hint="list adapters with GET /v1/adapters") from None
        if record.manifest.base_model_sha256 != self.loaded.base_model_sha256:
            raise Conflict(f"adapter {target.adapter!r} was trained on another base model", code="adapter_base_mismatch")
        if avoid is not None and record.revision == avoid:
            raise Conflict(f"baseline {target.adapter!r} resolves to the candidate revision {avoid[:12]}",
                           code="baseline_is_candidate", hint="give the baseline's revision explicitly")
        return Resolved(record.name, record.revision, Path(record.path))

    # -------------------------------------------------------------- queries
    def get(self, run_id: str) -> dict[str, Any]:
        return self.runs.get(run_id).public()

    def list(self) -> list[dict[str, Any]]:
        return [r.public(full=False) for r in self.runs.list()]

    def cancel(self, run_id: str) -> dict[str, Any]:
        run = self.runs.get(run_id)
        if run.state == QUEUED:
            run = self.runs.cancel_queued(run_id)
            self._signal(run_id)
            return run.public(full=False)
        if run.state in TERMINAL:
            raise Conflict(f"run {run_id} is already {run.state}", code="eval_run_finished")
        with self._cancel_lock:
            self._cancel.add(run_id)
        return run.public(full=False)

    def wait(self, run_id: str, timeout: float = GATE_TIMEOUT_S) -> dict[str, Any]:
        ev = self._done.get(run_id)
        if ev is not None:
            ev.wait(timeout)
        return self.runs.get(run_id).public()

    def _signal(self, run_id: str) -> None:
        ev = self._done.pop(run_id, None)
        if ev is not None:
            ev.set()

    # ---------------------------------------------------------- post-train
    def post_train_gate(self, candidate: s.AdapterRef, post_eval: s.PostEval,
                        on_runs: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run the gate (candidate and baseline evaluations on the worker) and wait for the verdict.

        Never raises for evaluation failures: they become the ``error`` verdict. ``on_runs`` is
        called with the gate run's ID as soon as it is queued (the caller records it on its job).
        """
        try:
            gate_run = self.submit_gate(candidate, post_eval)
        except KilnError as exc:
            return {"gate_run": None, "candidate_run": None, "baseline_run": None,
                    **gates.paired_wilson_v1([], min_accuracy=post_eval.min_accuracy, min_pairs=post_eval.min_pairs,
                                             error=f"{exc.code}: {exc.message}").as_dict()}
        if on_runs is not None:
            on_runs({"gate_run": gate_run["id"]})
        try:
            run = self.wait(gate_run["id"])
        except Exception as exc:  # noqa: BLE001 - e.g. the service closed under a waiting job
            run = {"id": gate_run["id"], "state": FAILED, "error": f"the gate was interrupted: {exc}"}
        result = run.get("result") or {}
        if run["state"] != SUCCEEDED or "gate" not in result:
            verdict = gates.paired_wilson_v1([], min_accuracy=post_eval.min_accuracy, min_pairs=post_eval.min_pairs,
                                             error=run.get("error") or f"gate run {run['state']}").as_dict()
            return {"gate_run": run["id"], "candidate_run": result.get("candidate_run"),
                    "baseline_run": result.get("baseline_run"), **verdict}
        return {"gate_run": run["id"], "candidate_run": result["candidate_run"],
                "baseline_run": result["baseline_run"], **result["gate"]}

    # --------------------------------------------------------------- worker
    def _worker(self) -> None:
        from kiln.runtime.threads import pin_torch_threads

        pin_torch_threads()  # before any wide engine cycle can set the process-wide count
        while not self._stop.is_set():
            run_id = self._queue.get()
            if not run_id or self._stop.is_set():
                continue
            if not self.runs.claim(run_id):
                self._signal(run_id)
                continue  # cancelled while queued
            run = self.runs.get(run_id)
            self._running = run_id
            t0 = time.perf_counter()
            state = FAILED
            try:
                result = self._execute(run.id, run.kind, run.request)
            except RunCancelled:
                self.runs.finish(run_id, CANCELLED, error="cancelled" if not self._stop.is_set()
                                 else "interrupted: the server shut down")
                state = CANCELLED
            except Exception as exc:  # noqa: BLE001 - the run records any failure
                if not isinstance(exc, KilnError):
                    log.exception("eval run %s failed", run_id)
                msg = exc.one_line() if isinstance(exc, KilnError) else f"{type(exc).__name__}: {exc}"
                result = None
                if run.kind == "replay":
                    result = {"replay": {"verdict": "error", "stage": "execution", "error": msg}}
                self.runs.finish(run_id, FAILED, result=result, error=msg)
            else:
                self.runs.finish(run_id, SUCCEEDED, result=result)
                state = SUCCEEDED
                if run.kind == "gate":
                    self.metrics.verdict(result["gate"]["verdict"])
            finally:
                self._running = None
                with self._cancel_lock:
                    self._cancel.discard(run_id)
                self.metrics.finished(run.kind, state, time.perf_counter() - t0)
                self._signal(run_id)

    def _check_cancel(self, run_id: str) -> None:
        with self._cancel_lock:
            if run_id in self._cancel:
                raise RunCancelled()

    def _execute(self, run_id: str, kind: str, request: dict[str, Any]) -> dict[str, Any]:
        suite = s.SuiteSpec.model_validate(request["suite"])
        if kind == "run":
            return self._evaluate(run_id, suite, s.Target.model_validate(request["target"]))
        if kind == "comparison":
            return self._compare(run_id, suite, [s.Target.model_validate(t) for t in request["targets"]])
        if kind == "gate":
            return self._gate(run_id, suite, s.AdapterRef.model_validate(request["candidate"]),
                              s.PostEval.model_validate(request["post_eval"]))
        if kind == "replay":
            return self._replay(run_id, suite, request)
        raise InvalidRequest(f"unknown run kind {kind!r}")

    def _child(self, parent: str, suite: s.SuiteSpec, target: s.Target, *, role: str,
               resolved: Resolved | None = None) -> dict[str, Any]:
        """Run one evaluation as its own recorded run (a child of a comparison or gate)."""
        child = self.runs.create("run", {"suite_name": suite.name, "suite": suite.model_dump(mode="json"),
                                         "target": target.model_dump(mode="json"), "parent": parent, "role": role})
        self.runs.claim(child.id)
        t0 = time.perf_counter()
        try:
            result = self._evaluate(child.id, suite, target, resolved=resolved, cancel_id=parent)
        except RunCancelled:
            self.runs.finish(child.id, CANCELLED, error="cancelled with its parent")
            self.metrics.finished("run", CANCELLED, time.perf_counter() - t0)
            raise
        except Exception as exc:
            msg = exc.one_line() if isinstance(exc, KilnError) else f"{type(exc).__name__}: {exc}"
            self.runs.finish(child.id, FAILED, error=msg)
            self.metrics.finished("run", FAILED, time.perf_counter() - t0)
            raise
        self.runs.finish(child.id, SUCCEEDED, result=result)
        self.metrics.finished("run", SUCCEEDED, time.perf_counter() - t0)
        return {"id": child.id, **result}

    def _compare(self, run_id: str, suite: s.SuiteSpec, targets: list[s.Target]) -> dict[str, Any]:
        children = []
        for i, t in enumerate(targets):
            children.append(self._child(run_id, suite, t, role=f"target-{i}"))
            self.runs.progress(run_id, {"targets_done": i + 1, "targets": len(targets)})
        ids = suite.example_ids()
        table = [{"example": ex_id, "passed": [c["examples"][j]["passed"] for c in children]}
                 for j, ex_id in enumerate(ids)]
        reference = children[0]
        pairwise = []
        for c in children[1:]:
            pairs = [(c["examples"][j]["passed"], reference["examples"][j]["passed"]) for j in range(len(ids))]
            v = gates.paired_wilson_v1(pairs, min_accuracy=0.0, min_pairs=1)
            assert v.numbers is not None
            pairwise.append({"target": c["target"], "against": reference["target"], "run": c["id"],
                             "numbers": v.as_dict()["numbers"]})
        return {"runs": [c["id"] for c in children],
                "aggregates": [{"target": c["target"], "run": c["id"], **c["aggregate"]} for c in children],
                "pairing": table, "pairwise_vs_first": pairwise}

    def _gate(self, run_id: str, suite: s.SuiteSpec, candidate: s.AdapterRef, pe: s.PostEval) -> dict[str, Any]:
        cand_res = self._resolve(candidate)
        base_res = self._resolve(pe.baseline, avoid=cand_res.revision)
        cand = self._child(run_id, suite, s.Target(adapter=candidate.adapter, revision=cand_res.revision),
                           role="candidate", resolved=cand_res)
        self.runs.progress(run_id, {"candidate_run": cand["id"]})
        base = self._child(run_id, suite, s.Target(adapter=base_res.adapter, revision=base_res.revision),
                           role="baseline", resolved=base_res)
        self.runs.progress(run_id, {"candidate_run": cand["id"], "baseline_run": base["id"]})
        pairs = [(c["passed"], b["passed"]) for c, b in zip(cand["examples"], base["examples"])]
        verdict = gates.paired_wilson_v1(pairs, min_accuracy=pe.min_accuracy, min_pairs=pe.min_pairs)
        return {"candidate_run": cand["id"], "baseline_run": base["id"], "candidate": cand["target"],
                "baseline": base["target"], "gate": verdict.as_dict()}

    def _replay(self, run_id: str, suite: s.SuiteSpec, request: dict[str, Any]) -> dict[str, Any]:
        prov = request["provenance"]
        original = self.runs.get(request["replay_of"]).result or {}
        if suite_digest(suite) != prov["suite_sha256"]:
            return {"replay": {"verdict": "mismatch", "stage": "admission",
                               "differences": [{"field": "suite_sha256"}]}}
        cand = prov["candidate"]
        target = s.Target(adapter=cand["adapter"], revision=cand["revision"])
        result = self._evaluate(run_id, suite, target, expect=prov)
        diffs = []
        for j, (old, new) in enumerate(zip(original["examples"], result["examples"])):
            old_raw = [x["completion"] for x in old["samples"]]
            new_raw = [x["completion"] for x in new["samples"]]
            if old_raw != new_raw or old["passed"] != new["passed"]:
                diffs.append({"example": old["id"], "recorded": old_raw, "now": new_raw,
                              "recorded_passed": old["passed"], "now_passed": new["passed"]})
        verdict = "matched" if not diffs else "mismatch"
        return {**result, "replay": {"verdict": verdict, "stage": "execution", "replay_of": request["replay_of"],
                                     "differences": diffs[:50], "different_examples": len(diffs)}}

    # --------------------------------------------------------- evaluation
    @contextmanager
    def _loaded(self, resolved: Resolved) -> Iterator[str | None]:
        """The engine name to generate with: ``None`` for the base, else a private load of the revision."""
        if resolved.adapter is None:
            yield None
            return
        name = f"{PRIVATE_PREFIX}{secrets.token_hex(6)}"
        assert resolved.path is not None and resolved.revision is not None
        self.engine.activate_adapter(name, resolved.path, resolved.revision)
        try:
            yield name
        finally:
            try:
                self.engine.deactivate_adapter(name)
            except KilnError:
                log.warning("private eval adapter %s was already gone", name)

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
            prompts = [self.engine.encode_chat([m.model_dump() for m in ex.messages]) for ex in suite.examples]
            completions = self._generate(cancel_id, prompts, seeds, gen, name, progress=run_id)
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
                samples.append({"seed": seeds[i][j], "completion": comp["text"], "finish_reason": comp["finish"],
                                "tokens": comp["tokens"], "passed": all(p["passed"] for p in per), "scores": per})
            passed, score = _aggregate(suite.aggregation, samples)
            examples.append({"id": ids[i], "passed": passed, "score": score, "samples": samples})
            self.metrics.samples(len(samples))
        n = len(examples)
        n_pass = sum(1 for e in examples if e["passed"])
        aggregate = {"aggregation": suite.aggregation, "examples": n, "passed": n_pass,
                     "accuracy": n_pass / n if n else 0.0,
                     "mean_score": sum(e["score"] for e in examples) / n if n else 0.0,
                     "wilson_lower_95": gates.wilson_lower(n_pass, n), "generation_s": round(gen_s, 4)}
        provenance = {
            "suite_name": suite.name, "suite_sha256": suite_digest(suite),
            "generation": gen.model_dump(mode="json"), "seeds": seeds,
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

    def _generate(self, cancel_id: str, prompts: list[list[int]], seeds: list[list[int]],
                  gen: s.GenerationSettings, adapter: str | None, *, progress: str | None = None,
                  ) -> list[list[dict[str, Any]]]:
        """Submit every row (windowed by the engine's queue) and collect the finished texts."""
        from kiln.runtime.engine import EngineOverloaded
        from kiln.runtime.sampling import SamplingParams

        window = max(1, self.engine.config.max_queued_rows // 2)
        out: list[list[dict[str, Any]] | None] = [None] * len(prompts)
        pending: list[tuple[int, Any]] = []
        done = 0

        def drain_one() -> None:
            nonlocal done
            idx, sub = pending.pop(0)
            out[idx] = self._collect(cancel_id, sub)
            done += 1
            if progress is not None and (done % 8 == 0 or done == len(prompts)):
                self.runs.progress(progress, {"generated": done, "examples": len(prompts)})

        try:
            for i, ids in enumerate(prompts):
                self._check_cancel(cancel_id)
                params = [SamplingParams(max_tokens=gen.max_tokens, temperature=gen.temperature, top_p=gen.top_p,
                                         seed=seed, stop=tuple(gen.stop)) for seed in seeds[i]]
                while True:
                    in_flight = sum(len(p.streams) for _, p in pending)
                    if in_flight + len(params) > window and pending:
                        drain_one()
                        continue
                    try:
                        pending.append((i, self.engine.submit(ids, params, adapter=adapter, incremental=False)))
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
            from kiln.judgments.scoring import preference_verdicts

            return preference_verdicts(self.engine, judge, suite, completions, sc.threshold,
                                       check=lambda: self._check_cancel(cancel_id))
        prompts, seeds, shape = [], [], []
        for i, ex in enumerate(suite.examples):
            question = next((m.content for m in reversed(ex.messages) if m.role == "user"), "")
            for comp in completions[i]:
                rubric = judge_prompt(sc, question, ex.reference, comp["text"])
                prompts.append(self.engine.encode_chat([{"role": "user", "content": rubric}]))
                seeds.append([0])
            shape.append(len(completions[i]))
        gen = s.GenerationSettings(temperature=0.0, max_tokens=sc.max_tokens)
        flat = self._generate(cancel_id, prompts, seeds, gen, judge)
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
