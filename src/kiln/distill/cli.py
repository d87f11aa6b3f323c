"""`kiln distill` commands.

Every command prints exactly one line on stdout: one JSON object. Exit 0 means
success; exit 2 means a refusal, printed as ``{"error": {"code": ..., "message":
...}}``, with nothing on stderr. No traceback is ever shown: expected failures
are typed ``DistillError``s, numeric options are parsed here so a bad number is
a refusal too, usage mistakes (unknown option or command, missing argument) are
refusals with code ``usage_error``, and anything unforeseen is an
``internal_error`` refusal rather than a stack dump.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

import typer
from typer.core import TyperCommand, TyperGroup
from typer.exceptions import TyperException

MAX_C14N_INPUT_BYTES = 1 << 30
MAX_CONFIG_BYTES = 1 << 20
MAX_VERIFY_SHARDS = 4096  # shard directories one ``verify`` reads (after expanding roots)

_COMMANDS = "estimate, c14n, plan, verify, capture, train, status"


class _Refusal(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _emit(obj: dict[str, Any]) -> None:
    typer.echo(json.dumps(obj, sort_keys=True, ensure_ascii=False, allow_nan=False))


def _refuse(code: str, message: str) -> NoReturn:
    # json.dumps escapes any newline inside the message: the refusal is one line.
    _emit({"error": {"code": code, "message": message}})
    raise typer.Exit(2)


def _usage_refusal(exc: TyperException) -> NoReturn:
    message = " ".join(exc.format_message().split())
    _refuse("usage_error", f"{message} (run 'kiln distill --help')")


class _Command(TyperCommand):
    """A command whose argument-parsing errors are one-line JSON refusals, not usage panels."""

    def make_context(self, info_name, args, parent=None, **extra):  # type: ignore[no-untyped-def]
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except TyperException as exc:  # click's UsageError/BadParameter live under it
            _usage_refusal(exc)


class _Group(TyperGroup):
    """The ``kiln distill`` group: unknown or missing commands are one-line refusals too."""

    def make_context(self, info_name, args, parent=None, **extra):  # type: ignore[no-untyped-def]
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except TyperException as exc:
            _usage_refusal(exc)

    def parse_args(self, ctx, args):  # type: ignore[no-untyped-def]
        if not args and not ctx.resilient_parsing:
            _refuse("usage_error", f"missing command: one of {_COMMANDS} (run 'kiln distill --help')")
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx, args):  # type: ignore[no-untyped-def]
        try:
            return super().resolve_command(ctx, args)
        except TyperException as exc:
            _usage_refusal(exc)


app = typer.Typer(help="Offline distillation artifacts (autodistill v1).", cls=_Group)


def _run(body: Callable[[], dict[str, Any]]) -> None:
    from kiln.distill.errors import DistillError

    try:
        _emit(body())  # inside the try: an unserializable result is a refusal too
        return
    except _Refusal as exc:
        code, message = exc.code, str(exc)
    except DistillError as exc:
        code, message = exc.code, str(exc)
    except OSError as exc:
        code, message = "io_error", f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")
    except ValueError as exc:
        code, message = "invalid_input", str(exc)
    except Exception as exc:  # noqa: BLE001 - the CLI contract: a refusal line, never a traceback
        code, message = "internal_error", f"{type(exc).__name__}: {exc}; this is a Kiln bug, please report it"
    _refuse(code, message)


def _int(name: str, raw: Optional[str]) -> int:
    if raw is None:
        raise _Refusal("missing_option", f"--{name} is required")
    try:
        return int(raw, 10)
    except ValueError:
        raise _Refusal("invalid_option", f"--{name} must be an integer, got {raw!r}") from None


def _float(name: str, raw: Optional[str]) -> Optional[float]:
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise _Refusal("invalid_option", f"--{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise _Refusal("invalid_option", f"--{name} must be finite")
    return value


def _read_bounded(path: Path, limit: int) -> bytes:
    from kiln.distill.paths import read_bytes_nofollow

    path = Path(os.path.abspath(path))
    try:
        return read_bytes_nofollow(path.parent, path.name, max_bytes=limit)
    except FileNotFoundError:
        raise _Refusal("not_found", f"{path} does not exist") from None
    except OSError as exc:  # a directory, a symlink, no permission, ...
        raise _Refusal("io_error", f"cannot read {path} as a regular file: {exc.strerror or exc}") from None


@app.command(cls=_Command)
def estimate(
    tokens: Optional[str] = typer.Option(None, "--tokens", help="N: planned captured token count"),
    vocab_size: Optional[str] = typer.Option(None, "--vocab-size", help="V: vocabulary size"),
    top_k: Optional[str] = typer.Option(None, "--top-k", help="K: explicit top-k"),
    max_forced: Optional[str] = typer.Option(None, "--max-forced", help="F: max extra forced IDs per position"),
    id_bytes: Optional[str] = typer.Option(None, "--id-bytes", help="bytes per stored token ID"),
    logprob_bytes: Optional[str] = typer.Option(None, "--logprob-bytes", help="bytes per stored log p"),
    tail_bytes: Optional[str] = typer.Option(None, "--tail-bytes", help="bytes per stored tail mass"),
    entropy_bytes: Optional[str] = typer.Option(None, "--entropy-bytes", help="bytes per stored entropy"),
    throughput_min: Optional[str] = typer.Option(None, "--throughput-min", help="measured tokens/s, low end"),
    throughput_max: Optional[str] = typer.Option(None, "--throughput-max", help="measured tokens/s, high end"),
) -> None:
    """Exact dense/sparse byte counts; seconds only from a measured throughput range."""

    def body() -> dict[str, Any]:
        from kiln.distill.estimate import estimate_numbers

        return estimate_numbers(
            tokens=_int("tokens", tokens),
            vocab_size=_int("vocab-size", vocab_size),
            top_k=_int("top-k", top_k),
            max_forced=_int("max-forced", max_forced),
            id_bytes=_int("id-bytes", id_bytes),
            logprob_bytes=_int("logprob-bytes", logprob_bytes),
            tail_bytes=_int("tail-bytes", tail_bytes),
            entropy_bytes=_int("entropy-bytes", entropy_bytes),
            throughput_min=_float("throughput-min", throughput_min),
            throughput_max=_float("throughput-max", throughput_max),
        )

    _run(body)


@app.command(cls=_Command)
def c14n(file: Path = typer.Argument(..., help="JSONL file to normalize (soup-jsonl-c14n-v1)")) -> None:
    """Row count, source-byte SHA-256 and normalized SHA-256 of a JSONL file."""

    def body() -> dict[str, Any]:
        from kiln.canonical import JSONLNormalizationError, jsonl_c14n

        raw = _read_bounded(file, MAX_C14N_INPUT_BYTES)
        try:
            d = jsonl_c14n(raw)
        except JSONLNormalizationError as exc:
            raise _Refusal("invalid_jsonl", str(exc)) from None
        return {
            "algorithm": d.algorithm,
            "rows": d.rows,
            "source_bytes": d.source_bytes,
            "source_sha256": d.source_sha256,
            "normalized_bytes": d.normalized_bytes,
            "normalized_sha256": d.normalized_sha256,
        }

    _run(body)


@app.command(cls=_Command)
def plan(
    config: Optional[Path] = typer.Option(None, "--config", help="JSON: every plan field except the estimate"),
    out: Optional[Path] = typer.Option(None, "--out", help="directory that receives plan.json"),
) -> None:
    """Validate a plan config, derive its estimate, write DIR/plan.json, print plan_sha256."""

    def body() -> dict[str, Any]:
        from kiln.canonical import atomic_write_bytes
        from kiln.distill.contract import MAX_ARTIFACT_JSON_BYTES, complete_plan
        from kiln.distill.errors import ContractError

        if config is None or out is None:
            raise _Refusal("missing_option", "both --config FILE and --out DIR are required")
        from kiln.canonical import CanonicalJSONError, strict_json_loads

        try:
            obj = strict_json_loads(_read_bounded(config, MAX_CONFIG_BYTES))
        except CanonicalJSONError as exc:
            raise ContractError(f"{config}: {exc}") from None
        result = complete_plan(obj)
        data = result.canonical_bytes()
        target = out / "plan.json"
        if target.is_symlink():
            raise _Refusal("unsafe_path", f"{target} is a symlink")
        if target.exists():
            if _read_bounded(target, MAX_ARTIFACT_JSON_BYTES) != data:
                raise _Refusal(
                    "plan_exists", f"{target} holds a different plan; a changed plan is a new run, use a new --out"
                )
        else:
            atomic_write_bytes(target, data)
        return {"path": str(target), "plan_sha256": result.digest(), "estimate": result.estimate.to_obj()}

    _run(body)


def _shard_dirs(paths: list[Path]) -> list[Path]:
    """Each path is a shard transaction directory or a publication root holding them.

    A directory with ``manifests/`` or ``plan.json`` is a shard; otherwise its
    non-hidden subdirectories are (``.staging`` is never scanned); a directory
    with neither is verified as a (broken) shard so its problems are reported.
    The same directory named twice is read once.
    """
    too_many = _Refusal("too_many_shards", f"more than {MAX_VERIFY_SHARDS} shard directories; verify fewer")
    out: list[Path] = []
    seen: set[str] = set()
    for path in paths:
        found = [path]
        if path.is_dir() and not path.is_symlink():
            if not any(os.path.lexists(path / marker) for marker in ("manifests", "plan.json")):
                entries = list(itertools.islice(path.iterdir(), MAX_VERIFY_SHARDS + 64))
                if len(entries) == MAX_VERIFY_SHARDS + 64:
                    raise too_many
                found = sorted(c for c in entries if not c.name.startswith(".") and c.is_dir()) or [path]
        for shard in found:
            key = os.path.realpath(shard)
            if key not in seen:
                seen.add(key)
                out.append(shard)
            if len(out) > MAX_VERIFY_SHARDS:
                raise too_many
    return out


@app.command(cls=_Command)
def verify(
    paths: list[Path] = typer.Argument(..., help="shard transaction directories, or publication roots of a run"),
    plan_sha256: Optional[str] = typer.Option(None, "--plan-sha256", help="refuse a shard of any other plan"),
    dataset_root: Optional[Path] = typer.Option(
        None, "--dataset-root", help="also check every captured trajectory against the plan's dataset"),
) -> None:
    """Verify shards; print each verdict, resume decision and planned vs observed bytes/token, and the run's."""

    def body() -> dict[str, Any]:
        from kiln.canonical import is_lower_hex64
        from kiln.distill.shards import bytes_per_token, run_bytes_per_token, verify_shard

        if plan_sha256 is not None and not is_lower_hex64(plan_sha256):
            raise _Refusal("invalid_option", f"--plan-sha256 must be 64 lowercase hex digits, got {plan_sha256!r}")
        datasets: dict[str, Any] = {}

        def one(shard: Path):  # type: ignore[no-untyped-def]
            verdict = verify_shard(shard, expected_plan_sha256=plan_sha256)
            if dataset_root is None or verdict.plan is None:
                return verdict
            from kiln.distill.capture import load_examples

            key = verdict.plan.digest()
            if key not in datasets:  # the dataset is verified against the shard's own plan first
                datasets[key] = {e.example_id: e for e in load_examples(dataset_root, verdict.plan)}
            return verify_shard(shard, expected_plan_sha256=plan_sha256, examples=datasets[key])

        verdicts = [one(d) for d in _shard_dirs(paths)]
        dataset_ids = list(next(iter(datasets.values()))) if len(datasets) == 1 else None
        return {
            "shards": [
                {"verdict": v.to_obj(), "decision": v.decision, "bytes_per_token": bytes_per_token(v)}
                for v in verdicts
            ],
            "run": run_bytes_per_token(verdicts, dataset_ids),
        }

    _run(body)


