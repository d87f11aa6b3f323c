"""Running untrusted Python for the ``code`` scorer (only with ``eval.allow_code_execution = true``).

What is enforced, in the child process, before the untrusted code runs:

* a fresh temporary working directory (deleted afterwards), ``HOME``/``TMPDIR`` pointing at it,
  an environment scrubbed to a handful of variables, ``python -I -S`` (isolated mode);
* **filesystem writes only inside that directory**: a Linux Landlock ruleset (ABI >= 1) handles
  every write-type access (write, truncate, create, remove, rename/link, make device/fifo/socket/
  symlink) and allows them beneath the working directory only. Reads are not restricted;
* **no network**: the child runs in a new network namespace (``unshare --net``, only loopback
  and down) when ``unshare`` works on this host, and Landlock (ABI >= 4) refuses TCP bind and
  connect in any case; with ABI >= 6 abstract UNIX sockets and signals to outside
  processes are refused too;
* rlimits: CPU seconds (``ceil(timeout)+1``), address space (``memory_mb``), file size (16 MiB),
  open files (64), no core dumps, and no new processes (``RLIMIT_NPROC = 0``; not effective for
  a root-owned worker, which the wall-clock kill below still covers);
* a wall-clock timeout: the child is its own process group (new session) and the whole group is
  SIGKILLed when the timeout passes; output is capped at 64 KiB.

When the kernel has no Landlock the scorer does not run the code: the sample fails with
``sandbox unavailable`` (never a weaker sandbox silently).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache

MAX_OUTPUT_BYTES = 64 * 1024
FSIZE_LIMIT = 16 * 1024 * 1024
NOFILE_LIMIT = 64
_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446  # same numbers on x86_64 and aarch64

# The child's prologue: rlimits, then Landlock, then exec of the untrusted file. Standard library only.
_PROLOGUE = r'''
import ctypes, os, resource, sys
workdir, cpu_s, mem_b, fsize_b, nofile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
resource.setrlimit(resource.RLIMIT_AS, (mem_b, mem_b))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_b, fsize_b))
resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
libc = ctypes.CDLL(None, use_errno=True)
abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
if abi < 1:
    sys.stderr.write("sandbox unavailable: no Landlock\n"); os._exit(97)
write = (1 << 1) | sum(1 << b for b in range(4, 13))  # WRITE_FILE, REMOVE_*, MAKE_*
if abi >= 2: write |= 1 << 13  # REFER
if abi >= 3: write |= 1 << 14  # TRUNCATE
net = (1 << 0) | (1 << 1) if abi >= 4 else 0  # BIND_TCP, CONNECT_TCP
scoped = (1 << 0) | (1 << 1) if abi >= 6 else 0  # abstract unix sockets, signals
attr = (ctypes.c_uint64 * 3)(write, net, scoped)
size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
fd = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
if fd < 0:
    sys.stderr.write("sandbox unavailable: landlock_create_ruleset failed\n"); os._exit(97)
class Beneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]
dfd = os.open(workdir, os.O_PATH | os.O_DIRECTORY)
rule = Beneath(write, dfd)
if libc.syscall(445, fd, 1, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
    sys.stderr.write("sandbox unavailable: landlock_add_rule failed\n"); os._exit(97)
os.close(dfd)
if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(446, fd, ctypes.c_uint32(0)) != 0:  # PR_SET_NO_NEW_PRIVS
    sys.stderr.write("sandbox unavailable: landlock_restrict_self failed\n"); os._exit(97)
os.close(fd)
del libc, attr, rule, Beneath
os.chdir(workdir)
sys.argv = ["candidate.py"]
src = open(os.path.join(workdir, "candidate.py"), encoding="utf-8").read()
exec(compile(src, "candidate.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''

SANDBOX_UNAVAILABLE_EXIT = 97


@dataclass(frozen=True)
class CodeResult:
    passed: bool
    exit_code: int | None
    timed_out: bool
    detail: str | None
    stdout: str
    stderr: str


@lru_cache(maxsize=1)
def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: unavailable)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        abi = libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except (OSError, AttributeError):
        return 0
    return max(0, int(abi))


@lru_cache(maxsize=1)
def _netns_prefix() -> tuple[str, ...]:
    """``unshare`` arguments that give the child an empty network namespace, if that works here."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    for prefix in ((exe, "--net"), (exe, "--user", "--map-root-user", "--net")):
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return prefix
    return ()


def isolation() -> dict[str, object]:
    """What this host enforces (recorded in run provenance and shown by GET /v1/evals/config)."""
    return {"landlock_abi": landlock_abi(), "network_namespace": bool(_netns_prefix())}


def run_python(code: str, *, timeout_s: float, memory_mb: int) -> CodeResult:
    """Run ``code`` in the sandbox described in the module docstring; passes on exit status 0."""
    if landlock_abi() < 1:
        return CodeResult(False, None, False, "sandbox unavailable: this kernel has no Landlock", "", "")
    workdir = tempfile.mkdtemp(prefix="kiln-eval-code-")
    try:
        os.chmod(workdir, 0o700)
        with open(os.path.join(workdir, "candidate.py"), "w", encoding="utf-8") as f:
            f.write(code)
        cpu = int(timeout_s) + 1
        cmd = [*_netns_prefix(), sys.executable, "-I", "-S", "-c", _PROLOGUE, workdir, str(cpu),
               str(memory_mb * 1024 * 1024), str(FSIZE_LIMIT), str(NOFILE_LIMIT)]
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            out, err = proc.communicate()
        _kill_group(proc.pid)  # anything the code left behind in its group
        stdout = out[:MAX_OUTPUT_BYTES].decode("utf-8", "replace")
        stderr = err[:MAX_OUTPUT_BYTES].decode("utf-8", "replace")
        rc = proc.returncode
        if timed_out:
            return CodeResult(False, rc, True, f"timed out after {timeout_s:g} s", stdout, stderr)
        if rc == SANDBOX_UNAVAILABLE_EXIT and stderr.startswith("sandbox unavailable"):
            return CodeResult(False, rc, False, stderr.strip(), stdout, stderr)
        detail = None if rc == 0 else (stderr.strip().splitlines() or [f"exit status {rc}"])[-1][:300]
        return CodeResult(rc == 0, rc, False, detail, stdout, stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
