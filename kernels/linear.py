"""Linear layers at one to a few tokens: matrix-vector products that stream the weights.

At batch 1 (and the few rows of a lightly loaded step) a linear layer reads every
weight once and does two FLOPs with it, so it runs at whatever rate the weights
stream from memory. On CPU the compiled `linear_small` streams fp32 weights at
nearly the machine's read bandwidth, where oneDNN and MKL reached about half of
it, and bf16 weights (AVX512-BF16) at one row 1.5x faster than oneDNN; larger
batches stay with oneDNN's packed GEMM. CUDA keeps cuBLAS: `small_linear_for`
returns None there.
"""

from __future__ import annotations

import torch

from kernels import cpu_ext
from kernels.dispatch import backend_name

# Up to this many rows the compiled kernel takes the step (bench/linear_small.py measures
# where it stops paying). fp32: 1.2-2x oneDNN's packed GEMM up to 16 rows on a 2-core AVX2
# EPYC, even at 32. bf16: 1.46x and 1.58x at one row in two runs on a 2-core AMX Xeon, where
# oneDNN's one-row path ran slower than its two-row one; from two rows on the runs disagreed.
SMALL_ROWS = {torch.float32: 16, torch.bfloat16: 1}


def small_linear_for(weight: torch.Tensor):
    """The compiled few-rows linear for this weight (for up to SMALL_ROWS[dtype] rows of x), or
    None where it does not apply: not CPU, neither fp32 nor bf16, bf16 without AVX512-BF16,
    KERNELS=reference or triton, the extension did not build."""
    if weight.device.type != "cpu" or weight.dtype not in SMALL_ROWS or weight.dim() != 2 or not weight.is_contiguous():
        return None
    if backend_name() not in ("auto", "cpu"):
        return None
    module = cpu_ext.load()
    if module is None or (weight.dtype == torch.bfloat16 and not module.linear_small_bf16(weight.shape[1])):
        return None
    return module.linear_small
