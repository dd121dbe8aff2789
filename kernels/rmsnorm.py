"""RMSNorm, alone and fused with the residual add that precedes it."""

from __future__ import annotations

import torch

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


def rms_norm(x, weight, eps):
    return pick(rms_norm_ref, None, x)(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    return pick(add_rms_norm_ref, None, x)(x, residual, weight, eps)
