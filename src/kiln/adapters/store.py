"""The durable adapter store and its transactional publication.

Layout under the store root (``settings.adapters_path``)::

    <root>/.lock                               flock serialising every mutation
    <root>/.staging/<id>/ + <id>.lock          private work dirs; the flock on <id>.lock
                                               is held while the owner process lives (kiln.adapters.staging)
    <root>/.trash/                             directories being removed
    <root>/<name>/HEAD                         {"revision": R, "history": [older R, ...]}
    <root>/<name>/revisions/<R>/adapter_config.json
                              /adapter_model.safetensors
                              /kiln-manifest.json
                              /kiln-receipt.json       training jobs: how R was made (kiln.adapters.receipt)

A revision directory only ever appears through one ``rename`` of a fully written,
validated and fsynced staging directory, and an adapter only becomes visible (or
changes revision) through one atomic replacement of ``HEAD``. Killing the process
at any point therefore leaves either the old state or the complete new adapter;
:meth:`AdapterStore.cleanup` removes what a crash left behind (stale staging,
revisions no HEAD refers to, names whose first publication never reached HEAD).

Named fault points (``KILN_FAULT_POINT=<point>``) make the process exit with
status 137 at that step, so tests can kill publication at every step for real.
"""

from __future__ import annotations

import builtins
import fcntl
import os
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kiln.adapters.errors import AdapterIntegrityError, AdapterNotFound, InvalidAdapter
from kiln.adapters.manifest import (
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    NAME_RE,
    FileEntry,
    Manifest,
    check_name,
    is_valid_name,
    check_revision,
    read_store_file,
    utc_now,
)
from kiln.adapters.receipt import (
    RECEIPT_FILE,
    TRAINED_KINDS,
    bind,
    check_receipt,
    claims_sha256,
    locality_summary,
    read_receipt,
    store_receipt,
)
from kiln.adapters.staging import (
    ADAPTER_FILES,
    STAGING_DIR,
    Staging,
    flatten_staging,
    live_staging,
    remove_entry,
    remove_stale_stagings,
)
from kiln.adapters.validate import (
    CONFIG_FILE,
    base_weight_shapes,
    normalize_adapter_config,
    validate_lora_dir,
    write_adapter_config,
)
from kiln.canonical import (
    CanonicalJSONError,
    NotRegularFileError,
    atomic_publish_dir,
    atomic_write_bytes,
    atomic_write_json,
    is_lower_hex64,
    sha256_file,
    strict_json_loads,
)

FAULT_ENV = "KILN_FAULT_POINT"
FAULT_EXIT_CODE = 137
PUBLISH_FAULT_POINTS = ("after_validate", "after_manifest", "after_rename", "after_head")
DELETE_FAULT_POINTS = ("delete_after_trash",)
FAULT_POINTS = PUBLISH_FAULT_POINTS + DELETE_FAULT_POINTS

TRASH_DIR = ".trash"
LOCK_FILE = ".lock"
HEAD_FILE = "HEAD"
QUARANTINE_FILE = "quarantine.json"  # revisions whose load or canary failed: refused until cleared
QUARANTINE_SCHEMA = "kiln-adapter-quarantine-v1"
MAX_QUARANTINE_REASON = 500  # characters kept of the failure
REVISIONS_DIR = "revisions"
KEEP_PREVIOUS_REVISIONS = 2
MAX_HEAD_BYTES = 4096


def base_model_id(info: Any) -> str:
    """What stored configs name as ``base_model_name_or_path`` in place of a path: the base directory's name.

    It is the served model ID by default, and it does not depend on where the
    model (or ``$KILN_HOME``) lives, so identical weights get identical revisions.
    """
    return Path(info.path).name


def fault_point(point: str) -> None:
    """Exit abruptly (no cleanup, no atexit) if ``KILN_FAULT_POINT`` names this step."""
    if os.environ.get(FAULT_ENV) == point:
        os._exit(FAULT_EXIT_CODE)


@dataclass(frozen=True)
class AdapterRecord:
    name: str
    revision: str
    path: Path  # the revision directory: load it with PeftModel.from_pretrained(base, path)
    manifest: Manifest

    @property
    def size(self) -> int:
        return self.manifest.size

    def summary(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "name": self.name,
            "revision": self.revision,
            "base_model_sha256": m.base_model_sha256,
            "kind": m.kind,
            "parent_revision": m.parent_revision,
            "size_bytes": m.size,
            "created": m.created,
        }


