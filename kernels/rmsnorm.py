"""RMSNorm, alone and fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from kernels import cpu_ext
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


_cpu_add_rms_norm = cpu_ext.op("add_rms_norm")


def rms_norm_impl(probe: torch.Tensor):
    fused = pick(rms_norm_ref, None, probe, cpu_impl=_cpu_add_rms_norm)
    if fused is rms_norm_ref:
        return rms_norm_ref
    def rms_norm_cpu(x, weight, eps):
        x = x.contiguous()
        return fused(x, x, weight, eps, False)

    return rms_norm_cpu


def add_rms_norm_impl(probe: torch.Tensor):
    """(rms_norm(x + residual), x + residual); the compiled kernel updates `residual` in place."""
    fused = pick(add_rms_norm_ref, None, probe, cpu_impl=_cpu_add_rms_norm)
    if fused is add_rms_norm_ref:
        return add_rms_norm_ref

    def add_rms_norm_cpu(x, residual, weight, eps):
        return fused(x, residual, weight, eps, True), residual

    return add_rms_norm_cpu


def rms_norm(x, weight, eps):
    return rms_norm_impl(x)(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    return add_rms_norm_impl(x)(x, residual, weight, eps)
