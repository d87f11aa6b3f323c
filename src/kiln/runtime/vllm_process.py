"""The vLLM subprocess behind ``[serving] engine = "vllm"``: its arguments, its start, its world.

Kiln cannot import vLLM: vLLM lives in its own environment (``[vllm] python``, by
default ``.vllm-venv`` next to Kiln's source tree) with its own torch and
transformers pins. So the engine is a supervised child process, started the way
the teacher launcher starts vLLM (``kiln.teachers``):

* **immutable snapshot**: the served checkpoint is staged (reflink or copy,
  hashed, files 0400, directories 0500, verified again right before spawn) under
  a private parent, and vLLM is pointed only at the staged tree; the snapshot and
  a fresh runtime cache (``VLLM_CACHE_ROOT``) are removed when the engine stops;
* **identity**: vLLM answers with ``--fingerprint-mode=custom`` and Kiln's system
  fingerprint plus the snapshot manifest digest, so a response names the exact
  bytes it came from;
* **process-group supervision**: vLLM starts in its own session
  (:class:`kiln.system.supervise.Supervisor`, detached mode), and stopping drains
  the whole group (SIGTERM, then SIGKILL) so no EngineCore or worker outlives Kiln;
* **private transport**: vLLM listens on ``127.0.0.1`` only, on a port Kiln picks,
  with an API key drawn fresh for every start and passed in the environment
  (``VLLM_API_KEY``), never on the command line.

Runtime LoRA loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) is on for this child
because adapters published while serving must reach vLLM without a restart; its
``/v1/load_lora_adapter`` is reachable only through that private port and key,
which only Kiln holds, so Kiln stays the only path that changes what is served.

Rank population: before Kiln reports ready it acquires the world vLLM actually
formed, from vLLM's own reports. Every vLLM worker logs, once its process groups
exist, ``rank R in world size W is assigned as DP rank d, PP rank p, ..., TP rank
t`` with its process prefix ``(Worker_TP1 pid=1234)`` (Ray workers add
``ip=<node>``). :func:`observe_world` projects those lines into a
:class:`~kiln.system.ranks.DeclaredObservation` (global rank, TP rank, host: the
Ray node address or this host's name, process key: the worker pid, incarnation:
this start's token) and :func:`kiln.system.ranks.decide_rank_population` decides
it; a refusal keeps ``/health`` at 503 with the findings.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.system.ranks import (
    DeclaredObservation,
    Participant,
    RankPopulationDecision,
    decide_rank_population,
)
from kiln.config import ConfigError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm.entrypoints.cli.main` needs the `vllm` dist name
READY_POLL_S = 0.5
MAX_LOG_SCAN_BYTES = 16 << 20  # rank lines are read from at most this much of the child's log
_RANK_LINE = re.compile(
    r"\((?P<proc>[A-Za-z0-9_]+) pid=(?P<pid>\d+)(?:, ip=(?P<ip>[0-9A-Za-z.:_-]+))?\).*?"
    r"rank (?P<rank>\d+) in world size (?P<world>\d+) is assigned as DP rank (?P<dp>\d+), "
    r"PP rank (?P<pp>\d+),.*?\bTP rank (?P<tp>\d+)"
)


def default_python() -> str:
    """``.vllm-venv/bin/python`` at the root of the source tree Kiln runs from (scripts/test_vllm.sh builds it)."""
    return str(Path(__file__).resolve().parents[3] / ".vllm-venv" / "bin" / "python")


@dataclass(frozen=True)
class VllmPlan:
    """Everything one start needs, resolved from the settings (see :func:`plan_from_settings`)."""

    python: str
    model_dir: Path
    served_model_id: str
    max_model_len: int
    max_logprobs: int
    dtype: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    ray_address: str | None = None
    hosts: tuple[str, ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16
    kv_cache_gib: int = 1
    port: int = 0
    startup_timeout_s: float = 600.0
    state_dir: Path = Path(".")
    fingerprint: str = "kiln"
    extra_args: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def plan_from_settings(settings: Any, *, model_dir: Path, served_model_id: str, max_model_len: int,
                       loaded_dtype: str, fingerprint: str) -> VllmPlan:
    """Resolve ``[vllm]`` into a plan; a problem raises :class:`ConfigError` naming the key."""
    v = settings.vllm
    python = v.python or default_python()
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise ConfigError(f"vllm.python: {python} is not an executable file; build the vLLM environment with "
                          "scripts/test_vllm.sh --setup-only or set [vllm] python / KILN_VLLM_PYTHON")
    dtype = loaded_dtype if v.dtype == "auto" else v.dtype
    return VllmPlan(
        python=python, model_dir=Path(model_dir), served_model_id=served_model_id, max_model_len=max_model_len,
        max_logprobs=max(settings.limits.max_logprobs, settings.limits.max_prompt_logprobs, 1), dtype=dtype,
        tensor_parallel_size=v.tensor_parallel_size, pipeline_parallel_size=v.pipeline_parallel_size,
        ray_address=v.ray_address, hosts=tuple(v.hosts), max_loras=v.max_loras, max_lora_rank=v.max_lora_rank,
        kv_cache_gib=v.kv_cache_gib, port=v.port, startup_timeout_s=v.startup_timeout_s,
        state_dir=Path(v.state_dir).expanduser() if v.state_dir else settings.home_path / "vllm-engine",
        fingerprint=fingerprint, extra_args=tuple(v.extra_args),
    )


def vllm_argv(plan: VllmPlan, model_path: Path, port: int, fingerprint: str) -> list[str]:
    """The child's command line (no secret on it: the API key travels in ``VLLM_API_KEY``)."""
    argv = [
        plan.python, "-m", SERVER_MODULE,
        f"--model={model_path}",
        f"--served-model-name={plan.served_model_id}",
        "--host=127.0.0.1", f"--port={port}",
        f"--dtype={plan.dtype}",
        f"--max-model-len={plan.max_model_len}",
        f"--max-logprobs={plan.max_logprobs}",
        "--logprobs-mode=raw_logprobs",
        "--generation-config=vllm",  # sampling defaults come from the request (Kiln's), not generation_config.json
        "--load-format=safetensors",
        f"--tensor-parallel-size={plan.tensor_parallel_size}",
        f"--pipeline-parallel-size={plan.pipeline_parallel_size}",
        "--fingerprint-mode=custom", f"--fingerprint-value={fingerprint}",
    ]
    if plan.max_loras:  # LoRA on costs vLLM throughput even for base rows (docs/scale.md): 0 turns it off
        argv += ["--enable-lora", f"--max-loras={plan.max_loras}", f"--max-lora-rank={plan.max_lora_rank}"]
    if plan.ray_address:
        argv.append("--distributed-executor-backend=ray")
    return argv + list(plan.extra_args)


