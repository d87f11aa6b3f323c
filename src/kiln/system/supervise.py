"""Supervision of the vLLM process group: signal forwarding and draining.

``detached`` (default): vLLM starts in a new session whose process group the
launcher owns; SIGINT/SIGTERM/SIGHUP/SIGQUIT are forwarded to that group, and
after vLLM exits every remaining member is terminated (SIGTERM, then SIGKILL).

``inherited`` (Linux only): the launcher must already lead an isolated process
group made by a benchmark driver; vLLM joins it, and draining signals every
peer of the group but never the launcher itself.

Before a child exists a forwarded signal raises :class:`LaunchInterrupted`, so
staging unwinds through the caller's cleanup. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Mapping, Sequence

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
DRAIN_TERM_SECONDS = 10.0
DRAIN_KILL_SECONDS = 10.0
DRAIN_POLL_SECONDS = 0.05
PR_SET_CHILD_SUBREAPER = 36
MODES = ("detached", "inherited")


class SupervisionError(RuntimeError):
    """vLLM could not be started, or its process group could not be drained."""


class LaunchInterrupted(BaseException):
    """A forwarded signal arrived before vLLM started; cleanup runs, then the launcher exits."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name} before vLLM started")


def check_inherited_mode() -> None:
    """Inherited mode needs Linux and a launcher that already leads its own process group."""
    if not sys.platform.startswith("linux"):
        raise SupervisionError("--process-group-mode=inherited is Linux-only; use detached")
    if os.getpgrp() != os.getpid():
        raise SupervisionError(
            "--process-group-mode=inherited requires the launcher to lead an isolated process group "
            "(the benchmark driver must create it, e.g. setsid or process_group=0); use detached otherwise"
        )


def group_members(pgid: int, *, exclude: int | None = None) -> list[int]:
    """Live (non-zombie) processes of group ``pgid``; on non-Linux, [pgid] while the group exists."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read(4096)
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        if len(fields) < 3:
            continue
        state, pgrp = fields[0], int(fields[2])
        pid = int(entry)
        if pgrp == pgid and state != b"Z" and pid != exclude:
            out.append(pid)
    return out


def _become_subreaper() -> None:
    """Adopt orphaned descendants so their exit can be reaped (best effort, Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class Supervisor:
    """Owns signal handling from before staging until the process group is drained."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise SupervisionError(f"process-group mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.proc: subprocess.Popen[bytes] | None = None
        self.received: list[int] = []
        self._spawning = False
        self._cleaning = False
        self._previous: dict[int, object] = {}

    # -- signals
    def install(self) -> None:
        _become_subreaper()
        for sig in FORWARDED_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def begin_cleanup(self) -> None:
        """From now on a signal is only recorded (and forwarded), so cleanup cannot be cut short."""
        self._cleaning = True

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.received.append(signum)
        if self.proc is not None:
            self._forward(signum)
        elif not (self._spawning or self._cleaning) and len(self.received) == 1:
            raise LaunchInterrupted(signum)  # only once: a second signal must not cut the unwinding short

    def _forward(self, signum: int) -> None:
        assert self.proc is not None
        if self.mode == "detached":
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass
        else:
            self._signal_peers(signum)

    def _signal_peers(self, signum: int) -> None:
        for pid in group_members(os.getpgrp(), exclude=os.getpid()):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    # -- lifecycle
    def spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self._spawning = True
        try:
            self.proc = subprocess.Popen(
                list(argv),
                cwd="/",
                env=dict(env),
                stdin=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=self.mode == "detached",
            )
        except OSError as exc:
            raise SupervisionError(f"could not start vLLM ({argv[0]}): {exc}") from exc
        finally:
            self._spawning = False
        for signum in list(self.received):
            self._forward(signum)

    def wait(self) -> int:
        """Wait for vLLM's main process; return a shell-style exit status."""
        assert self.proc is not None
        code = self.proc.wait()
        return 128 - code if code < 0 else code

    def drain(self) -> None:
        """Terminate every remaining member of the group (never the launcher itself)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._send_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=DRAIN_TERM_SECONDS)
            except subprocess.TimeoutExpired:
                self._send_group(signal.SIGKILL)
                self.proc.wait()
        for sig, budget in ((signal.SIGTERM, DRAIN_TERM_SECONDS), (signal.SIGKILL, DRAIN_KILL_SECONDS)):
            if not self._members():
                return
            self._send_group(sig)
            deadline = time.monotonic() + budget
            while time.monotonic() < deadline:
                _reap()
                if not self._members():
                    return
                time.sleep(DRAIN_POLL_SECONDS)
        left = self._members()
        if left:
            raise SupervisionError(f"processes {left} of the vLLM group survived SIGKILL")

    def _pgid(self) -> int:
        assert self.proc is not None
        return self.proc.pid if self.mode == "detached" else os.getpgrp()

    def _members(self) -> list[int]:
        return group_members(self._pgid(), exclude=os.getpid())

    def _send_group(self, signum: int) -> None:
        if self.mode == "detached":
            try:
                os.killpg(self._pgid(), signum)
            except ProcessLookupError:
                pass
        else:
            self._signal_peers(signum)