def _positive(name: str, raw: Optional[str], default: int) -> int:
    value = default if raw is None else _int(name, raw)
    if value < 1:
        raise _Refusal("invalid_option", f"--{name} must be at least 1")
    return value


def _remote_teacher(alias: str) -> dict[str, Any]:
    """The pinned spec of a registered remote teacher, read from the registry kiln.toml names."""
    import json

    from kiln.config import load_settings
    from kiln.distill.remote import pinned_teacher_spec

    settings = load_settings().settings
    path = settings.teachers_registry_path
    if not path.is_file():
        raise _Refusal("teacher_not_found", f"no teacher registry at {path}; register the teacher first")
    entry = json.loads(path.read_text("utf-8")).get("teachers", {}).get(alias)
    if not isinstance(entry, dict):
        raise _Refusal("teacher_not_found", f"no teacher {alias!r} in {path}")
    return pinned_teacher_spec(entry, dict(settings.teachers.credentials))


def _teacher_manifest(path: Path) -> dict[str, Any]:
    """The manifest file, parsed strictly (its proof is checked against the pinned teacher in the child)."""
    from kiln.canonical import read_regular_file
    from kiln.teachers.inference_proof import MAX_MANIFEST_BYTES, TeacherManifestError, parse_teacher_manifest

    try:
        parsed = parse_teacher_manifest(read_regular_file(path, MAX_MANIFEST_BYTES))
    except (OSError, TeacherManifestError) as exc:
        raise _Refusal("invalid_teacher_manifest", f"--teacher-manifest {path}: {exc}") from None
    return {"system_fingerprint": parsed.system_fingerprint, "inference_config": parsed.inference_config}


