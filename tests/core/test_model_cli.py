from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

KILN = [sys.executable, "-m", "kiln.cli"]


def _kiln(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KILN, *args], capture_output=True, text=True, timeout=300, env=env)


def test_model_init_builds_then_reuses(tmp_path: Path) -> None:
    env = {**os.environ, "KILN_HOME": str(tmp_path / "home")}
    first = _kiln("model", "init", env=env)
    assert first.returncode == 0, first.stderr
    built = json.loads(first.stdout)
    assert built["built"] is True and built["seconds"] > 0
    assert Path(built["path"]) == tmp_path / "home" / "models" / "kiln-builtin-v1"
    again = json.loads(_kiln("model", "init", env=env).stdout)
    assert again["built"] is False and again["base_model_sha256"] == built["base_model_sha256"]


def test_model_inspect_reports_identity_and_refusals(builtin_model_dir: Path, tmp_path: Path) -> None:
    ok = _kiln("model", "inspect", str(builtin_model_dir))
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["base_model_sha256"]) == 64
    bad = _kiln("model", "inspect", "someorg/somemodel")
    assert bad.returncode == 2
    assert json.loads(bad.stdout)["error"]["code"] == "model_refused"
    assert "Traceback" not in bad.stderr
