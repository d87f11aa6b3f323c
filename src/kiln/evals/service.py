"""The eval service: suites, a FIFO worker thread (separate from training), runs, comparisons,
strict replay and the post-train gate.

One evaluation (:meth:`EvalService._evaluate`, :mod:`kiln.evals.evaluation`):

1. **Load.** An adapter target is loaded from the adapter store into the engine under a private
   name ``kiln-eval-<hex>`` through the activation service (:mod:`kiln.adapters.activation`: quarantine,
   memory reservation, canary first), and its
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
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kiln.adapters.activation import AdapterActivation
from kiln.canonical import FileTooLargeError, NotRegularFileError, read_regular_file
from kiln.errors import Conflict, InvalidRequest, KilnError, NotFound, Unavailable
from kiln.evals import gate as gates
from kiln.evals import schemas as s
from kiln.evals.evaluation import Evaluation, Resolved, runtime_provenance
from kiln.evals.scorers import validate_suite
from kiln.evals.store import (
    CANCELLED,
    FAILED,
    QUEUED,
    SUCCEEDED,
    TERMINAL,
    RunStore,
    SuiteStore,
    suite_digest,
)

if TYPE_CHECKING:
    from kiln.adapters.store import AdapterStore
    from kiln.config import Settings
    from kiln.runtime.serving_engine import ServingEngine
    from kiln.runtime.loader import LoadedModel

log = logging.getLogger("kiln.evals")

QUEUE_MAX = 64
WORKER_JOIN_S = 30.0
GATE_TIMEOUT_S = 3_600.0
MAX_JSONL_BYTES = 32 * 1024 * 1024


class RunCancelled(Exception):
    pass


class EvalQueueFull(Unavailable):
    code = "eval_queue_full"
    default_hint = "retry after a queued evaluation has started, or cancel one"


class EvalService(Evaluation):
    """Suites on disk, runs in SQLite, one FIFO worker thread. Built by the app, started in its lifespan."""

    def __init__(self, *, engine: ServingEngine, store: AdapterStore, settings: Settings, model: LoadedModel,
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
        self.memory = None  # memory admission of submissions (set by the composition root)
        # private loads (kiln.adapters.activation); the composition root hands in the server's one service
        self.activation = AdapterActivation(engine, store, model.base_model_sha256)
        self._gating = False
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

        try:  # a NUL byte or a lone surrogate can name no file (os.open would raise ValueError)
            rel.encode("utf-8")
            if "\x00" in rel:
                raise ValueError("NUL byte")
        except ValueError:
            raise InvalidRequest("dataset_path contains a NUL byte or is not valid UTF-8", param="dataset_path",
                                 code="dataset_outside_eval_dir") from None
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
            data = read_regular_file(path, MAX_JSONL_BYTES)
        except FileNotFoundError:
            raise NotFound(f"no dataset {rel!r} in eval_dir/datasets", code="dataset_not_found") from None
        except NotRegularFileError:
            raise InvalidRequest(f"dataset_path {rel!r} is not a regular file", code="dataset_not_file") from None
        except FileTooLargeError:
            raise InvalidRequest(f"{rel} is larger than {MAX_JSONL_BYTES} bytes", code="dataset_too_large") from None
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
        self._check_target(s.Target(adapter=candidate.adapter, revision=candidate.revision), gate=True)
        self._check_target(post_eval.baseline, gate=True)
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

    def _check_target(self, target: s.Target, *, gate: bool = False) -> None:
        """The target resolves, and its private load fits the memory budget (a post-train ``gate`` runs while its
        job holds a training reservation, which is not counted against it)."""
        if target.adapter is None:
            return
        resolved = self._resolve(target)
        if self.memory is not None:  # 507 when its private load can never fit, 409 while reservations are in the way
            from kiln.adapters.footprint import adapter_parts

            assert resolved.path is not None and resolved.revision is not None
            self.memory.check("adapter", "eval-submission", adapter_parts(resolved.path),
                              what=f"evaluating adapter {resolved.adapter!r} revision {resolved.revision[:12]}",
                              ignore_kinds=frozenset({"training"}) if gate else frozenset())

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
        from kiln.adapters.scope import scope_index

        return Resolved(record.name, record.revision, Path(record.path), scope_index(record.manifest.config))

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
        self._gating = kind == "gate"  # one worker thread: the run it executes now
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
