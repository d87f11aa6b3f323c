"""Server-owned OpenEnv runs: preflight, FIFO admission, collection, revalidation, GRPO handoff.

A run's life: ``submit`` materialises the exact GRPO config (``TrainingService.prepare`` on
the request's training fields and a placeholder group) before anything is persisted, so a
typo spends no episode; admitted runs wait in strict FIFO order for one of
``[openenv] max_active_runs`` workers. A worker discovers the environment, collects
``groups`` x ``group_size`` episodes (one reset seed per group, identical initial messages),
re-discovers and compares the identity digest, then submits the completed groups through
``TrainingService.submit(GRPORequest)`` and follows the job. ``run.json`` under
``<adapters>/.openenv/runs/<id>/`` is rewritten atomically at every transition.

Restart rules: a run persisted as ``queued`` never acquired a slot and is queued again in
its admission order; a run that was past admission becomes ``failed`` with
``interrupted`` (a stateful external episode cannot be resumed safely).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import stat
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pydantic import ValidationError

from kiln.canonical import (
    NotRegularFileError,
    atomic_write_bytes,
    atomic_write_json,
    canonical_json,
    canonical_json_bytes,
    domain_digest,
    open_regular,
    read_regular_file,
    sha256_hex,
    strict_json_loads,
)
from kiln.errors import (
    Conflict,
    InvalidRequest,
    KilnError,
    NotFound,
    RateLimited,
    Unavailable,
)
from kiln.openenv import episode as ep
from kiln.openenv.actions import ACTION_PROMPT, ActionGenerator
from kiln.openenv.discovery import Discovery, discover
from kiln.openenv.metrics import OpenEnvMetrics
from kiln.openenv.policy import PolicyPin
from kiln.openenv.schemas import RUN_ID_RE, TERMINAL, OpenEnvRunRequest
from kiln.runtime.chat_generation import Answer

if TYPE_CHECKING:
    from kiln.config import Settings
    from kiln.runtime.serving_engine import ServingEngine
    from kiln.training.queue.service import TrainingService

log = logging.getLogger("kiln.openenv")

RUNS_DIR = Path(".openenv") / "runs"
RUN_FILE = "run.json"
MAX_RUN_FILE_BYTES = 4 * 1024 * 1024
JOB_POLL_S = 0.25
CLOSE_JOIN_S = 30.0  # shutdown waits this long for a worker to leave its current exchange or generation
JOB_TERMINAL = ("succeeded", "failed", "cancelled")
PREFLIGHT_GROUP = {"messages": [{"role": "user", "content": "preflight"}],
                   "completions": [{"text": "a", "reward": 0.0}, {"text": "b", "reward": 1.0}]}
CONTRACT_DROPPED = ("groups", "inputs_sha256", "plan_sha256")
REPLAY_SCHEMA = "kiln.openenv-replay.v2"  # v2: the run's policy and each action's policy revision
RECEIPT_FILE = "train_receipt.json"
RECEIPT_SCHEMA = "kiln.openenv-train-receipt.v1"
CONTRACT_DOMAIN = "kiln.openenv-training-contract.v1"


class ArtifactIntegrityError(Conflict):
    code = "artifact_integrity_failed"
    default_hint = "the file changed on disk after publication; nothing was sent"


class EnvironmentIdentityChanged(Conflict):
    code = "environment_identity_changed"
    default_hint = "the environment was redeployed during the run; nothing was published, start a new run"


class OpenEnvService:
    """Runs under ``<adapters>/.openenv/runs``; ``start()`` starts the workers, ``close()`` stops them."""

    def __init__(self, *, engine: ServingEngine, trainer: TrainingService | None, settings: Settings, registry: Any = None):
        self.engine, self.trainer, self.settings = engine, trainer, settings
        self.metrics = OpenEnvMetrics(registry)
        self.cfg = settings.openenv
        self.root = settings.adapters_path / RUNS_DIR
        self._lock = threading.Condition()
        self._runs: dict[str, dict[str, Any]] = {}
        self._requests: dict[str, OpenEnvRunRequest] = {}
        self._queue: deque[str] = deque()
        self._cancel: dict[str, threading.Event] = {}
        self._seq = 0
        self._stop = False
        self._actions = ActionGenerator(engine, settings.serving, self.cfg)  # the policy's actions
        self._threads = [threading.Thread(target=self._worker, name=f"kiln-openenv-{i}", daemon=True)
                         for i in range(self.cfg.max_active_runs)]
        self._recover()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for t in self._threads:
            t.start()

    def close(self, join_s: float = CLOSE_JOIN_S) -> list[str]:
        """Stop the workers: a run in flight stops at its next episode, step or job poll and is recorded
        ``failed``/``interrupted`` (never ``cancelled``: nobody cancelled it); queued runs stay queued on
        disk for the next start. Joins every worker; returns the names of any still alive after
        ``join_s`` (logged)."""
        with self._lock:
            self._stop = True
            for run_id, event in self._cancel.items():
                if run_id not in self._queue:
                    event.set()
            self._lock.notify_all()
        deadline = time.monotonic() + join_s
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning("OpenEnv workers still running after %.0f s: %s", join_s, alive)
        return alive

    def _recover(self) -> None:
        if not self.root.is_dir():
            return
        queued = []
        for d in sorted(self.root.iterdir()):
            path = d / RUN_FILE
            if not RUN_ID_RE.match(d.name) or not path.is_file():
                continue
            try:
                rec = strict_json_loads(read_regular_file(path, MAX_RUN_FILE_BYTES))
                req = OpenEnvRunRequest.model_validate(rec["request"])
            except (OSError, ValueError, KeyError, ValidationError):  # OSError: not a regular file, too large
                log.warning("skipping unreadable OpenEnv run %s", path)
                continue
            self._runs[rec["id"]] = rec
            self._requests[rec["id"]] = req
            self._seq = max(self._seq, int(rec.get("admission_seq", 0)))
            if rec["state"] == "queued":
                queued.append(rec)
            elif rec["state"] not in TERMINAL:
                self._finish(rec, "failed", error=("interrupted", ("the server stopped while this run was "
                                                   f"{rec['state']}; episodes are not resumed")))
        for rec in sorted(queued, key=lambda r: r["admission_seq"]):
            self._cancel[rec["id"]] = threading.Event()
            self._queue.append(rec["id"])

    # ----------------------------------------------------------- submission
    def preflight(self, request: OpenEnvRunRequest) -> dict[str, Any]:
        """The effective GRPO config the run will train with (no groups); raises on any invalid field."""
        from kiln.training.schemas import GRPORequest

        if self.trainer is None:
            raise Unavailable("training is not enabled on this server", code="training_disabled",
                              hint="start the server with training.enabled = true")
        try:  # one placeholder per group the run will collect: a default `epochs` is materialised for that count
            grpo = GRPORequest.model_validate({**request.training, "groups": [PREFLIGHT_GROUP] * request.groups})
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise InvalidRequest(f"training.{loc}: {first['msg']}", code="invalid_training_config",
                                 param=f"training.{loc}", hint="training takes the fields of POST /v1/train/grpo "
                                 "except groups") from None
        if request.policy_adapter is not None and request.policy_adapter not in self.engine.active_adapters():
            raise NotFound(f"policy_adapter {request.policy_adapter!r} is not loaded", code="adapter_not_loaded",
                           param="policy_adapter", hint="load it with POST /v1/adapters/{name}/load (or train with auto_load)")
        return _contract(self.trainer.prepare(grpo))

    def inspect(self, request: OpenEnvRunRequest) -> dict[str, Any]:
        """``POST /v1/openenv/preflight``: the effective GRPO config and the environment's identity and action
        schema (discovery GETs only: no episode, nothing persisted, no capacity reserved)."""
        contract = self.preflight(request)
        disc = self._discover(request.env_url)
        with self._lock:
            active = sum(1 for r in self._runs.values() if r["state"] not in TERMINAL and r["state"] != "queued")
            queued = len(self._queue)
        return {"object": "openenv.preflight", "training_contract": contract,
                "training_contract_sha256": contract_digest(contract),
                "environment": {"url": disc.base_url, "name": disc.name, "discovery_sha256": disc.digest,
                                "documents": sorted(disc.documents), "action_schema": disc.action_schema},
                "capacity": {"active_runs": active, "queued_runs": queued,
                             "max_active_runs": self.cfg.max_active_runs,
                             "max_tracked_runs": self.cfg.max_tracked_runs, "capacity_reserved": False}}

    def _same_key(self, request: OpenEnvRunRequest) -> dict[str, Any] | None:
        """The retained run submitted under ``request.idempotency_key``: its status, or 409 if the request differs."""
        if request.idempotency_key is None:
            return None
        wanted = request.model_dump(mode="json")
        for rec in self._runs.values():
            if rec["request"].get("idempotency_key") == request.idempotency_key:
                if rec["request"] != wanted:
                    raise Conflict(f"idempotency_key {request.idempotency_key!r} was used by run {rec['id']} "
                                   "with a different request", code="idempotency_key_reused",
                                   param="idempotency_key", hint="use a new key for a different request")
                return self._public(rec)
        return None

    def submit(self, request: OpenEnvRunRequest) -> dict[str, Any]:
        with self._lock:
            original = self._same_key(request)
        if original is not None:
            return original
        contract = self.preflight(request)  # before any persistence or environment contact
        with self._lock:
            original = self._same_key(request)  # a concurrent retry may have been admitted meanwhile
            if original is not None:
                return original
            tracked = sum(1 for r in self._runs.values() if r["state"] not in TERMINAL)
            if tracked >= self.cfg.max_tracked_runs:
                raise RateLimited(f"{tracked} OpenEnv runs are queued or running ([openenv] max_tracked_runs)",
                                  code="openenv_queue_full", hint="wait for a run to finish or cancel one",
                                  retry_after=5)
            self._seq += 1
            run_id = f"oerun-{secrets.token_hex(8)}"
            rec: dict[str, Any] = {
                "id": run_id, "object": "openenv.run", "state": "queued", "admission_seq": self._seq,
                "created_at": time.time(), "started_at": None, "finished_at": None,
                "request": request.model_dump(mode="json"), "training_contract": contract,
                "environment": None, "progress": {"groups_done": 0, "episodes_done": 0, "env_steps": 0,
                                                  "policy_actions": 0, "capacity_retries": 0,
                                                  "rollout_bytes": 0},
                "returns": None, "terminations": {k: 0 for k in ep.TERMINATIONS}, "artifacts": None,
                "training_job": None,
                "error": None,
            }
            self._persist(rec)
            self._runs[run_id] = rec
            self._requests[run_id] = request
            self._cancel[run_id] = threading.Event()
            self._queue.append(run_id)
            self._lock.notify_all()
            self.metrics.runs_submitted.inc()
            return self._public(rec)

    def get(self, run_id: str) -> dict[str, Any]:
        with self._lock:
            return self._public(self._record(run_id))

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._public(r) for r in sorted(self._runs.values(), key=lambda r: r["admission_seq"])]

    def cancel(self, run_id: str) -> dict[str, Any]:
        with self._lock:
            rec = self._record(run_id)
            if rec["state"] in TERMINAL:
                raise Conflict(f"run {run_id} is already {rec['state']}", code="run_not_cancellable")
            self._cancel[run_id].set()
            if rec["state"] == "queued":
                self._queue.remove(run_id)
                self._finish(rec, "cancelled")
            job = rec.get("training_job")
        if job is not None and self.trainer is not None:
            try:
                self.trainer.cancel(job["id"])
            except KilnError:
                pass  # already terminal: the follower records its outcome
        with self._lock:
            return self._public(rec)

    def _record(self, run_id: str) -> dict[str, Any]:
        rec = self._runs.get(run_id) if RUN_ID_RE.match(run_id) else None
        if rec is None:
            raise NotFound(f"no OpenEnv run {run_id!r}", code="run_not_found", hint="list runs with GET /v1/openenv/runs")
        return rec

    def _public(self, rec: dict[str, Any]) -> dict[str, Any]:
        out = dict(rec)
        out["queue_position"] = self._queue.index(rec["id"]) + 1 if rec["id"] in self._queue else None
        return out

    def _persist(self, rec: dict[str, Any]) -> None:
        atomic_write_json(self.root / rec["id"] / RUN_FILE, rec, mode=0o600)

    def _update(self, rec: dict[str, Any], **fields: Any) -> None:
        with self._lock:
            rec.update(fields)
            self._persist(rec)

    def _finish(self, rec: dict[str, Any], state: str, *, error: tuple[str, str] | None = None) -> None:
        rec.update(state=state, finished_at=time.time(),
                   error=None if error is None else {"code": error[0], "message": error[1][:2000]})
        self._persist(rec)
        self.metrics.runs_finished.labels(state=state).inc()

    # ------------------------------------------------------------- execution
    def _worker(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stop:
                    self._lock.wait()
                if self._stop:
                    return
                run_id = self._queue.popleft()
                rec = self._runs[run_id]
                rec.update(state="discovering", started_at=time.time())
                self._persist(rec)
            cancelled = self._cancel[run_id].is_set
            try:
                self._execute(rec, self._requests[run_id], cancelled)
            except ep.Cancelled:
                with self._lock:
                    if self._stop:
                        self._finish(rec, "failed", error=("interrupted", ("the server shut down while this run "
                                                           f"was {rec['state']}; episodes are not resumed")))
                    else:
                        self._finish(rec, "cancelled")
            except KilnError as exc:
                with self._lock:
                    self._finish(rec, "failed", error=(exc.code, exc.message))
            except Exception as exc:
                log.exception("OpenEnv run %s crashed", run_id)
                with self._lock:
                    self._finish(rec, "failed", error=("internal_error", f"{type(exc).__name__}: {exc}"))

    def _discover(self, url: str) -> Discovery:
        return discover(url, max_bytes=self.cfg.max_discovery_bytes, timeout_s=self.cfg.exchange_timeout_s)

    def _execute(self, rec: dict[str, Any], req: OpenEnvRunRequest, cancelled: Callable[[], bool]) -> None:
        """Discover, collect every group's episodes, revalidate the environment, publish, then train."""
        from kiln.training.schemas import GRPORequest

        disc = self._discover(req.env_url)
        self._update(rec, state="collecting",
                     environment={"url": disc.base_url, "name": disc.name, "discovery_sha256": disc.digest,
                                  "documents": sorted(disc.documents)})
        groups, played = self._collect(rec, req, disc, cancelled)
        self._update(rec, state="revalidating")
        again = self._discover(req.env_url)
        if again.digest != disc.digest:
            raise EnvironmentIdentityChanged(
                f"the environment's discovery digest changed during the run ({disc.digest[:12]} -> {again.digest[:12]})")
        if cancelled():
            raise ep.Cancelled("the run was cancelled")
        assert self.trainer is not None
        contract = rec["training_contract"]
        try:  # the contract's materialised epochs, not a default recomputed from the usable groups
            grpo = GRPORequest.model_validate({**req.training, "epochs": contract["epochs"], "groups": groups})
        except ValidationError as exc:
            first = exc.errors()[0]
            raise InvalidRequest(f"the collected episodes do not fit a GRPO request at "
                                 f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}",
                                 code="episodes_not_trainable",
                                 hint="lower max_steps or make the environment's observations shorter") from None
        self._update(rec, artifacts=self._publish(rec, disc, groups, played))
        actual = _contract(self.trainer.prepare(grpo))  # the exact config the job will train with...
        if actual != contract:  # ...must be the one admitted at preflight (e.g. base_adapter republished since)
            changed = sorted(k for k in set(actual) | set(contract) if actual.get(k) != contract.get(k))
            raise Conflict(f"the effective GRPO config changed since preflight: {changed}",
                           code="training_contract_changed", hint="start a new run")
        job = self.trainer.submit(grpo)
        self._update(rec, state="training", training_job=_job_view(job))
        self._follow(rec, job["id"], cancelled)


    def _collect(self, rec: dict[str, Any], req: OpenEnvRunRequest, disc: Discovery,
                 cancelled: Callable[[], bool]) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], list[ep.Episode]]]]:
        """Play ``req.groups`` groups of ``req.group_size`` episodes; (GRPO groups, (reset payload, episodes) per group)."""
        import httpx

        system = req.instructions + ACTION_PROMPT + canonical_json(disc.action_schema)
        pin = PolicyPin(req.policy_adapter)  # the first action pins the policy revision; a change fails the run
        generate = self._actions.for_run(req, disc)
        budget = ep.Budget(self.cfg.max_rollout_bytes)
        groups: list[dict[str, Any]] = []
        returns: list[list[float]] = []
        played: list[tuple[dict[str, Any], list[ep.Episode]]] = []  # (reset payload, episodes) per group
        with httpx.Client(follow_redirects=False, timeout=self.cfg.exchange_timeout_s, trust_env=False) as http:
            retries = [0]

            def open_session() -> ep.Session:
                retries[0] += 1
                return ep.Session(disc.base_url, max_frame_bytes=self.cfg.max_frame_bytes,
                                  timeout_s=self.cfg.exchange_timeout_s, http=http,
                                  discovery_cap=self.cfg.max_discovery_bytes)

            def policy_for(episode: ep.Episode) -> Callable[[list[dict[str, str]]], Answer]:
                def policy(msgs: list[dict[str, str]]) -> Answer:
                    answer, revision = generate(msgs)
                    episode.policies.append(pin.check(revision))
                    if rec.get("policy") is None:  # the first action: the run's policy, persisted
                        self._update(rec, policy=pin.pinned)
                    return answer
                return policy

            for g in range(req.groups):
                seed = req.seed + g
                reset = {**req.reset, "seed": seed}
                initial: list[dict[str, str]] | None = None
                completions = []
                played.append((reset, []))
                group_returns = []
                for _ in range(req.group_size):
                    if cancelled():
                        raise ep.Cancelled("the run was cancelled")
                    session, data = ep.open_episode(open_session, reset, capacity_wait_s=self.cfg.capacity_wait_s,
                                                    cancelled=cancelled, budget=budget)
                    messages = [{"role": "system", "content": system},
                                {"role": "user", "content": ep.render_observation(data)}]
                    if initial is None:
                        initial = messages
                    elif messages != initial:
                        session.close(polite=False)
                        raise ep.EnvironmentProtocolError(
                            f"group {g}: reset with seed {seed} gave a different initial observation",
                            code="initial_messages_differ", hint="the environment's reset must be deterministic in its seed")
                    episode = ep.Episode(seed, data)
                    episode = ep.play(session, episode, policy_for(episode), messages, validator=disc.validator,
                                      max_steps=req.max_steps, protocol_error_reward=req.protocol_error_reward,
                                      budget=budget, render=ep.render_observation, cancelled=cancelled)
                    played[-1][1].append(episode)
                    completions.append(ep.as_completion(episode))
                    group_returns.append(episode.episode_return)
                    self._record_episode(rec, episode, retries[0], budget.used)
                assert initial is not None
                groups.append({"messages": initial, "completions": completions})
                returns.append(group_returns)
                with self._lock:
                    rec["progress"]["groups_done"] = g + 1
                    rec["returns"] = _return_stats(returns)
                    self._persist(rec)
        return groups, played

    def _record_episode(self, rec: dict[str, Any], episode: ep.Episode, sessions_opened: int, rollout_bytes: int) -> None:
        """A finished episode into the metrics and the run's persisted progress."""
        self.metrics.episode(episode.termination, episode.episode_return, episode.steps, len(episode.actions))
        with self._lock:
            rec["terminations"][episode.termination] += 1
            p = rec["progress"]
            p["episodes_done"] += 1
            p["env_steps"] += episode.steps
            p["policy_actions"] += len(episode.actions)
            self.metrics.capacity_retries.inc(sessions_opened - p["episodes_done"] - p["capacity_retries"])
            p["capacity_retries"] = sessions_opened - p["episodes_done"]
            p["rollout_bytes"] = rollout_bytes
            if episode.error is not None:
                p["last_episode_error"] = {"termination": episode.termination, **episode.error}
            self._persist(rec)

    def _publish(self, rec: dict[str, Any], disc: Discovery, groups: list[dict[str, Any]],
                 played: list[tuple[dict[str, Any], list[ep.Episode]]]) -> dict[str, dict[str, Any]]:
        """Write the rollout JSONL (exactly the groups GRPO trains on, one per line) and the replay record
        (reset payloads, reset observations, ordered action/result exchanges) into the run directory."""
        rollouts = b"".join(canonical_json_bytes(g) + b"\n" for g in groups)
        replay = canonical_json_bytes({
            "schema": REPLAY_SCHEMA, "discovery_sha256": disc.digest,
            "rollouts_sha256": sha256_hex(rollouts), "policy": rec.get("policy"),
            "groups": [{"reset": reset, "episodes": [
                {"reset_observation": e.reset_observation, "actions": e.actions, "policies": e.policies,
                 **({"reasoning": e.reasoning} if any(r is not None for r in e.reasoning) else {}),
                 "exchanges": e.exchanges,
                 "termination": e.termination, "return": e.episode_return, "steps": e.steps, "error": e.error}
                for e in episodes]} for reset, episodes in played]})
        out = {}
        for name, data in (("rollouts.jsonl", rollouts), ("replay.json", replay)):
            if len(data) > self.cfg.max_rollout_bytes:
                raise ep.RolloutBudgetExceeded(f"{name} would be {len(data)} bytes, over max_rollout_bytes")
            atomic_write_bytes(self.root / rec["id"] / name, data, mode=0o600)
            out[name] = {"sha256": sha256_hex(data), "bytes": len(data)}
        return out

    def _follow(self, rec: dict[str, Any], job_id: str, cancelled: Callable[[], bool]) -> None:
        assert self.trainer is not None
        forwarded = False
        while True:
            job = self.trainer.job(job_id)
            with self._lock:
                if job != rec["training_job"]:
                    rec["training_job"] = _job_view(job)
                    self._persist(rec)
            if job["state"] in JOB_TERMINAL:
                break
            if self._stop:  # shutdown: the trainer's own close decides the job's fate; this run is interrupted
                raise ep.Cancelled("the server is shutting down")
            if cancelled() and not forwarded:
                forwarded = True
                try:
                    self.trainer.cancel(job_id)
                except KilnError:
                    pass
            time.sleep(JOB_POLL_S)
        if job["state"] == "succeeded":
            receipt = self._receipt(rec, job)  # outside the lock: hashes the adapter manifest
        with self._lock:
            if job["state"] == "succeeded":
                rec["artifacts"] = {**(rec["artifacts"] or {}), RECEIPT_FILE: receipt}
                self._finish(rec, "succeeded")
            elif job["state"] == "cancelled":
                self._finish(rec, "cancelled")
            else:
                err = job.get("error") or {}
                msg = err.get("message") if isinstance(err, dict) else str(err)
                self._finish(rec, "failed", error=("training_failed", f"GRPO job {job_id} failed: {msg}"))

    def _receipt(self, rec: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
        """Write ``train_receipt.json``: the adapter revision the job published (bound as every receipt binds one:
        :func:`kiln.adapters.receipt.adapter_binding`, with the manifest's SHA-256, which binds the corpus it was
        trained on, and the SHA-256 of the job's own ``kiln-receipt.json``), the GRPO config digest, the
        rollout and replay digests; written by the one receipt writer."""
        from kiln.adapters.manifest import MANIFEST_FILE, Manifest
        from kiln.adapters.receipt import RECEIPT_FILE as ADAPTER_RECEIPT
        from kiln.adapters.receipt import adapter_binding, encode_receipt, write_receipt

        result = job.get("result") or {}
        revision_dir = Path(result["path"])
        manifest_bytes = (revision_dir / MANIFEST_FILE).read_bytes()
        manifest = Manifest.from_bytes(manifest_bytes)
        job_receipt = revision_dir / ADAPTER_RECEIPT  # the training job's own receipt, linked by its digest
        receipt = encode_receipt({
            "schema": RECEIPT_SCHEMA, "run_id": rec["id"], "training_job": job["id"],
            "adapter": {**adapter_binding(manifest, manifest_bytes), "activated": result.get("activated"),
                        "receipt_sha256": sha256_hex(job_receipt.read_bytes()) if job_receipt.is_file() else None},
            "training_contract_sha256": contract_digest(rec["training_contract"]),
            "discovery_sha256": rec["environment"]["discovery_sha256"],
            "policy": rec.get("policy"),  # the one policy revision every trained action came from
            "base_model_sha256": manifest.base_model_sha256,
            "artifacts": {name: entry["sha256"] for name, entry in sorted((rec["artifacts"] or {}).items())},
        })
        if len(receipt) > MAX_RUN_FILE_BYTES:
            raise ep.RolloutBudgetExceeded(f"{RECEIPT_FILE} would be {len(receipt)} bytes")
        digest, size = write_receipt(self.root / rec["id"] / RECEIPT_FILE, receipt)
        return {"sha256": digest, "bytes": size}

    def open_artifact(self, run_id: str, name: str) -> tuple[int, int, str]:
        """``(fd, bytes, sha256)`` of a published artifact, verified on that descriptor: only a name in the run's
        persisted manifest, a regular file (no symlink) of the recorded length and digest. The caller streams
        from ``fd`` (rewound) and closes it."""
        with self._lock:
            entry = (self._record(run_id).get("artifacts") or {}).get(name)
        if entry is None:
            raise NotFound(f"run {run_id} has no published artifact {name!r}", code="artifact_not_found",
                           hint="the run's `artifacts` lists what can be downloaded")
        try:
            fd = open_regular(self.root / run_id / name)
        except NotRegularFileError as exc:
            raise ArtifactIntegrityError(f"artifact {name} of run {run_id} is not a regular file "
                                         f"({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            digest = hashlib.sha256()
            if stat.S_ISREG(st.st_mode) and st.st_size == entry["bytes"]:
                while chunk := os.read(fd, 1 << 20):
                    digest.update(chunk)
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry["bytes"] or digest.hexdigest() != entry["sha256"]:
                raise ArtifactIntegrityError(f"artifact {name} of run {run_id} no longer matches its recorded "
                                             "length and SHA-256")
            os.lseek(fd, 0, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        return fd, entry["bytes"], entry["sha256"]


def _contract(plan: Any) -> dict[str, Any]:
    return {k: v for k, v in plan.request.items() if k not in CONTRACT_DROPPED}


def contract_digest(contract: dict[str, Any]) -> str:
    return domain_digest(CONTRACT_DOMAIN, canonical_json_bytes(contract))


def _job_view(job: dict[str, Any]) -> dict[str, Any]:
    keep = ("id", "state", "adapter", "created_at", "finished_at", "error", "result", "progress")
    return {k: job[k] for k in keep if k in job}


def _return_stats(returns: list[list[float]]) -> dict[str, Any]:
    flat = [r for g in returns for r in g]
    return {"mean": sum(flat) / len(flat), "min": min(flat), "max": max(flat),
            "group_means": [sum(g) / len(g) for g in returns]}


def runs_root(settings: Settings) -> Path:
    return settings.adapters_path / RUNS_DIR


__all__ = ["EnvironmentIdentityChanged", "OpenEnvService", "runs_root"]
