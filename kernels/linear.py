"""Linear layers at one to a few hundred tokens: the rows of a decode step, which stream the weights.

At batch 1 (and the few dozen rows of a decode step) a linear layer reads every
weight once and does little arithmetic with each, so it runs at whatever rate the
weights stream from memory. On CPU:

- bf16 on a CPU with AMX: the compiled `linear_amx` over weights repacked into AMX
  tiles, up to AMX_ROWS rows: oneDNN, on AMX as well, read SmolLM2's weights at
  8-13 GB/s at 2-64 rows where it reads them at 16-24 (bench/linear_small.py);
- fp32, and bf16 with AVX512-BF16 but no AMX: the compiled `linear_small`, up to
  SMALL_ROWS[dtype] rows: fp32 at nearly the machine's read bandwidth, where oneDNN
  and MKL reached about half of it.

Larger batches (long prefill chunks) stay with oneDNN's packed GEMM. CUDA keeps
cuBLAS: `small_linear_for` returns None there.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels import cpu_ext
from kernels.dispatch import backend_name

# Up to this many rows the compiled kernel takes the step (bench/linear_small.py measures
# where it stops paying). fp32: 1.2-2x oneDNN's packed GEMM up to 16 rows on a 2-core AVX2
# EPYC, even at 32. bf16 without AMX: at one row only (1.46x and 1.58x on a 2-core Xeon,
# where oneDNN's one-row path ran slower than its two-row one; from two rows on, runs disagreed).
SMALL_ROWS = {torch.float32: 16, torch.bfloat16: 1}
# linear_amx: 1.2-1.7x oneDNN from 1 to 512 rows and 1.45x at 1024 on a 2-core AMX Xeon,
# but 0.66x at 2048, where oneDNN blocks for the cache and this kernel rereads x per 32 outputs.
AMX_ROWS = 512

FewRows = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 -> [out/16, in/32, 16, 32]: AMX tiles of 16 input pairs x 16 outputs x 2,
    tile (o, i)[r][2c + j] = weight[16 o + c][32 i + 2 r + j], each tile's 1 KB contiguous."""
    n, k = weight.shape
    if n % 32 or k % 32:
        raise ValueError(f"pack_amx needs out_features and in_features multiples of 32, got {n} x {k}")
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous().view(n // 16, k // 32, 16, 32)


def small_linear_for(weight: torch.Tensor) -> tuple[FewRows, int] | None:
    """The compiled few-rows linear for this weight, as (run(x, bias), the most rows of x it
    should take), or None where none applies: not CPU, neither fp32 nor bf16, bf16 on a
    CPU with neither AMX nor AVX512-BF16 (or shapes they do not cover), KERNELS=reference
    or triton, the extension did not build."""
    if weight.device.type != "cpu" or weight.dtype not in SMALL_ROWS or weight.dim() != 2 or not weight.is_contiguous():
        return None
    if backend_name() not in ("auto", "cpu"):
        return None
    module = cpu_ext.load()
    if module is None:
        return None
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and module.linear_amx_available() and n % 32 == 0 and k % 32 == 0:
        packed = pack_amx(weight)
        return (lambda x, bias: module.linear_amx(x, packed, bias)), AMX_ROWS
    if weight.dtype == torch.bfloat16 and not module.linear_small_bf16(k):
        return None
    return (lambda x, bias: module.linear_small(x, weight, bias)), SMALL_ROWS[weight.dtype]
