#!/usr/bin/env bash
# Kiln's main job: set up the environment (idempotent), build the built-in model if
# missing, and start `kiln serve` on it. Extra arguments go to `kiln serve`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
venv="${KILN_VENV:-$root/.venv}"
"$venv/bin/kiln" model init >/dev/null
exec "$venv/bin/kiln" serve "$@"
