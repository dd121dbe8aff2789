"""Rotary position embedding in the Hugging Face (rotate-half) layout."""

from __future__ import annotations

import torch

from kernels import cpu_ext
from kernels._triton import check, next_power_of_2, output, tl, triton
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


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cos, stride_sin, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per token, all of its heads: [BLOCK_H, BLOCK_HALF] pairs (x1, x2).
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (cols < HALF)[None, :]
    x1_ptrs = x_ptr + token * stride_xt + heads[:, None] * stride_xh + cols[None, :]
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + token * stride_cos + cols, mask=cols < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + token * stride_sin + cols, mask=cols < HALF, other=0.0)[None, :]
    out_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    tl.store(out_ptrs, x1 * c - x2 * s, mask=mask)
    tl.store(out_ptrs + HALF, x2 * c + x1 * s, mask=mask)


def apply_rotary_triton(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate x ([num_tokens, heads, head_dim], any row and head strides) into `out`, by default
    x itself: the model's q and k are views of the fused qkv output that nothing else reads."""
    check("apply_rotary", x, cos, sin)
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2 or cos.shape != (num_tokens, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"apply_rotary: x [tokens, heads, even head_dim] and cos/sin [tokens, head_dim // 2], got {tuple(x.shape)}, {tuple(cos.shape)}")
    out = x if out is None else output("apply_rotary", out, x, tuple(x.shape))
    if x.numel():
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            x, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
            num_heads, HALF=half, BLOCK_H=next_power_of_2(num_heads), BLOCK_HALF=next_power_of_2(half),
        )
    return out


def apply_rotary_impl(probe: torch.Tensor, choice: str = "auto"):
    """The compiled kernels rotate `x` in place where they can (the CPU one when it is contiguous)
    and return the result."""
    return pick(apply_rotary_ref, apply_rotary_triton, probe, cpu_impl=cpu_ext.op("rotary"), choice=choice)


def apply_rotary(x, cos, sin):
    return apply_rotary_impl(x)(x, cos, sin)
