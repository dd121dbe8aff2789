#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU machine (see bench/README or the
# main README). Prints a short table last. Uses the machine's own python3 (PyTorch, transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 bench/gpu_engine_check.py "$@" 2>&1 | grep -v -E "Loading weights|it/s\]" | tee "$out/gpu_engine_check.txt"
