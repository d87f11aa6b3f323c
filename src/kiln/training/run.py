"""``torchrun --nproc_per_node N -m kiln.training.run``: one training job across torchrun's processes.

It runs the same job recipe as the server (:class:`kiln.training.sft.job.SFTRecipe`:
plan -> setup -> train -> save -> publish), outside the server, on a model
loaded by each rank from the Kiln home:

* the request is the HTTP API's body (``POST /v1/train/sft``), read by rank 0
  and sent to every rank; every rank validates it into the same
  :class:`~kiln.training.core.plan.JobPlan` (the ranks' plan digests must agree);
* the training loop is :func:`kiln.training.sft.distributed.run_sft_distributed`
  (DDP over the LoRA parameters) with more than one process, and the server's
  own :func:`kiln.training.sft.job.run_sft` with one;
* rank 0 writes the checkpoints, the job's status and result, and publishes
  the adapter through the adapter store while the other ranks wait at a barrier.

A job lives in ``$KILN_HOME/training/distributed/<job id>/`` (``request.json``,
``status.json``, ``result.json``, ``checkpoints/``). A job that failed (a rank was
killed, the host went down) is continued with the identical request and
``--resume <job id>``: the new job starts from the old one's last checkpoint,
with the same world size. The adapter is published, not activated: serve it with
``kiln adapters load <name>``. See docs/scale.md.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kiln.canonical import (
    FileTooLargeError,
    NotRegularFileError,
    atomic_write_json,
    read_regular_file,
    strict_json_loads,
)
from kiln.errors import Conflict, InvalidRequest, KilnError, NotFound
from kiln.training.core.checkpoints import Checkpoint, list_checkpoints
from kiln.training.core.loop import Hooks, Report
from kiln.training.core.plan import JobPlan, ResumeCheck, prepare_context
from kiln.training.core.recipe import RecipeContext, step_plan
from kiln.training.queue.jobs import new_job_id
from kiln.training.schemas import JOB_ID_RE, SFTRequest
from kiln.training.sft.distributed import (
    DistributedError,
    World,
    barrier,
    broadcast_object,
    check_resume_world,
    check_same,
    close_world,
    init_world,
    run_sft_distributed,
)
from kiln.training.sft.job import SFTData, SFTRecipe, prepare_sft

if TYPE_CHECKING:
    from kiln.adapters.store import AdapterRecord, AdapterStore, Staging
    from kiln.config import Settings
    from kiln.runtime.loader import LoadedModel

JOBS_DIR = "distributed"
MAX_REQUEST_BYTES = 64 * 1024 * 1024
MAX_STATUS_BYTES = 1 << 20  # status.json, result.json of a distributed job
SUPPORTED_KINDS = ("sft",)
RUNNING, SUCCEEDED, FAILED = "running", "succeeded", "failed"


def job_dir(settings: Settings, job_id: str) -> Path:
    return settings.home_path / "training" / JOBS_DIR / job_id


def read_status(path: Path) -> dict[str, Any] | None:
    try:
        return strict_json_loads(read_regular_file(path / "status.json", MAX_STATUS_BYTES))
    except FileNotFoundError:
        return None


def write_status(path: Path, **fields: Any) -> None:
    old = read_status(path) or {}
    atomic_write_json(path / "status.json", old | fields | {"updated_at": time.time()}, mode=0o600)


def job_running(path: Path) -> bool:
    """True while a live rank 0 holds the job's lock (``lock`` file in its directory)."""
    try:
        fd = os.open(path / "lock", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class _OfflineEngine:
    """What a recipe needs from an engine, without serving: the ``PeftModel`` and its ownership lock."""

    def __init__(self, loaded: LoadedModel):
        from kiln.runtime.adapter_slots import AdapterSlots
        from kiln.runtime.ownership import AcceleratorOwnership

        self.ownership = AcceleratorOwnership()
        self.adapters = AdapterSlots(loaded.model, self.ownership)

    def peft_model(self) -> Any:
        return self.adapters.peft_model()

    def delete_private_adapter(self, private_name: str) -> None:
        self.adapters.delete_private(private_name)


def _resume_check(settings: Settings, world: World) -> ResumeCheck:
    """``resume_from_job`` for ``kiln train run``: a failed distributed job directory of the same plan."""

    def check(job_id: str, plan_sha: str, eff: dict[str, Any] | None = None) -> None:
        if not world.is_main:  # rank 0 checks the job directory and sends the checkpoint
            return
        path = job_dir(settings, job_id)
        status = read_status(path)
        if status is None:
            raise NotFound(f"no distributed job {job_id} under {path.parent}", code="job_not_found")
        if job_running(path):
            raise Conflict(f"job {job_id} is still running", code="job_not_resumable")
        if status.get("state") == SUCCEEDED:
            raise Conflict(f"job {job_id} succeeded; only failed jobs can be resumed", code="job_not_resumable")
        if status.get("plan_sha256") != plan_sha:
            raise Conflict(f"this request differs from job {job_id}'s request", code="resume_plan_mismatch",
                           hint="resubmit the identical request (data, model and hyperparameters)")
        if not list_checkpoints(path / "checkpoints"):
            raise Conflict(f"job {job_id} left no checkpoint", code="no_checkpoint",
                           hint="set checkpoint_interval to make jobs resumable")

    return check


def on_main(world: World, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, its value on every rank; a failure on rank 0 fails every rank with its message."""
    value, error = None, None
    if world.is_main:
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - sent to the other ranks, re-raised here
            error = exc
    sent = broadcast_object(world, ("error", f"{type(error).__name__}: {error}") if error is not None
                            else ("ok", value))
    if error is not None:
        raise error
    if sent[0] == "error":
        raise DistributedError(f"rank 0 failed: {sent[1]}")
    return sent[1]


class DistributedRecipe(SFTRecipe):
    """:class:`~kiln.training.sft.job.SFTRecipe` across a torchrun world: rank 0 resumes, saves and publishes."""

    def __init__(self, plan: JobPlan[SFTData], ctx: RecipeContext, *, job_id: str, world: World,
                 micro_batch_size: int | None = None, fsdp: bool = False):
        super().__init__(plan, ctx, job_id=job_id)
        self.world, self.micro_batch_size, self.fsdp = world, micro_batch_size, fsdp

    def load_resume(self) -> Checkpoint | None:
        ckpt = on_main(self.world, super().load_resume)
        check_resume_world(ckpt, self.world)
        return ckpt

    def train(self, resume: Checkpoint | None) -> Report:
        if not self.world.distributed:
            return super().train(resume)  # the server's own loop
        report = run_sft_distributed(
            self.peft_model, self.private, self.plan.data.rows, step_plan(self.plan), self.world,
            pad_id=self.ctx.model.tokenizer.pad_token_id, micro_batch_size=self.micro_batch_size,
            hooks=self.ctx.hooks, resume=resume, fsdp=self.fsdp)
        if self.plan.request.get("anchor_weight"):  # the distributed loop does not add the KL-to-base anchor yet
            report.extra["anchor"] = "not applied in distributed jobs"
        self._phase("train")
        return report

    def save(self) -> Staging | None:  # type: ignore[override]
        return super().save() if self.world.is_main else None

    def publish(self, staging: Staging | None) -> AdapterRecord | None:  # type: ignore[override]
        record = on_main(self.world, lambda: super(DistributedRecipe, self).publish(staging))  # type: ignore[arg-type]
        barrier(self.world)
        return record

    def measure_locality(self, report: Any) -> dict[str, Any] | None:  # type: ignore[override]
        """One process measures as the server does; a torchrun world does not measure yet (the adapter is
        sharded or replicated across the ranks): its receipt has no locality."""
        return None if self.world.distributed else super().measure_locality(report)

    def activate(self, record: AdapterRecord | None) -> None:  # type: ignore[override]
        self.activated = False  # no server here: `kiln adapters load <name>` serves it
        self._phase("activate")

    def result(self, record: AdapterRecord | None, report: Report,  # type: ignore[override]
               resume: Checkpoint | None) -> dict[str, Any]:
        if record is None:
            return {"rank": self.world.rank, "report": report.as_dict()}
        out = super().result(record, report, resume)
        out.update(job_id=self.job_id, world_size=self.world.world_size,
                   serve_with=f"kiln adapters load {record.name}")
        return out


def _read_request(path: Path) -> dict[str, Any]:
    try:
        body = strict_json_loads(read_regular_file(path, MAX_REQUEST_BYTES))
    except FileTooLargeError:
        raise InvalidRequest(f"{path} is larger than {MAX_REQUEST_BYTES} bytes", code="request_too_large") from None
    except NotRegularFileError as exc:
        raise InvalidRequest(f"{path} is not a regular file ({exc.strerror})") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"{path} must hold one JSON object (the POST /v1/train/sft body)")
    return body


def _check_request(body: dict[str, Any], kind: str, resume: str | None) -> SFTRequest:
    if kind not in SUPPORTED_KINDS:
        raise DistributedError(f"distributed {kind} jobs are not supported yet; only {', '.join(SUPPORTED_KINDS)}",
                               hint=f"run {kind} jobs on the server (kiln train {kind})")
    if body.get("post_eval") is not None:
        raise DistributedError("post_eval is not supported in distributed jobs",
                               hint="publish, then run the eval against the server (docs/evals.md)")
    if body.get("gradient_checkpointing"):
        raise DistributedError("gradient_checkpointing is not supported yet in distributed jobs",
                               hint="leave it off; with --fsdp each rank holds only a share of the base")
    if resume is not None:
        if body.get("resume_from_job") not in (None, resume):
            raise InvalidRequest("the request's resume_from_job differs from --resume")
        body = body | {"resume_from_job": resume}
    return SFTRequest.model_validate(body)


def run_job(args: argparse.Namespace, world: World, settings: Settings) -> dict[str, Any]:
    """Plan, train and publish one job on this rank; rank 0 returns the job's result."""
    from kiln.adapters.store import AdapterStore
    from kiln.runtime.builtin import builtin_model_dir
    from kiln.runtime.loader import ModelLoadError, load_model, resolve_dtype

    if args.fsdp and not world.distributed:
        raise DistributedError("--fsdp needs torchrun (more than one process)",
                               hint="start it with torchrun --nproc_per_node N, or leave out --fsdp")
    job_id = on_main(world, lambda: args.job_id or new_job_id())
    path = job_dir(settings, job_id)
    body = on_main(world, lambda: _read_request(Path(args.request)))
    request = _check_request(body, args.kind, args.resume)

    model_path = settings.model.path or builtin_model_dir(settings.home_path)
    if not Path(model_path).is_dir():
        raise ModelLoadError(f"no model at {model_path}", hint="build the built-in model with `kiln model init`")
    # With FSDP the base is loaded into host memory, then sharded and moved to the device rank by rank.
    loaded = load_model(model_path, device="cpu" if args.fsdp else world.device,
                        dtype=resolve_dtype(settings.model.dtype, world.device))
    check_same(world, "the base model (sha256)", loaded.base_model_sha256)
    store = AdapterStore(settings.adapters_path)
    # the server's submission checks and plan (the kind's prepare), without its queue, worker or engine
    planner = prepare_context(model=loaded, store=store, settings=settings,
                              check_resumable=_resume_check(settings, world))
    planned: list[JobPlan[SFTData]] = []  # rank 0 plans first (it alone checks a resumed job), then the others

    def plan_on_main() -> str:
        planned.append(prepare_sft(planner, request))
        return planned[0].plan_sha256

    on_main(world, plan_on_main)
    plan = planned[0] if world.is_main else prepare_sft(planner, request)
    check_same(world, "the job plan (plan_sha256)", plan.plan_sha256)

    lock_fd = on_main(world, lambda: _start_job(path, job_id, body, plan, world))
    try:
        bar = _progress_bar(world, plan)
        hooks = Hooks(
            on_progress=(lambda p: _on_progress(path, bar, p)) if world.is_main else (lambda p: None),
            checkpoint_root=path / "checkpoints",  # written by rank 0 only
            plan_sha256=plan.plan_sha256,
        )
        resume_root = None if args.resume is None else job_dir(settings, args.resume) / "checkpoints"
        engine = _OfflineEngine(loaded)
        ctx = RecipeContext(engine, store, loaded, hooks, path / "checkpoints", resume_root)  # type: ignore[arg-type]
        result = DistributedRecipe(plan, ctx, job_id=job_id, world=world, micro_batch_size=args.micro_batch_size,
                                   fsdp=args.fsdp).run()
        if bar is not None:
            bar.close()
        if world.is_main:
            atomic_write_json(path / "result.json", result, mode=0o600)
            write_status(path, state=SUCCEEDED, finished_at=time.time())
        return result
    except BaseException as exc:
        if world.is_main and path.is_dir():
            write_status(path, state=FAILED, error=f"{type(exc).__name__}: {exc}", finished_at=time.time())
        raise
    finally:
        if world.is_main and isinstance(lock_fd, int):
            os.close(lock_fd)


def _start_job(path: Path, job_id: str, body: dict[str, Any], plan: JobPlan[SFTData], world: World) -> int:
    """Create the job directory (0700), take its lock and record the request and the running state."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise Conflict(f"job {job_id} is already running", code="job_running") from None
    if (path / "status.json").exists():
        os.close(fd)
        raise Conflict(f"job ID {job_id} is already taken by an earlier job", code="job_exists",
                       hint="leave out --job-id for a fresh one; continue a failed job with --resume")
    atomic_write_json(path / "request.json", body, mode=0o600)
    write_status(path, id=job_id, kind=plan.kind, adapter=plan.adapter, state=RUNNING, world_size=world.world_size,
                 plan_sha256=plan.plan_sha256, resume_from_job=plan.resume_from_job, started_at=time.time(),
                 pid=os.getpid(), error=None)
    return fd


def _progress_bar(world: World, plan: JobPlan[SFTData]) -> Any:
    if not world.is_main:
        return None
    from tqdm import tqdm

    return tqdm(total=None, desc=f"{plan.kind} {plan.adapter} x{world.world_size}", unit="step", file=sys.stderr,
                mininterval=0.5)


def _on_progress(path: Path, bar: Any, progress: dict[str, Any]) -> None:
    write_status(path, progress=progress)
    if bar is not None:
        bar.total = progress.get("total_steps")
        bar.n = progress.get("step") or 0
        if progress.get("loss") is not None:
            bar.set_postfix(loss=progress["loss"], refresh=False)
        bar.refresh()


# ---------------------------------------------------------------- the `kiln train sft --distributed` launcher


def launch(body: dict[str, Any], *, nproc: int, kind: str = "sft", home: str | None = None,
           model: str | None = None, config: str | None = None, resume: str | None = None,
           micro_batch_size: int | None = None, fsdp: bool = False) -> int:
    """Run one job under ``python -m torch.distributed.run`` (a real subprocess, one host) and report it.

    Returns the exit status to give the shell: 0 when the adapter was published.
    """
    import subprocess
    import tempfile

    from kiln.config import load_settings

    settings = load_settings({"home": home, "model.path": model}, config_path=config).settings
    job_id = new_job_id()
    path = job_dir(settings, job_id)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{job_id}.", suffix=".json",
                                     delete=False) as f:
        json.dump(body, f)
        request_file = f.name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "kiln.training.run", "--kind", kind, "--request", request_file, "--job-id", job_id,
           "--home", str(settings.home_path)]
    for flag, value in (("--model", model), ("--config", config), ("--resume", resume),
                        ("--micro-batch-size", micro_batch_size)):
        if value is not None:
            cmd += [flag, str(value)]
    if fsdp:
        cmd.append("--fsdp")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"distributed job {job_id}: {nproc} processes (torchrun), logs below", file=sys.stderr)
    try:
        code = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=False).returncode
    finally:
        os.unlink(request_file)
    status = read_status(path) or {}
    if code == 0 and status.get("state") == SUCCEEDED:
        result = strict_json_loads(read_regular_file(path / "result.json", MAX_STATUS_BYTES))
        print(json.dumps(result, sort_keys=True))
        print(f"published {result['adapter']} revision {result['revision'][:12]} from {nproc} processes; serve it "
              f"with `{result['serve_with']}`", file=sys.stderr)
        return 0
    reason = status.get("error") or "a process died before rank 0 could record why"
    if status and status.get("state") != FAILED:  # rank 0 was killed before it could say so
        write_status(path, state=FAILED, error=f"torchrun exited with status {code}", finished_at=time.time())
    print(f"distributed job {job_id} failed (torchrun exit status {code}; the torchrun summary above names the "
          f"rank that failed first). Rank 0 saw: {reason}\nNothing was published.", file=sys.stderr)
    saved = list_checkpoints(path / "checkpoints")
    if saved:
        print(f"Its checkpoint at step {int(saved[-1].name.split('-')[1])} can be continued: run the same command "
              f"with --resume {job_id} and the same number of processes", file=sys.stderr)
    return code or 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kiln.training.run",
                                description="Run one Kiln training job under torchrun (docs/scale.md).")
    p.add_argument("--request", required=True, help="JSON file: the POST /v1/train/<kind> body")
    p.add_argument("--kind", default="sft", help="job kind (only sft is supported yet)")
    p.add_argument("--home", default=None, help="Kiln home (default: $KILN_HOME or ~/.cache/kiln)")
    p.add_argument("--model", default=None, help="model directory (default: model.path, else the built-in model)")
    p.add_argument("--config", default=None, help="kiln.toml")
    p.add_argument("--job-id", default=None, help="the new job's ID (default: a fresh one)")
    p.add_argument("--resume", default=None, metavar="JOB_ID", help="continue this failed job from its checkpoint")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="rows per forward on each rank (gradient accumulation up to the global batch_size)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the base model across the ranks (FSDP2 fully_shard) instead of a full copy per rank")
    args = p.parse_args(argv)
    for name in ("job_id", "resume"):
        value = getattr(args, name)
        if value is not None and not JOB_ID_RE.match(value):
            p.error(f"--{name.replace('_', '-')} must be a job ID like job-0123456789abcdef")
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        p.error("--micro-batch-size must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from kiln.config import load_settings

    args = parse_args(argv)
    try:
        settings = load_settings({"home": args.home, "model.path": args.model}, config_path=args.config).settings
        if settings.model.threads:
            import torch

            torch.set_num_threads(settings.model.threads)
        world = init_world(settings.model.device)
    except KilnError as exc:
        print(f"kiln.training.run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_job(args, world, settings)
    except KilnError as exc:
        hint = f" ({exc.hint})" if getattr(exc, "hint", "") else ""
        print(f"kiln.training.run: rank {world.rank}: {type(exc).__name__}: {exc}{hint}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a failed rank says why and exits non-zero; torchrun stops the rest
        print(f"kiln.training.run: rank {world.rank}: job failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        close_world(world)
    if world.is_main:
        print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
