"""Writing new keys and values into their paged-cache slots."""

from __future__ import annotations

import functools

import torch

from kernels import cpu_ext
from kernels._triton import check, next_power_of_2, tl, triton
from kernels.dispatch import pick
from kernels.rotary import apply_rotary_ref, apply_rotary_triton


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], slot = block_id * block_size + offset
) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_block, stride_slot, stride_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per token: its keys and values for every KV head, flattened to one vector.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token owns no slot
        return
    i = tl.arange(0, BLOCK)
    head, dim = i // HEAD_DIM, i % HEAD_DIM
    mask = i < NUM_KV_HEADS * HEAD_DIM
    dst = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot + head * stride_head + dim
    key = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
    tl.store(k_cache_ptr + dst, key, mask=mask)
    tl.store(v_cache_ptr + dst, value, mask=mask)


def write_kv_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Same contract as write_kv_ref; a negative slot skips its token."""
    check("write_kv", key, value, k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"write_kv: key/value [tokens, kv_heads, head_dim] and caches [blocks, block_size, kv_heads, head_dim], got {tuple(key.shape)}, {tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(2) != head_dim:
        raise ValueError(f"write_kv: k_cache and v_cache must share strides with contiguous heads, got {k_cache.stride()} and {v_cache.stride()}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"write_kv: slot_mapping must be [num_tokens] int32/int64, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if num_tokens:
        _write_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK=next_power_of_2(num_kv_heads * head_dim),
        )


def write_kv_impl(probe: torch.Tensor, choice: str = "auto"):
    return pick(write_kv_ref, write_kv_triton, probe, cpu_impl=cpu_ext.op("write_kv"), choice=choice)


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    write_kv_impl(key)(key, value, k_cache, v_cache, slot_mapping)


def rotary_write_kv_ref(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], a fused projection's output
    cos: torch.Tensor,  # [num_tokens, head_dim // 2], fp32
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
    num_heads: int,
    rotary=apply_rotary_ref,
    write=write_kv_ref,
) -> torch.Tensor:
    """Rotates q and k, writes k and v into their cache slots; returns q [num_tokens, num_heads, head_dim].
    qkv is scratch: a backend may rotate it in place (Triton's rotary does).

    Everything a layer does between its qkv projection and attention, as one op: the
    compiled CPU kernel does it in one pass (the separate ops cost ~100 us a layer, mostly
    Python); elsewhere it is the rotary and write_kv of the same backend.
    """
    n = qkv.shape[0]
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    q_width, kv_width = num_heads * dim, kv_heads * dim
    if qkv.dim() != 2 or qkv.shape[1] != q_width + 2 * kv_width:
        raise ValueError(f"rotary_write_kv: qkv must be [tokens, {q_width + 2 * kv_width}], got {tuple(qkv.shape)}")
    q = rotary(qkv[:, :q_width].view(n, num_heads, dim), cos, sin)
    k = rotary(qkv[:, q_width : q_width + kv_width].view(n, kv_heads, dim), cos, sin)
    write(k, qkv[:, q_width + kv_width :].view(n, kv_heads, dim), k_cache, v_cache, slot_mapping)
    return q


rotary_write_kv_triton = functools.partial(rotary_write_kv_ref, rotary=apply_rotary_triton, write=write_kv_triton)


def rotary_write_kv_impl(probe: torch.Tensor, choice: str = "auto"):
    return pick(rotary_write_kv_ref, rotary_write_kv_triton, probe, cpu_impl=cpu_ext.op("rotary_write_kv"), choice=choice)


def rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads: int) -> torch.Tensor:
    return rotary_write_kv_impl(qkv)(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads)
