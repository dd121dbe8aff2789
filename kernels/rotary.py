"""Rotary position embedding in the Hugging Face (rotate-half) layout."""

from __future__ import annotations

import torch

from kernels import cpu_ext
from kernels.dispatch import pick


def apply_rotary_ref(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim // 2], fp32
    sin: torch.Tensor,
) -> torch.Tensor:
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def apply_rotary_impl(probe: torch.Tensor):
    """The compiled kernel rotates a contiguous `x` in place and returns it."""
    return pick(apply_rotary_ref, None, probe, cpu_impl=cpu_ext.op("rotary"))


def apply_rotary(x, cos, sin):
    return apply_rotary_impl(x)(x, cos, sin)
