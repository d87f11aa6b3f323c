"""The test harness's forked `kiln` processes (tests.zygote) behave as exec'd ones: the command's own
environment, working directory, output file, exit status and signals; anything the zygote cannot
reproduce exactly runs through subprocess.Popen."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests import zygote


@pytest.fixture
def fork_enabled(monkeypatch):
    monkeypatch.delenv("KILN_TEST_FORK", raising=False)


def test_forked_kiln_command_gets_its_env_cwd_output_and_exit_status(tmp_path, fork_enabled):
    log = open(tmp_path / "out.log", "wb")
    env = dict(os.environ, KILN_HOME=str(tmp_path / "home"))
    proc = zygote.popen([str(zygote.KILN_SCRIPT), "version"], env=env, stdout=log, stderr=subprocess.STDOUT,
                        cwd=tmp_path)
    assert isinstance(proc, zygote.ForkedProcess)
    assert proc.wait(60) == 0
    out = (tmp_path / "out.log").read_text()
    from kiln import __version__

    assert __version__ in out
    bad = zygote.popen([sys.executable, "-m", "kiln.cli", "no-such-command"], env=env, stdout=log,
                       stderr=subprocess.STDOUT)
    assert isinstance(bad, zygote.ForkedProcess)
    assert bad.wait(60) == 2  # typer's usage error, as from the console script
    assert "No such command" in (tmp_path / "out.log").read_text()


def test_forked_process_receives_signals(tmp_path, fork_enabled):
    log = open(tmp_path / "serve.log", "wb")
    env = dict(os.environ, KILN_HOME=str(tmp_path / "home"))
    proc = zygote.popen([str(zygote.KILN_SCRIPT), "serve", "--host", "127.0.0.1", "--port", "0"], env=env,
                        stdout=log, stderr=subprocess.STDOUT)
    try:
        assert isinstance(proc, zygote.ForkedProcess)
        assert proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:  # never leave a server behind, whatever failed above
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)


def test_an_import_time_variable_gets_its_own_zygote(tmp_path, fork_enabled):
    env = dict(os.environ, KILN_TEST_ZYGOTE_PROBE="1", KILN_HOME=str(tmp_path))
    plain = zygote.popen([str(zygote.KILN_SCRIPT), "version"], env=env, stdout=subprocess.DEVNULL)
    threads = "3" if os.environ.get("OMP_NUM_THREADS") != "3" else "2"  # differs from this process's value
    other = dict(env, OMP_NUM_THREADS=threads)  # read when the runtime starts: not from the first zygote
    proc = zygote.popen([str(zygote.KILN_SCRIPT), "version"], env=other, stdout=subprocess.DEVNULL)
    assert plain.wait(60) == 0 and proc.wait(60) == 0
    if isinstance(proc, zygote.ForkedProcess):
        assert isinstance(plain, zygote.ForkedProcess) and proc._zygote is not plain._zygote
        assert proc._zygote.env["OMP_NUM_THREADS"] == threads


def test_what_a_fork_cannot_reproduce_runs_through_popen(tmp_path, fork_enabled):
    piped = zygote.popen([str(zygote.KILN_SCRIPT), "version"], stdout=subprocess.PIPE)
    assert isinstance(piped, subprocess.Popen)
    assert piped.communicate(timeout=60)[0]
    other = zygote.popen([sys.executable, "-c", "print(1)"], stdout=subprocess.DEVNULL)
    assert isinstance(other, subprocess.Popen) and other.wait(60) == 0
