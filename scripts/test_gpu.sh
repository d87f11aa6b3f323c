#!/usr/bin/env bash
# The GPU lane: training (SFT and GRPO) on CUDA, bf16 where the device supports it.
# Tests marked `gpu` skip themselves without CUDA; the default lane never needs a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" -m pytest -m gpu -q -rs "$@"
