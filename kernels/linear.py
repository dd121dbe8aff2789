"""Linear layers at one to a few tokens: matrix-vector products that stream the weights.

At batch 1 (and the few rows of a lightly loaded step) a linear layer reads every
weight once and does two FLOPs with it, so it runs at whatever rate the weights
stream from memory. On CPU the compiled `linear_small` streams fp32 weights at
nearly the machine's read bandwidth, where oneDNN and MKL reached about half of
it; larger batches are compute-bound and stay with oneDNN's packed GEMM. CUDA
keeps cuBLAS: `small_linear_for` returns None there.
"""

from __future__ import annotations

import torch

from kernels import cpu_ext
from kernels.dispatch import backend_name

# Up to this many rows the compiled kernel beat oneDNN's packed fp32 GEMM by 1.2-2x on the
# 2-core AVX2 dev box; at 32 rows the two were even (bench/linear_small.py measures it).
SMALL_ROWS = 16


def small_linear_for(weight: torch.Tensor):
    """The compiled few-rows linear for this weight, or None where it does not apply
    (not CPU, not fp32, KERNELS=reference or triton, the extension did not build)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not weight.is_contiguous():
        return None
    if backend_name() not in ("auto", "cpu"):
        return None
    module = cpu_ext.load()
    return None if module is None else module.linear_small
