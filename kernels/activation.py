"""SiLU-and-multiply, the SwiGLU gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_ext
from kernels._triton import check, next_power_of_2, output, tl, triton
from kernels.dispatch import pick


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * intermediate] holding gate then up.
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    # Round silu(gate) to the input's dtype before the product, as `F.silu(gate) * up` does.
    act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, act * up.to(tl.float32), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]; rows may be strided."""
    check("silu_and_mul", x)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: x must be [num_tokens, 2 * intermediate], got {tuple(x.shape)}")
    rows, n_cols = x.shape[0], x.shape[1] // 2
    out = output("silu_and_mul", out, x, (rows, n_cols))
    if out.numel():
        block = min(next_power_of_2(n_cols), 1024)
        grid = (rows, triton.cdiv(n_cols, block))
        _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), n_cols, BLOCK=block)
    return out


def silu_and_mul_impl(probe: torch.Tensor, choice: str = "auto"):
    return pick(silu_and_mul_ref, silu_and_mul_triton, probe, cpu_impl=cpu_ext.op("silu_and_mul"), choice=choice)


def silu_and_mul(x):
    return silu_and_mul_impl(x)(x)