@dataclass(frozen=True)
class CleanupReport:
    staging_removed: int = 0
    revisions_removed: int = 0
    names_removed: int = 0
    temp_files_removed: int = 0


class AdapterStore:
    """Adapters on disk: publication, lookup, verification, deletion, crash cleanup.

    Instances hold no state besides the root, so any number of them (in any number
    of processes) may share one root; mutations serialise on a file lock.
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root = self.root.resolve()
        (self.root / STAGING_DIR).mkdir(mode=0o700, exist_ok=True)
        (self.root / TRASH_DIR).mkdir(mode=0o700, exist_ok=True)

    # ------------------------------------------------------------------ locking
    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ staging
    def new_staging(self) -> Staging:
        """Reserve a fresh private directory for writing adapter files."""
        with self._locked():
            sid = uuid.uuid4().hex
            lock_path = self.root / STAGING_DIR / f"{sid}.lock"
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path = self.root / STAGING_DIR / sid
            path.mkdir(mode=0o700)
        return Staging(path, lock_path, fd)

    # -------------------------------------------------------------- publication
    def publish(
        self,
        staging: Staging | str | os.PathLike[str],
        *,
        name: str,
        base_model_sha256: str,
        kind: str,
        config: dict[str, Any],
        inputs_sha256: str | None = None,
        parent_revision: str | None = None,
        base_model_dir: Any,
        receipt: dict[str, Any] | None = None,
    ) -> AdapterRecord:
        """Validate the staged PEFT files, write the manifest and make them ``name``'s HEAD.

        ``base_model_dir`` is the base model directory (path) or an already computed
        :class:`kiln.runtime.loader.ModelDirInfo` (saves re-hashing the weights). Its
        identity must equal ``base_model_sha256``. ``staging`` may also be given as
        its path. On any validation error the staging directory is discarded and the
        store is unchanged.

        ``receipt``: a training job's claims (:func:`kiln.adapters.receipt.training_claims`). Their digest
        goes into ``config`` as ``receipt_sha256`` and the receipt bound to the new revision is written
        beside the manifest, so one rename publishes both.
        """
        from kiln.runtime.loader import ModelDirInfo, ModelLoadError, inspect_model_dir

        staging = live_staging(staging)
        if not isinstance(staging, Staging) or not staging.active:
            raise InvalidAdapter(f"{staging} is not a live staging directory from new_staging() in this process")
        if staging.path.parent != self.root / STAGING_DIR:
            raise InvalidAdapter(f"{staging.path} does not belong to the store at {self.root}")
        try:
            check_name(name)
            check_revision(base_model_sha256, "base_model_sha256")
            if isinstance(base_model_dir, ModelDirInfo):
                info = base_model_dir
            else:
                try:
                    info = inspect_model_dir(base_model_dir)
                except ModelLoadError as exc:
                    raise InvalidAdapter(f"base model: {exc}") from exc
            if info.base_model_sha256 != base_model_sha256:
                raise InvalidAdapter(
                    f"base_model_sha256 {base_model_sha256} does not match the base model at {info.path} "
                    f"({info.base_model_sha256})",
                    hint="Publish against the base model the adapter was trained on.",
                )
            flatten_staging(staging.path)
            summary = validate_lora_dir(staging.path, base_weight_shapes(info.path))
            # No filesystem paths in stored configs (identity must not depend on $KILN_HOME), and no
            # patterns PEFT would run through Python's backtracking `re` when it loads the adapter.
            normalized = normalize_adapter_config(summary.config, summary.modules, base_model_id(info))
            if normalized is not None:
                write_adapter_config(staging.path / CONFIG_FILE, normalized)
            fault_point("after_validate")

            files = []
            for fname in sorted(ADAPTER_FILES):
                digest, size = sha256_file(staging.path / fname)
                files.append(FileEntry(fname, size, digest))
            if receipt is not None:
                config = {**config, "receipt_sha256": claims_sha256(receipt)}
            manifest = Manifest.build(
                name=name,
                files=files,
                base_model_sha256=base_model_sha256,
                kind=kind,
                config=config,
                inputs_sha256=inputs_sha256,
                parent_revision=parent_revision,
            )
            manifest_bytes = manifest.to_bytes()
            atomic_write_bytes(staging.path / MANIFEST_FILE, manifest_bytes, mode=0o600)
            if receipt is not None:
                store_receipt(staging.path / RECEIPT_FILE, bind(receipt, manifest, manifest_bytes))
            fault_point("after_manifest")

            with self._locked():
                name_dir = self.root / name
                final = name_dir / REVISIONS_DIR / manifest.revision
                old = self._read_head(name)
                if final.is_dir():
                    shutil.rmtree(staging.path)  # identical content is already stored
                else:
                    (name_dir / REVISIONS_DIR).mkdir(mode=0o700, parents=True, exist_ok=True)
                    atomic_publish_dir(staging.path, final)
                    fault_point("after_rename")
                history: list[str] = []
                if old is not None:
                    history = [r for r in [old[0], *old[1]] if r != manifest.revision]
                head = {"revision": manifest.revision, "history": history[:KEEP_PREVIOUS_REVISIONS]}
                atomic_write_json(name_dir / HEAD_FILE, head, mode=0o600)
                fault_point("after_head")
                self._prune_revisions(name_dir, {head["revision"], *head["history"]})
        except BaseException:
            staging.discard()
            raise
        staging._release()
        self.cleanup()
        return self._load_record(name, manifest.revision)

    # ------------------------------------------------------------------- reading
    def _read_head(self, name: str) -> tuple[str, list[str]] | None:
        path = self.root / name / HEAD_FILE
        try:
            data = read_store_file(path, limit=MAX_HEAD_BYTES, error=AdapterIntegrityError)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            obj = strict_json_loads(data) if len(data) <= MAX_HEAD_BYTES else None
        except CanonicalJSONError:
            obj = None
        if not isinstance(obj, dict) or set(obj) != {"revision", "history"} or not isinstance(obj["history"], list) \
                or not all(is_lower_hex64(r) for r in [obj["revision"], *obj["history"]]):
            raise AdapterIntegrityError(f"{path} is corrupt")
        return obj["revision"], list(obj["history"])

    def _load_record(self, name: str, revision: str) -> AdapterRecord:
        rev_dir = self.root / name / REVISIONS_DIR / revision
        mpath = rev_dir / MANIFEST_FILE
        try:
            data = read_store_file(mpath, limit=MAX_MANIFEST_BYTES, error=AdapterIntegrityError)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise AdapterNotFound(f"adapter {name!r} has no revision {revision}") from exc
        try:
            manifest = Manifest.from_bytes(data)
        except InvalidAdapter as exc:
            raise AdapterIntegrityError(f"adapter {name!r} revision {revision}: {exc.message}") from exc
        if manifest.name != name or manifest.revision != revision:
            raise AdapterIntegrityError(
                f"manifest in {rev_dir} names {manifest.name!r}@{manifest.revision}, not {name!r}@{revision}"
            )
        return AdapterRecord(name=name, revision=revision, path=rev_dir, manifest=manifest)

    def get(self, name: str, revision: str | None = None) -> AdapterRecord:
        """The record of ``name`` at HEAD (or at a retained earlier ``revision``)."""
        check_name(name)
        head = self._read_head(name)
        if head is None:
            raise AdapterNotFound(f"no adapter named {name!r}")
        if revision is not None:
            check_revision(revision)
            if revision not in (head[0], *head[1]):
                raise AdapterNotFound(f"adapter {name!r} has no retained revision {revision}")
        return self._load_record(name, revision or head[0])

    # ------------------------------------------------------------------ quarantine
    def quarantine(self, name: str, revision: str, reason: str) -> None:
        """Mark ``revision`` of ``name`` quarantined (its load or canary failed): activation refuses it
        until :meth:`clear_quarantine`. Kept in ``<name>/quarantine.json`` (0600, atomic, under the lock)."""
        check_name(name)
        check_revision(revision)
        with self._locked():
            marks = self.quarantined(name)
            marks[revision] = {"reason": reason[:MAX_QUARANTINE_REASON], "at": utc_now()}
            self._write_quarantine(name, marks)

    def quarantined(self, name: str) -> dict[str, dict[str, str]]:
        """``{revision: {"reason", "at"}}`` of ``name``'s quarantined revisions (``{}`` when none)."""
        path = self.root / name / QUARANTINE_FILE
        try:
            data = read_store_file(path, limit=MAX_HEAD_BYTES * 64, error=AdapterIntegrityError)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        try:
            obj = strict_json_loads(data)
        except CanonicalJSONError:
            obj = None
        marks = obj.get("revisions") if isinstance(obj, dict) and obj.get("schema") == QUARANTINE_SCHEMA else None
        if not isinstance(marks, dict):
            raise AdapterIntegrityError(f"{path} is corrupt")
        return marks

    def clear_quarantine(self, name: str, revision: str | None = None) -> list[str]:
        """Lift the quarantine of ``revision`` (default: every revision of ``name``); returns those lifted."""
        check_name(name)
        with self._locked():
            marks = self.quarantined(name)
            lifted = [r for r in marks if revision is None or r == revision]
            for r in lifted:
                del marks[r]
            if lifted:
                self._write_quarantine(name, marks)
        return lifted

    def _write_quarantine(self, name: str, marks: dict[str, dict[str, str]]) -> None:
        path = self.root / name / QUARANTINE_FILE
        if not marks:
            path.unlink(missing_ok=True)
            return
        atomic_write_json(path, {"schema": QUARANTINE_SCHEMA, "revisions": marks}, mode=0o600)

    def has(self, name: str) -> bool:
        """Whether ``name`` is a stored adapter with a HEAD (a cheap check: no manifest read)."""
        return is_valid_name(name) and (self.root / name / HEAD_FILE).is_file()

    def list(self) -> list[AdapterRecord]:
        return self.scan()[0]

    def scan(self) -> tuple[builtins.list[AdapterRecord], builtins.list[dict[str, str]]]:
        """Every stored adapter at HEAD, and apart from them each one whose HEAD or manifest cannot be read
        (``{"name", "error"}``: a FIFO or directory in a file's place, damaged JSON): one damaged adapter
        never hides the rest."""
        records, damaged = [], []
        for entry in sorted(self.root.iterdir()):
            if not NAME_RE.fullmatch(entry.name) or not entry.is_dir():
                continue  # the store's own dot-dirs, or something not put here by Kiln
            try:
                records.append(self.get(entry.name))
            except AdapterNotFound:
                continue  # deleted meanwhile, or a first publication that never reached HEAD
            except AdapterIntegrityError as exc:
                damaged.append({"name": entry.name, "error": exc.message})
        return records, damaged

    def verify(self, name: str, revision: str | None = None) -> AdapterRecord:
        """Re-hash every file against the manifest; raise :class:`AdapterIntegrityError` on any mismatch."""
        record = self.get(name, revision)
        problems = []
        expected = {f.path: f for f in record.manifest.files}
        present = {p.name for p in record.path.iterdir()} - {MANIFEST_FILE, RECEIPT_FILE}
        for extra in sorted(present - set(expected)):
            problems.append(f"unexpected file {extra}")
        for fname, entry in sorted(expected.items()):
            path = record.path / fname
            try:
                digest, size = sha256_file(path)
            except FileNotFoundError:
                problems.append(f"{fname} is missing")
                continue
            except OSError as exc:  # a FIFO, directory, device or symlink (NotRegularFileError), unreadable
                problems.append(f"{fname} is not a regular file" if isinstance(exc, NotRegularFileError)
                                else f"{fname} cannot be read: {exc.strerror or exc}")
                continue
            if size != entry.size:
                problems.append(f"{fname} has {size} bytes, manifest says {entry.size}")
            elif digest != entry.sha256:
                problems.append(f"{fname} sha256 {digest} differs from the manifest's {entry.sha256}")
        if problems:
            raise AdapterIntegrityError(f"adapter {name!r} revision {record.revision}: " + "; ".join(problems))
        return record

    def verify_receipt(self, record: AdapterRecord) -> dict[str, Any] | None:
        """The revision's training receipt, checked to bind to it (:func:`kiln.adapters.receipt.check_receipt`);
        None for a kind no training job publishes (upload, merge). A trained revision without one, or with one
        that does not bind, raises :class:`AdapterIntegrityError` naming every mismatch."""
        path = record.path / RECEIPT_FILE
        if not path.exists() and record.manifest.kind not in TRAINED_KINDS:
            return None
        where = f"adapter {record.name!r} revision {record.revision}"
        try:
            body = read_receipt(path)
        except AdapterIntegrityError as exc:
            raise AdapterIntegrityError(f"{where}: {exc.message}", hint="revisions trained before receipts "
                                        "existed have none; retrain to get one") from None
        manifest_bytes = read_store_file(record.path / MANIFEST_FILE, limit=MAX_MANIFEST_BYTES,
                                         error=AdapterIntegrityError)
        problems = check_receipt(body, record.manifest, manifest_bytes)
        if problems:
            raise AdapterIntegrityError(f"{where}: {RECEIPT_FILE}: " + "; ".join(problems))
        return body

    def receipt_summary(self, record: AdapterRecord) -> dict[str, Any] | None:
        """What a listing shows of the revision's receipt: None for a kind without one (upload, merge), else
        ``verified`` and, when it binds, the job, the teacher's fingerprint (OPD's kiln-teacher-v1, KD's capture
        teacher digest), the gate verdict and the locality figures (:func:`kiln.adapters.receipt.locality_summary`;
        None in receipts written before jobs measured it);
        when it does not, ``error`` naming why (:meth:`verify_receipt`)."""
        try:
            body = self.verify_receipt(record)
        except AdapterIntegrityError as exc:
            return {"verified": False, "error": exc.message, "job_id": None, "teacher_fingerprint": None,
                    "gate": None, "locality": None}
        if body is None:
            return None
        teacher = body.get("teacher") if isinstance(body.get("teacher"), dict) else {}
        gate = body.get("gate") if isinstance(body.get("gate"), dict) else {}
        return {"verified": True, "error": None, "job_id": body.get("job_id"),
                "teacher_fingerprint": teacher.get("fingerprint") or teacher.get("fingerprint_sha256"),
                "gate": gate.get("verdict"), "locality": locality_summary(body.get("locality"))}

    def record_gate(self, name: str, revision: str, verdict: dict[str, Any]) -> None:
        """Add a post-train gate's verdict to the revision's receipt (one atomic rewrite, under the lock)."""
        with self._locked():
            record = self.get(name, revision)
            body = self.verify_receipt(record)
            if body is not None:
                store_receipt(record.path / RECEIPT_FILE, {**body, "gate": verdict})

    # ------------------------------------------------------------------ removal
    def _to_trash(self, path: Path) -> None:
        """Atomically move ``path`` out of sight, then remove it."""
        target = self.root / TRASH_DIR / f"{path.name}-{uuid.uuid4().hex}"
        os.rename(path, target)
        shutil.rmtree(target, ignore_errors=True)

    def _prune_revisions(self, name_dir: Path, keep: set[str]) -> int:
        removed = 0
        rev_root = name_dir / REVISIONS_DIR
        if not rev_root.is_dir():
            return 0
        for rev in rev_root.iterdir():
            if rev.name not in keep:
                self._to_trash(rev)
                removed += 1
        return removed

    def delete(self, name: str) -> AdapterRecord | None:
        """Remove an adapter with all its revisions; returns the record that was HEAD.

        Callers that serve adapters must refuse this while the adapter is active. A damaged one (its HEAD or
        manifest unreadable) is removed too, and ``None`` returned for its record.
        """
        try:
            record: AdapterRecord | None = self.get(name)
        except AdapterIntegrityError:
            record = None
        with self._locked():
            target = self.root / TRASH_DIR / f"{name}-{uuid.uuid4().hex}"
            try:
                os.rename(self.root / name, target)
            except FileNotFoundError as exc:
                raise AdapterNotFound(f"no adapter named {name!r}") from exc
            fault_point("delete_after_trash")
            shutil.rmtree(target, ignore_errors=True)
        return record

    def cleanup(self) -> CleanupReport:
        """Remove what interrupted operations left behind. Safe to run at any time."""
        staging_removed = revisions_removed = names_removed = temps_removed = 0
        with self._locked():
            staging_removed = remove_stale_stagings(self.root / STAGING_DIR)
            for entry in (self.root / TRASH_DIR).iterdir():
                remove_entry(entry)
            for name_dir in self.root.iterdir():
                if name_dir.name.startswith(".") or not name_dir.is_dir():
                    continue
                for tmp in name_dir.glob(f".{HEAD_FILE}.*.tmp"):
                    tmp.unlink()
                    temps_removed += 1
                try:
                    head = self._read_head(name_dir.name)
                except AdapterIntegrityError:
                    continue  # leave corrupt state for a human; get() reports it
                if head is None:
                    self._to_trash(name_dir)  # first publication died before HEAD
                    names_removed += 1
                else:
                    revisions_removed += self._prune_revisions(name_dir, {head[0], *head[1]})
        return CleanupReport(staging_removed, revisions_removed, names_removed, temps_removed)