@app.command(cls=_Command)
def capture(
    plan_file: Path = typer.Argument(..., help="the run's plan.json"),
    teacher: Optional[Path] = typer.Option(None, "--teacher", help="local teacher checkpoint directory"),
    teacher_alias: Optional[str] = typer.Option(
        None, "--teacher-alias", help="a registered remote teacher (kiln.toml's registry; needs --tokenizer)"),
    teacher_manifest: Optional[Path] = typer.Option(
        None, "--teacher-manifest", help="the remote teacher's manifest (`kiln teacher launch --manifest-only` "
        "output, or GET /v1/teacher/manifest of a Kiln teacher): proves its config.json digest"),
    dataset_root: Optional[Path] = typer.Option(None, "--dataset-root", help="directory holding the plan's dataset files"),
    out: Optional[Path] = typer.Option(None, "--out", help="publication root of this run's shards"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="tokenizer-only root (default: --teacher)"),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N"),
    layout: str = typer.Option("packed", "--layout", help="packed (soup.autodistill.capture-packed.v1) or jsonl"),
    examples_per_shard: Optional[str] = typer.Option(None, "--examples-per-shard"),
    examples_per_payload: Optional[str] = typer.Option(None, "--examples-per-payload"),
    batch_size: Optional[str] = typer.Option(None, "--batch-size", help="teacher forward rows per batch"),
    progress: bool = typer.Option(False, "--progress/--no-progress", help="tokens/s + ETA bar on stderr"),
) -> None:
    """Teacher-only capture in a fresh child process; resumes per the resume table."""

    def body() -> dict[str, Any]:
        from kiln.distill.capture import CaptureRequest
        from kiln.distill.capture import capture as run_capture

        if (teacher is None) == (teacher_alias is None) or dataset_root is None or out is None:
            raise _Refusal("missing_option", "one of --teacher DIR or --teacher-alias ALIAS, --dataset-root DIR "
                                             "and --out DIR are required")
        if teacher_alias is not None and tokenizer is None:
            raise _Refusal("missing_option", "--teacher-alias needs --tokenizer DIR (the plan's tokenizer files)")
        if layout not in ("packed", "jsonl"):
            raise _Refusal("invalid_option", f"--layout must be packed or jsonl, got {layout!r}")
        remote = None if teacher_alias is None else _remote_teacher(teacher_alias)
        if teacher_manifest is not None:
            if remote is None:
                raise _Refusal("invalid_option", "--teacher-manifest goes with --teacher-alias (a local --teacher's "
                                                 "config.json is read directly)")
            remote["manifest"] = _teacher_manifest(teacher_manifest)
        req = CaptureRequest(
            plan=str(plan_file.resolve()),
            teacher=f"remote:{teacher_alias}" if teacher is None else str(teacher.resolve()),
            tokenizer=str((tokenizer or teacher).resolve()),  # type: ignore[union-attr]
            dataset_root=str(dataset_root.resolve()),
            out=str(out.resolve()),
            device=device,
            examples_per_shard=_positive("examples-per-shard", examples_per_shard, 64),
            examples_per_payload=_positive("examples-per-payload", examples_per_payload, 16),
            batch_size=_positive("batch-size", batch_size, 8),
            layout=layout,
            progress=progress,
            teacher_remote=remote,
        )
        return run_capture(req)

    _run(body)


