"""Attention over the paged KV cache for a flat, ragged batch.

A step's batch holds some sequences decoding one token and some prefilling a
chunk of several tokens; the model runner orders decodes first. Each sequence's
keys and values live in cache blocks listed by its row of `block_tables`, and
`seq_lens` counts every token it attends to (cached prefix plus this step's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.dispatch import pick


@dataclass(frozen=True)
class PagedAttentionMetadata:
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, offsets into the flat token axis
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    # Host copies, so the reference path never syncs to read a length.
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    # cache: [num_blocks, block_size, kv_heads, head_dim] -> [length, kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


def _decode_ref(q, k_cache, v_cache, block_tables, seq_lens_host, scale):
    # q: [num_decodes, heads, head_dim]; one query per sequence attends to all of its context.
    block_size = k_cache.shape[1]
    max_len = max(seq_lens_host)
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks]
    # [B, T, kv_heads, head_dim] -> [B, kv_heads, T, head_dim]
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2)
    values = v_cache[tables].flatten(1, 2).transpose(1, 2)
    lens = torch.tensor(seq_lens_host, device=q.device)
    mask = torch.arange(num_blocks * block_size, device=q.device)[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def _prefill_ref(q, k_cache, v_cache, block_table, seq_len, scale):
    # q: [L, heads, head_dim], the last L tokens of a context of seq_len tokens.
    query_len = q.shape[0]
    keys = _gather(k_cache, block_table, seq_len).transpose(0, 1)
    values = _gather(v_cache, block_table, seq_len).transpose(0, 1)
    q = q.transpose(0, 1)
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        offset = seq_len - query_len
        rows = torch.arange(query_len, device=q.device)[:, None] + offset
        mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = paged_attention_ref_prefills(q, k_cache, v_cache, meta, scale)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode_ref(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens_host[:nd], scale)
    return out


def paged_attention_ref_prefills(q, k_cache, v_cache, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """Attention for the prefill chunks only; rows of the decodes are left unwritten."""
    out = torch.empty_like(q)
    start = meta.num_decodes
    for i in range(meta.num_decodes, meta.num_seqs):
        end = start + meta.query_lens_host[i]
        out[start:end] = _prefill_ref(q[start:end], k_cache, v_cache, meta.block_tables[i], meta.seq_lens_host[i], scale)
        start = end
    return out


@functools.cache
def _cpu_impl():
    from kernels import cpu_ext

    ext = cpu_ext.load()
    if ext is None:
        return None

    def paged_attention_cpu(q, k_cache, v_cache, meta, scale):
        # Decodes read the cache in place in C++; prefill chunks are few per step and
        # already efficient through SDPA.
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return ext.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        out = paged_attention_ref_prefills(q, k_cache, v_cache, meta, scale)
        if nd:
            out[:nd] = ext.paged_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        return out

    return paged_attention_cpu


def paged_attention_impl(probe: torch.Tensor):
    return pick(paged_attention_ref, None, probe, cpu_impl=_cpu_impl)


def paged_attention(q, k_cache, v_cache, meta, scale):
    return paged_attention_impl(q)(q, k_cache, v_cache, meta, scale)
