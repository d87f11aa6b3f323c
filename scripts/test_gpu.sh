#!/usr/bin/env bash
# The GPU lane: training (SFT and GRPO) on CUDA, bf16 where the device supports it; the engine on CUDA; a hybrid
# on flash-linear-attention's kernels (tests/runtime/test_hybrid_gpu.py needs the hybrid-cuda extra installed).
# Tests marked `gpu` skip themselves without CUDA; the default lane never needs a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" -m pytest -m gpu -q -rs "$@"
