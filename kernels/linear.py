"""Linear layers at one to a few hundred tokens: the rows of a decode step, which stream the weights.

At batch 1 (and the few dozen rows of a decode step) a linear layer reads every
weight once and does little arithmetic with each, so it runs at whatever rate the
weights stream from memory. On CPU:

- bf16 on a CPU with AMX: the compiled `linear_amx` over weights repacked into AMX
  tiles, up to AMX_ROWS rows: oneDNN, on AMX as well, read SmolLM2's weights at
  8-13 GB/s at 2-64 rows where it reads them at 16-24 (bench/linear_small.py);
- fp32: the compiled `linear_small`, up to SMALL_ROWS rows, at nearly the machine's read
  bandwidth, where oneDNN and MKL reached about half of it;
- bf16 with AVX512-BF16 but no AMX: the compiled `linear_panels` at every row count, over
  weights repacked into panels of 32 outputs (pack_panels), which a thread streams front to
  back. Over SmolLM2's weights on a 2-core Zen 4 EPYC, against oneDNN's packed GEMM, one
  thread: 0.47x its time at one row (10.0 ms, the weights read at 27 GB/s, where oneDNN read
  them at 13), 0.62x at 8, 0.73x at 16, 0.92-0.96x at 32-1,024; two threads 0.58x at one row,
  0.67x at 16, 0.92-0.98x at 256-1,024. One kernel at every row count: `linear_small` at a
  few rows and oneDNN above sum in different orders, and a lone sequence's step came out a
  few ulps off the same row in a batch (a seeded sample could change with what else ran);
  shapes it does not cover (not multiples of 32) keep oneDNN at every row count;
- bf16 on an AVX-512 CPU without native bf16 (AVX512-BF16 or AMX): every row count
  (ALL_ROWS), `linear_small` up to EMULATED_SMALL_ROWS and above it the weights widened
  to fp32 for one fp32 GEMM, both faster than oneDNN's emulated bf16 GEMM.

Larger batches (long prefill chunks) stay with oneDNN's packed GEMM. CUDA keeps
cuBLAS: `small_linear_for` returns None there.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels import cpu_ext
from kernels.dispatch import check_choice

# Up to this many rows the compiled fp32 kernel takes the step (bench/linear_small.py
# measures where it stops paying): 1.2-2x oneDNN's packed GEMM up to 16 rows on a 2-core
# AVX2 EPYC, about even at 32.
SMALL_ROWS = 16
# linear_amx on a 2-core AMX Xeon, over SmolLM2's weights: 1.2-1.7x oneDNN at 1-64 rows;
# at 128-512 rows 1.2-1.3x for the layers and about even with the tall lm_head included;
# 0.66x at 2048, where oneDNN blocks for the cache and this kernel rereads x per 32 outputs.
AMX_ROWS = 512
# bf16 where the CPU has AVX-512 but not AVX512-BF16: oneDNN emulates bf16 at ~57 GFLOP/s on
# a 2-core Ice Lake Xeon whatever the rows, where linear_small's dot of widened pairs ran
# SmolLM2's layers and lm_head 1.7-2.5x faster at 2-48 rows. Past ~64-96 rows the same
# weights widened to fp32 (a pass over them per call) and one fp32 GEMM win instead: 1.2-2.5x
# linear_small at 128-2048 rows for the layers (135-217 GFLOP/s), 0.6x at 64. Every row count
# is taken, and no oneDNN copy of the weights is made.
ALL_ROWS = 1 << 62
EMULATED_SMALL_ROWS = 96

FewRows = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def pack_amx(weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """[out, in] bf16 -> [out/16, in/32, 16, 32]: AMX tiles of 16 input pairs x 16 outputs x 2,
    tile (o, i)[r][2c + j] = weight[16 o + c][32 i + 2 r + j], each tile's 1 KB contiguous.

    gated: weight is [gate; up] (a SwiGLU's two projections stacked); their 16-output blocks
    alternate, gate's then up's, so linear_amx(..., silu_mul=True) finds each output's gate
    and up in one pair of column blocks."""
    n, k = weight.shape
    if n % 32 or k % 32:
        raise ValueError(f"pack_amx needs out_features and in_features multiples of 32, got {n} x {k}")
    if gated:
        weight = weight.view(2, n // 32, 16, k).transpose(0, 1).reshape(n, k)
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous().view(n // 16, k // 32, 16, 32)


def _bf16_module(weight: torch.Tensor, choice: str):
    """The extension, where a compiled bf16 kernel may take this weight: CPU, bf16, a contiguous
    [out, in] with both sizes multiples of 32, the kernels choice auto or cpu; else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
        return None
    if check_choice(choice) not in ("auto", "cpu") or weight.shape[0] % 32 or weight.shape[1] % 32:
        return None
    return cpu_ext.load()


def _amx_module(weight: torch.Tensor, choice: str):
    """The extension, where linear_amx takes this weight (_bf16_module's and AMX usable); else None."""
    module = _bf16_module(weight, choice)
    return module if module is not None and module.linear_amx_available() else None


def gated_linear_for(weight: torch.Tensor, choice: str = "auto") -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
    """For weight = [gate; up] ([2 * intermediate, in]): (run(x) = silu(x @ gate.T) * (x @ up.T)
    in one pass, the most rows of x it should take), or None where linear_amx does not apply.
    The SwiGLU's activation in the projection's epilogue: no [rows, 2 * intermediate]
    intermediate written and read back, and no separate silu_and_mul call."""
    module = _amx_module(weight, choice)
    if module is None:
        return None
    packed = pack_amx(weight, gated=True)
    return (lambda x: module.linear_amx(x, packed, None, True)), AMX_ROWS


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 -> [out/32, in/2, 32, 2]: panels of 32 outputs, input pair by input pair,
    panels[p][i][c][j] = weight[32 p + c][2 i + j], as `linear_panels` reads them (and as
    `quant_gemm` dequantizes its panels)."""
    n, k = weight.shape
    if n % 32 or k % 32:
        raise ValueError(f"pack_panels needs out_features and in_features multiples of 32, got {n} x {k}")
    return weight.view(n // 32, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def panel_linear_for(weight: torch.Tensor, choice: str = "auto") -> tuple[torch.Tensor, FewRows] | None:
    """(the weight packed by pack_panels, run(x, bias)) where `linear_panels` takes this weight
    at every row count: CPU, bf16, both sizes multiples of 32, AVX512-BF16 without AMX (AMX
    keeps linear_amx), the kernels choice auto or cpu; else None."""
    module = _bf16_module(weight, choice)
    if module is None or not module.linear_panels_available() or module.linear_amx_available():
        return None
    packed = pack_panels(weight)
    return packed, (lambda x, bias: module.linear_panels(x, packed, bias))


def small_linear_for(weight: torch.Tensor, choice: str = "auto") -> tuple[FewRows, int] | None:
    """The compiled few-rows linear for this weight, as (run(x, bias), the most rows of x it
    should take, ALL_ROWS for every count), or None where none applies: not CPU, neither
    fp32 nor bf16, bf16 on a CPU without AVX-512 (or shapes the kernels do not cover) or
    with AVX512-BF16 but no AMX (panel_linear_for's, or oneDNN's), the kernels choice
    reference or triton, the extension did not build."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2 or not weight.is_contiguous():
        return None
    if check_choice(choice) not in ("auto", "cpu"):
        return None
    module = cpu_ext.load()
    if module is None:
        return None
    if _amx_module(weight, choice) is not None:
        packed = pack_amx(weight)
        return (lambda x, bias: module.linear_amx(x, packed, bias)), AMX_ROWS
    if weight.dtype == torch.bfloat16:
        if not module.linear_small_bf16(weight.shape[1]) or module.bf16_native():
            return None
        return _emulated_bf16_linear(module, weight), ALL_ROWS
    return (lambda x, bias: module.linear_small(x, weight, bias)), SMALL_ROWS


def _emulated_bf16_linear(module, weight: torch.Tensor) -> FewRows:
    """x @ weight.T (+ bias) in bf16 on a CPU without bf16 arithmetic, any rows: fp32 sums
    of the exact bf16 products, rounded to bf16 once, as a bf16 GEMM's are."""

    def run(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= EMULATED_SMALL_ROWS:
            return module.linear_small(x, weight, bias)
        wide_bias = None if bias is None else bias.float()
        return torch.nn.functional.linear(x.float(), weight.float(), wide_bias).to(torch.bfloat16)

    return run
