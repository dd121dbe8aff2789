"""RMSNorm, alone and fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from kernels import cpu_ext
from kernels._triton import check, next_power_of_2, output, tl, triton
from kernels.dispatch import pick


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 and cast back before the weight, as Hugging Face's Llama does:
    # the order matters for bit-level parity in bf16.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_residual, stride_out, n_cols, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per row, the whole row in registers.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # Rounded to the dtype, as the reference's `x + residual`: the next layer adds to it.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_residual + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    normed = x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, normed.to(x.dtype).to(tl.float32) * weight, mask=mask)


# A row must fit one program's registers: 16384 is 64 fp32 values a thread at 8 warps, twice
# the hidden size of the largest Llama. The warp count (a warp per 256 columns) is not measured.
_MAX_HIDDEN = 16384


def _launch(x, residual, weight, eps, out, add: bool) -> torch.Tensor:
    op = "add_rms_norm" if add else "rms_norm"
    check(op, x, residual, weight)
    if x.dim() != 2 or weight.shape != (x.shape[1],) or residual.shape != x.shape:
        raise ValueError(f"{op}: x and residual must be [rows, hidden] and weight [hidden], got {tuple(x.shape)}, {tuple(residual.shape)}, {tuple(weight.shape)}")
    if x.shape[1] > _MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size {x.shape[1]} is over the {_MAX_HIDDEN} one program can hold")
    out = output(op, out, x, tuple(x.shape))
    if out.numel():
        block = next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), x.shape[1], eps,
            ADD_RESIDUAL=add, BLOCK=block, num_warps=min(max(block // 256, 1), 8),
        )
    return out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [rows, hidden], rows may be strided."""
    return _launch(x, x, weight, eps, out, add=False)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), residual), with x + residual written into `residual` in place."""
    return _launch(x, residual, weight, eps, out, add=True), residual


_cpu_add_rms_norm = cpu_ext.op("add_rms_norm")


def _cpu_rms_norm():
    fused = _cpu_add_rms_norm()
    if fused is None:
        return None

    def rms_norm_cpu(x, weight, eps):
        x = x.contiguous()
        return fused(x, x, weight, eps, False)

    return rms_norm_cpu


def _cpu_fused_add_rms_norm():
    fused = _cpu_add_rms_norm()
    if fused is None:
        return None

    def add_rms_norm_cpu(x, residual, weight, eps):
        return fused(x, residual, weight, eps, True), residual

    return add_rms_norm_cpu


def rms_norm_impl(probe: torch.Tensor, choice: str = "auto"):
    return pick(rms_norm_ref, rms_norm_triton, probe, cpu_impl=_cpu_rms_norm, choice=choice)


def add_rms_norm_impl(probe: torch.Tensor, choice: str = "auto"):
    """(rms_norm(x + residual), x + residual); compiled kernels update `residual` in place."""
    return pick(add_rms_norm_ref, add_rms_norm_triton, probe, cpu_impl=_cpu_fused_add_rms_norm, choice=choice)


def rms_norm(x, weight, eps):
    return rms_norm_impl(x)(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    return add_rms_norm_impl(x)(x, residual, weight, eps)
