#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU machine (a few minutes on an H200;
# it must stay under 8): the Triton kernels against their PyTorch references on CUDA, each
# timed with its bandwidth against the measured copy bandwidth (bench/gpu_kernel_check.py);
# then the engine, on those kernels, against transformers on the same GPU
# (bench/gpu_engine_check.py). Prints a short table last; $OUT (or a temporary folder)
# keeps the logs and tables.
#
#   bench/gpu_check.sh              # on the GPU machine: its python3 holds PyTorch and Triton
#   PYTHON=.venv/bin/python bench/gpu_check.sh --dry-run
#                                   # anywhere: the same code on CPU through Triton's interpreter,
#                                   # tiny sizes (about a minute), so the script never rots
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
out="${OUT:-$(mktemp -d)}"
dry=""
kernels=""
if [[ "${1:-}" == "--dry-run" ]]; then
  dry="--dry-run"
  kernels="--kernels triton"  # the engine's choice: on CPU tensors, Triton only when forced
  export TRITON_INTERPRET=1   # Triton's own: it reads this when the kernels are decorated
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
# transformers is the baseline; a GPU image without it may still reach a package index.
"$py" -c "import transformers" 2>/dev/null || "$py" -m pip install -q --timeout 20 --retries 1 "transformers==5.24.0" || true
"$py" -c "import torch, triton, transformers; print(f'torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}')"

status=0
"$py" bench/gpu_kernel_check.py $dry --table "$out/kernels.md" 2>&1 | tee "$out/gpu_kernel_check.txt" || status=1
"$py" bench/gpu_engine_check.py $dry $kernels --table "$out/engine.md" 2>&1 | grep -v -E "Loading weights|it/s\]" | tee "$out/gpu_engine_check.txt" || status=1

echo
echo "## $(date -u +%F): $("$py" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU, Triton interpreter (dry run)')")"
echo
cat "$out/kernels.md" 2>/dev/null || echo "(no kernel table: see $out/gpu_kernel_check.txt)"
echo
cat "$out/engine.md" 2>/dev/null || echo "(no engine table: see $out/gpu_engine_check.txt)"
exit "$status"
