"""Start `kiln serve` (and other `kiln` commands) for tests by forking a process that has already
imported the heavy stack, instead of exec'ing a fresh interpreter each time.

Every test server is a real process running the real `kiln` entry point (`kiln.cli.main`) with its
own environment, working directory and log file; only the interpreter start-up and the imports of
torch, transformers and the server (about 4-5 s of CPU per server on a 2-core machine, most of the
test lane's subprocess time) are paid once per test worker. A request is forked only when it can be
answered exactly as an exec would: the command is `kiln ...` on this interpreter, and it goes to a
zygote that was itself started with the request's environment, apart from `KILN_*` variables and
pytest's per-test `PYTEST_CURRENT_TEST` (Kiln reads its own variables when a command runs; anything
read at import time, such as `ATEN_CPU_CAPABILITY`, `OMP_NUM_THREADS` or `HF_*`, gets its own zygote,
at most three per worker, then `subprocess.Popen`). The zygote
refuses to fork while it runs a second Python thread (torch's native helper
threads are fork-safe: DataLoader forks its workers the same way). `KILN_TEST_FORK=0` turns it off.

Protocol (one SOCK_SEQPACKET socket pair): {"op": "spawn", args, env, cwd} with the log file's
descriptor attached -> {"pid"}; {"op": "poll", pid} -> {"code": int | null}. The forked server is the
zygote's child; its exit status is read through the zygote (`ForkedProcess` mirrors the parts of
`subprocess.Popen` the tests use).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

KILN_SCRIPT = Path(sys.executable).with_name("kiln")
_IMPORT_TIME_PREFIXES = ("KILN_", "PYTEST_CURRENT_TEST")  # the only variables a forked server may see differently
_MAX_MSG = 1 << 20


# ------------------------------------------------------------------ the zygote process (python -m tests.zygote FD)
def _preload() -> None:
    import kiln.cli  # noqa: F401
    import kiln.serving.app  # noqa: F401
    import kiln.serving.cli  # noqa: F401
    import kiln.serving.state  # noqa: F401
    import kiln.runtime.engine  # noqa: F401
    import kiln.runtime.loader  # noqa: F401
    import kiln.training.queue.service  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.qwen3 import modeling_qwen3  # noqa: F401  (the built-in model's family)
    import uvicorn  # noqa: F401


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (a test worker that dies leaves no zygote,
    a zygote that dies leaves no server)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _child(sock: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
    """In the forked process: become `kiln <args>` and exit the way the interpreter would."""
    code: Any = 1
    try:
        _die_with_parent()
        sock.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if req.get("cwd"):
            os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        out = fds[0] if fds else os.open(os.devnull, os.O_WRONLY)
        os.dup2(out, 1)
        os.dup2(fds[1] if len(fds) > 1 else out, 2)
        for fd in fds:
            os.close(fd)
        sys.argv = ["kiln", *req["args"]]
        from kiln.cli import main

        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - report like an uncaught exception would
        import traceback

        traceback.print_exc()
        code = 1
    sys.exit(code)  # normal interpreter shutdown: atexit handlers, flushed streams


def _serve(fd: int) -> None:
    _die_with_parent()
    _preload()
    sock = socket.socket(fileno=fd)
    children: dict[int, int | None] = {}
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 4)
        except OSError:
            break
        if not msg:
            break
        req = json.loads(msg)
        if req["op"] == "spawn":
            if threading.active_count() > 1:  # (torch's own native helper threads are fork-safe, as for DataLoader workers)
                for f in fds:
                    os.close(f)
                sock.send(json.dumps({"error": "the zygote runs more than one thread"}).encode())
                continue
            pid = os.fork()
            if pid == 0:
                _child(sock, req, fds)
            for f in fds:
                os.close(f)
            children[pid] = None
            sock.send(json.dumps({"pid": pid}).encode())
        elif req["op"] == "poll":
            pid = int(req["pid"])
            if children.get(pid) is None and pid in children:
                try:
                    got, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    got, status = 0, 0
                if got == pid:
                    children[pid] = os.waitstatus_to_exitcode(status)
            sock.send(json.dumps({"code": children.get(pid)}).encode())
    for pid, code in children.items():  # the test worker went away: leave no server behind
        if code is None:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


# ------------------------------------------------------------------ the test side
class ForkedProcess:
    """The parts of :class:`subprocess.Popen` tests use, for a server forked by the zygote."""

    def __init__(self, zygote: "_Zygote", pid: int, args: list[str]):
        self._zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.stdout = self.stderr = self.stdin = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.poll(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> "ForkedProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.poll() is None:
            self.kill()
        self.wait()


class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], cwd=Path(__file__).resolve().parents[1],
                                     stdin=subprocess.DEVNULL, env=self.env)
        theirs.close()
        self.sock = mine
        self.lock = threading.Lock()
        atexit.register(self.close)

    def _ask(self, req: dict[str, Any], fds: list[int] = ()) -> dict[str, Any]:  # type: ignore[assignment]
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(req).encode()], list(fds))
            reply = self.sock.recv(_MAX_MSG)
        if not reply:
            raise RuntimeError("the test zygote exited")
        return json.loads(reply)

    def spawn(self, args: list[str], env: dict[str, str], cwd: str | None, fds: list[int]) -> int | None:
        reply = self._ask({"op": "spawn", "args": args, "env": env, "cwd": cwd}, fds)
        return reply.get("pid")

    def poll(self, pid: int) -> int | None:
        return self._ask({"op": "poll", "pid": pid})["code"]

    def close(self) -> None:
        try:
            self.sock.close()
            self.proc.wait(30)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


MAX_ZYGOTES = 3  # per test worker: one per distinct import-time environment, then plain Popen
_zygotes: dict[frozenset[tuple[str, str]], _Zygote] = {}
_zygote_lock = threading.Lock()


def _import_time_env(env: dict[str, str]) -> frozenset[tuple[str, str]]:
    return frozenset((k, v) for k, v in env.items() if not k.startswith(_IMPORT_TIME_PREFIXES))


def _zygote_for(env: dict[str, str]) -> _Zygote | None:
    """The zygote whose interpreter started with ``env``'s import-time variables (started on first use)."""
    key = _import_time_env(env)
    with _zygote_lock:
        zygote = _zygotes.get(key)
        if zygote is not None and zygote.proc.poll() is not None:
            zygote = None
        if zygote is None:
            if len(_zygotes) >= MAX_ZYGOTES and key not in _zygotes:
                return None
            zygote = _zygotes[key] = _Zygote(env)
        return zygote


