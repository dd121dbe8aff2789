"""Writing new keys and values into their paged-cache slots."""

from __future__ import annotations

import torch

from kernels.dispatch import pick


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


def write_kv_impl(probe: torch.Tensor):
    return pick(write_kv_ref, None, probe)


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    write_kv_impl(key)(key, value, k_cache, v_cache, slot_mapping)
