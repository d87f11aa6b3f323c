#!/usr/bin/env bash
# Idempotent environment setup for Kiln: creates .venv and installs the package.
# On a machine without an NVIDIA GPU, torch comes from the pinned CPU build first,
# so the unpinned dependency resolution never pulls a multi-GB CUDA wheel.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${KILN_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
stamp="$venv/.kiln-install-stamp"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/kiln" ]; then
  exit 0
fi
echo "kiln: setting up $venv (one time, a few minutes)" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" install torch
  else
    "${pip[@]}" install 'torch==2.13.0'
  fi
fi
"${pip[@]}" install -e '.[dev]'  # dev extra: pytest, ..., playwright (tests/ui use the system chromium)
echo "$want" > "$stamp"