@app.command(cls=_Command)
def train(
    run: Path = typer.Argument(..., help="publication root of the run's shards"),
    student: Optional[Path] = typer.Option(None, "--student", help="local student checkpoint directory"),
    out: Optional[Path] = typer.Option(None, "--out", help="training directory (ledgers, checkpoints, adapter)"),
    full: bool = typer.Option(False, "--full", help="full fine-tuning instead of LoRA"),
    lora_r: Optional[str] = typer.Option(None, "--lora-r"),
    lr: Optional[str] = typer.Option(None, "--lr"),
    batch_size: Optional[str] = typer.Option(None, "--batch-size"),
    ce_weight: Optional[str] = typer.Option(None, "--ce-weight"),
    kd_weight: Optional[str] = typer.Option(None, "--kd-weight"),
    seed: Optional[str] = typer.Option(None, "--seed"),
    epochs: Optional[str] = typer.Option(None, "--epochs", help="commits per shard; >1 replays (chained plans only)"),
    device: str = typer.Option("cpu", "--device"),
    run_id: str = typer.Option("kd", "--run-id"),
    progress: bool = typer.Option(False, "--progress/--no-progress"),
) -> None:
    """Student-only sparse-KD training; each shard consumed exactly once through its ledger."""

    def body() -> dict[str, Any]:
        from kiln.distill.train import train_sparse_kd

        if student is None or out is None:
            raise _Refusal("missing_option", "--student DIR and --out DIR are required")
        return train_sparse_kd(
            run,
            student,
            out,
            run_id=run_id,
            lora=not full,
            lora_r=_positive("lora-r", lora_r, 8),
            lr=_float("lr", lr) or 1e-3,
            batch_size=_positive("batch-size", batch_size, 8),
            ce_weight=1.0 if ce_weight is None else _float("ce-weight", ce_weight),  # type: ignore[arg-type]
            kd_weight=1.0 if kd_weight is None else _float("kd-weight", kd_weight),  # type: ignore[arg-type]
            seed=0 if seed is None else _int("seed", seed),
            epochs=_positive("epochs", epochs, 1),
            device=device,
            progress=progress,
        )

    _run(body)


@app.command(cls=_Command)
def status(
    run: Path = typer.Argument(..., help="publication root of a capture run"),
    train_dir: Optional[Path] = typer.Option(
        None, "--train-dir", help="also report ledgers an older Kiln kept in a training dir"),
) -> None:
    """Shard transaction states (published and staging) and the capture's consumption states."""

    def body() -> dict[str, Any]:
        from kiln.distill.capture import shard_status

        if not run.is_dir():
            raise _Refusal("not_found", f"{run} is not a directory")
        from kiln.distill.consumption import consumption_dir
        from kiln.distill.train import ledger_status

        result = shard_status(run)
        result["ledgers"] = ledger_status(consumption_dir(run))  # consumption state lives with the capture
        if train_dir is not None:  # ledgers an older Kiln kept in a training directory
            result["train_dir_ledgers"] = ledger_status(train_dir / "ledgers")
        return result

    _run(body)