def _kiln_args(cmd: list[str]) -> list[str] | None:
    """The `kiln` arguments of ``cmd`` when it runs the `kiln` entry point on this interpreter."""
    cmd = [str(c) for c in cmd]
    if cmd and cmd[0] == str(KILN_SCRIPT):
        return cmd[1:]
    if cmd[:3] == [sys.executable, "-m", "kiln.cli"]:
        return cmd[3:]
    return None


def _fileno(stream: Any) -> int | None:
    if stream is None or stream == subprocess.DEVNULL:
        return None
    if isinstance(stream, int):
        return stream if stream >= 0 else None
    return stream.fileno()


def popen(cmd: list[Any], *, env: dict[str, str] | None = None, stdout: Any = None, stderr: Any = None,
          cwd: Any = None, **kwargs: Any) -> subprocess.Popen | ForkedProcess:
    """``subprocess.Popen(cmd, ...)``, forked from the zygote when that is exactly equivalent."""
    env = dict(os.environ) if env is None else dict(env)
    args = _kiln_args(cmd)
    forkable = (os.environ.get("KILN_TEST_FORK", "1") != "0" and args is not None and not kwargs
                and stdout is not subprocess.PIPE and stderr not in (subprocess.PIPE,)
                and sys.platform == "linux")
    zygote = _zygote_for(env) if forkable else None
    if zygote is None:
        return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, cwd=cwd, **kwargs)
    for stream in (stdout, stderr):
        if hasattr(stream, "flush"):
            stream.flush()
    out = _fileno(stdout)
    err = out if stderr == subprocess.STDOUT else _fileno(stderr)
    fds = [fd for fd in (out, err) if fd is not None]
    null = None
    if out is None and err is not None:  # keep the positions: stdout to /dev/null, stderr to its file
        null = os.open(os.devnull, os.O_WRONLY)
        fds = [null, err]
    try:
        pid = zygote.spawn(args, env, None if cwd is None else str(cwd), fds)
    except (OSError, RuntimeError):  # the zygote died (e.g. an import failed there): exec as usual
        pid = None
    finally:
        if null is not None:
            os.close(null)
    if pid is None:
        return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, cwd=cwd, **kwargs)
    return ForkedProcess(zygote, pid, [str(c) for c in cmd])


def kiln_server(home: Path | None, **kwargs: Any):
    """:func:`kiln.demo.kiln_server`, started through :func:`popen`."""
    from kiln.demo import kiln_server as demo_server

    return demo_server(home, popen=popen, **kwargs)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