def child_environment(plan: VllmPlan, api_key: str, cache_dir: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """Kiln's environment minus its own settings, plus the child's key, cache, LoRA switch and Ray address."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("KILN_") and k not in ("VLLM_CACHE_ROOT", "VLLM_API_KEY", "RAY_ADDRESS")}
    env.update({
        "VLLM_API_KEY": api_key,
        "VLLM_CACHE_ROOT": str(cache_dir),
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # reachable only on 127.0.0.1 with Kiln's per-start key
        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", str(plan.kv_cache_gib)),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    })
    if plan.ray_address:
        env["RAY_ADDRESS"] = plan.ray_address
    return env


# ------------------------------------------------------------------ rank population


@dataclass(frozen=True)
class RankReport:
    """One worker's own report of its place in the vLLM world (one log line)."""

    process: str
    pid: int
    host: str
    global_rank: int
    world_size: int
    data_parallel_rank: int
    pipeline_parallel_rank: int
    tensor_parallel_rank: int


def parse_rank_reports(lines: Iterable[str], local_host: str) -> list[RankReport]:
    """The rank lines vLLM's workers printed (latest per (host, pid, rank), in log order)."""
    seen: dict[tuple[str, int, int], RankReport] = {}
    for line in lines:
        m = _RANK_LINE.search(line)
        if m is None:
            continue
        r = RankReport(m["proc"], int(m["pid"]), m["ip"] or local_host, int(m["rank"]), int(m["world"]),
                       int(m["dp"]), int(m["pp"]), int(m["tp"]))
        seen[(r.host, r.pid, r.global_rank)] = r
    return list(seen.values())


def observe_world(plan: VllmPlan, reports: list[RankReport], incarnation: str, *, complete: bool,
                  local_host: str) -> DeclaredObservation:
    """The law's observation of this start: the world the config asks for, the workers that reported.

    ``selected_hosts`` are ``[vllm] hosts`` (default: this host alone); the world size
    and the TP/PP degrees are the configured ones, so a worker that reports another
    world, a missing or doubled rank, or a pipeline-parallel split all become findings.
    """
    hosts = plan.hosts or (local_host,)
    return DeclaredObservation(
        incarnation=incarnation,
        returned_completely=complete,
        world_size=plan.world_size,
        tensor_parallel_size=plan.tensor_parallel_size,
        pipeline_parallel_size=plan.pipeline_parallel_size,
        data_parallel_size=1,
        selected_hosts=tuple(hosts),
        participants=tuple(
            Participant(global_rank=r.global_rank, tensor_parallel_rank=r.tensor_parallel_rank, host=r.host,
                        host_local_worker_process_key=str(r.pid), incarnation=incarnation)
            for r in reports
        ),
    )


def decide_world(plan: VllmPlan, log_lines: Iterable[str], incarnation: str, *, complete: bool,
                 local_host: str | None = None) -> tuple[DeclaredObservation, RankPopulationDecision]:
    host = local_host or socket.gethostname()
    obs = observe_world(plan, parse_rank_reports(log_lines, host), incarnation, complete=complete, local_host=host)
    return obs, decide_rank_population(obs)


# ------------------------------------------------------------------ the process


class VllmStartError(RuntimeError):
    """vLLM did not start (exited, timed out, or its snapshot could not be staged)."""


PR_SET_PDEATHSIG = 1


def _parent_death_signal():
    """Linux: the child gets SIGTERM if the thread that started it dies (Kiln killed with SIGKILL), so
    vLLM shuts its own engine down instead of outliving Kiln in its separate session. ``None`` elsewhere."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: the child only makes the call

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return arm


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmProcess:
    """One supervised start of the vLLM server over a staged snapshot (see the module docstring)."""

    plan: VllmPlan
    token: str = field(default_factory=lambda: f"{os.getpid()}-{secrets.token_hex(8)}")
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    port: int = 0
    log_path: Path | None = None
    snapshot_digest: str | None = None
    fingerprint: str | None = None
    started_at: float = 0.0
    _sup: Any = None
    _parent_fd: int | None = None
    _snap: Any = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Stage the snapshot, spawn vLLM in its own session. Returns at once; see :meth:`wait_ready`."""
        from kiln.system.private_dirs import (
            make_private_child,
            open_private_parent,
            recover_stale,
        )
        from kiln.system.provenance_io import ReadLimiter
        from kiln.system.snapshot import inventory, stage, verify
        from kiln.system.supervise import Supervisor

        plan = self.plan
        self.started_at = time.monotonic()
        self._parent_fd = open_private_parent(plan.state_dir, create=True)
        recover_stale(plan.state_dir)  # snapshots/caches of a Kiln that was killed (its pid is gone)
        limiter = ReadLimiter(None)
        trees = {"model": plan.model_dir}
        self._snap = stage(trees, inventory(trees), self._parent_fd, plan.state_dir, limiter, self.token)
        self.snapshot_digest = self._snap.manifest.digest
        make_private_child(self._parent_fd, f"cache-{self.token}")
        self.fingerprint = f"{plan.fingerprint}.snap-{self.snapshot_digest[:16]}"
        self.port = plan.port or free_loopback_port()
        argv = vllm_argv(plan, self._snap.tree("model"), self.port, self.fingerprint)
        env = child_environment(plan, self.api_key, plan.state_dir / f"cache-{self.token}")
        self.log_path = plan.state_dir / f"vllm-{self.token}.log"
        verify(self._snap, limiter)  # the tree vLLM will read is the tree that was hashed
        self._sup = Supervisor("detached")
        with open(self.log_path, "ab") as log:
            self._sup.proc = subprocess.Popen(argv, cwd="/", env=env, stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT, close_fds=True, start_new_session=True,
                                              preexec_fn=_parent_death_signal())  # noqa: PLW1509 - one prctl call

    @property
    def pid(self) -> int | None:
        return None if self._sup is None or self._sup.proc is None else self._sup.proc.pid

    def exit_code(self) -> int | None:
        return None if self._sup is None or self._sup.proc is None else self._sup.proc.poll()

    def log_lines(self) -> list[str]:
        if self.log_path is None or not self.log_path.exists():
            return []
        with open(self.log_path, "rb") as f:
            return f.read(MAX_LOG_SCAN_BYTES).decode(errors="replace").splitlines()

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_lines()[-lines:])

    def wait_ready(self, stop: Any = None) -> None:
        """Poll vLLM's ``/health`` until 200; :class:`VllmStartError` if it exits or times out."""
        import httpx

        deadline = self.started_at + self.plan.startup_timeout_s
        while True:
            if stop is not None and stop.is_set():
                raise VllmStartError("stopped while vLLM was starting")
            code = self.exit_code()
            if code is not None:
                raise VllmStartError(f"vLLM exited with status {code} while starting (log {self.log_path}):\n"
                                     f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise VllmStartError(f"vLLM did not become ready within vllm.startup_timeout_s="
                                     f"{self.plan.startup_timeout_s:g} s (log {self.log_path})")
            time.sleep(READY_POLL_S)

    def stop(self) -> None:
        """Drain the whole process group, then remove this start's snapshot and cache (every step attempted)."""
        from kiln.system.private_dirs import remove_child

        errors: list[BaseException] = []
        if self._sup is not None and self._sup.proc is not None:
            try:
                self._sup.drain()
            except Exception as exc:  # noqa: BLE001 - cleanup continues; reported below
                errors.append(exc)
        if self._parent_fd is not None:
            for name in (f".building-{self.token}", f"ready-{self.token}", f"cache-{self.token}"):
                try:
                    remove_child(self._parent_fd, name, missing_ok=True)
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
            os.close(self._parent_fd)
            self._parent_fd = None
        if errors:
            raise VllmStartError(f"stopping vLLM: {errors[0]}")
