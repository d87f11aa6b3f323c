"""`kiln demo` end to end, as the README tells a newcomer to run it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kiln.runtime.builtin import BUILTIN_NAME

KILN = Path(sys.executable).with_name("kiln")


def test_demo_learns_the_correction(builtin_model_dir: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    shutil.copytree(builtin_model_dir, home / "models" / BUILTIN_NAME)  # skip the ~20 s build
    env = {**os.environ, "KILN_HOME": str(home)}
    proc = subprocess.run([str(KILN), "demo"], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    before, _, after = out.partition("correcting it:")
    assert "A (kiln-builtin-v1):" in before and "An ant has six legs." not in before
    corrected = [line for line in after.splitlines() if line.startswith("A (demo-correction @ ")]
    assert corrected and corrected[0].endswith("An ant has six legs."), out
    assert "submit -> corrected answer" in out
    assert "warning" not in out
    # the other half of what the user sees: the model's other answers kept (the job's probes, and a control)
    assert "locality: 11 of 11 probe answers unchanged" in out, out
    control = [line for line in after.splitlines() if line.startswith("A (demo-correction): ")]
    assert control == ["A (demo-correction): The capital of France is Paris.  [unchanged]"], out
