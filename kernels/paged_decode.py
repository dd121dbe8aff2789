"""Paged decode attention: one query token per sequence over its whole cached context,
grouped-query heads, keys and values read through each sequence's block table.

The Triton kernel splits each context across programs (FlashDecoding): a handful of
long sequences would otherwise run as a handful of programs on a GPU with over a
hundred multiprocessors. Each split writes its normalised partial output and its
log-sum-exp; a second kernel weighs the splits together.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels._triton import dot_precision, multiprocessor_count, next_power_of_2, output, tl, triton
from kernels.attention_tile import check_attention, kv_tile_offsets, load_tile, online_softmax_step


def paged_decode_ref(
    q: torch.Tensor,  # [num_seqs, heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens_host: tuple[int, ...],
    scale: float,
) -> torch.Tensor:
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


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, part_ptr, lse_ptr,
    qk_scale, split_len,
    stride_qs, stride_qh, stride_ps, stride_ph, stride_psplit, stride_ls, stride_lh,
    stride_block, stride_slot, stride_head, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    # Program (sequence, KV head, split): the GROUP query heads sharing that KV head, as the
    # rows of one tile (padded to BLOCK_G >= 16 rows, the smallest MMA tile), over tokens [start, end).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    heads = kv_head * GROUP + tl.arange(0, BLOCK_G)
    head_mask = tl.arange(0, BLOCK_G) < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = load_tile(q_ptr + seq * stride_qs, heads * stride_qh, head_mask, dims, dim_mask)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_table
    for first in range(start, end, BLOCK_N):
        tokens = first + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        offsets = kv_tile_offsets(table_ptr, tokens, token_mask, kv_head, stride_block, stride_slot, stride_head, BLOCK_SIZE)
        k = load_tile(k_cache_ptr, offsets, token_mask, dims, dim_mask)
        v = load_tile(v_cache_ptr, offsets, token_mask, dims, dim_mask)
        m, l, acc = online_softmax_step(q, k, v, token_mask[None, :], m, l, acc, qk_scale, PRECISION)

    # A split past the end of a short sequence is empty (m = -inf, l = 0): output 0, weight 0.
    l = tl.where(l > 0, l, 1.0)
    part_ptrs = part_ptr + seq * stride_ps + split * stride_psplit + heads[:, None] * stride_ph + dims[None, :]
    tl.store(part_ptrs, acc / l[:, None], mask=head_mask[:, None] & dim_mask[None, :])
    tl.store(lse_ptr + seq * stride_ls + heads * stride_lh + split, m + tl.log2(l), mask=head_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_ps, stride_ph, stride_psplit, stride_ls, stride_lh, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
):
    # Program (sequence, query head): the splits' outputs weighted by their share of the softmax sum.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + splits, mask=split_mask, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    parts = load_tile(part_ptr + seq * stride_ps + head * stride_ph, splits * stride_psplit, split_mask, dims, dims < HEAD_DIM)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out, mask=dims < HEAD_DIM)


_BLOCK_N = 32  # tokens per tile
# Not measured yet (no GPU was lent while writing this): a split should hold enough
# tokens to hide its fixed cost and the reduction's, as FlashDecoding's do.
# bench/gpu_check.sh times the kernel on a lent GPU; tune these there.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 32


def num_splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int, multiprocessors: int) -> int:
    """Enough (sequence, KV head, split) programs to give every multiprocessor two, without
    splitting below _MIN_SPLIT_TOKENS tokens."""
    programs = num_seqs * num_kv_heads
    wanted = -(-2 * multiprocessors // programs)
    return max(1, min(wanted, max_seq_len // _MIN_SPLIT_TOKENS, _MAX_SPLITS))


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,  # [num_seqs] int32, on q's device
    scale: float,
    max_seq_len: int,  # the host's copy of max(seq_lens): reading it here would sync
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    check_attention("paged_decode", q, k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = output("paged_decode", out, q, tuple(q.shape))
    if not num_seqs:
        return out
    splits = num_splits or num_splits_for(num_seqs, num_kv_heads, max_seq_len, multiprocessor_count(q.device))
    split_len = _BLOCK_N * triton.cdiv(triton.cdiv(max_seq_len, splits), _BLOCK_N)
    splits = triton.cdiv(max_seq_len, split_len)
    # One split writes the output itself: `out` stands in for the partials (its split stride unused).
    part = out if splits == 1 else q.new_empty((num_seqs, splits, num_heads, head_dim), dtype=torch.float32)
    lse = q.new_empty((num_seqs, num_heads, splits), dtype=torch.float32)
    group = num_heads // num_kv_heads
    block_d = max(next_power_of_2(head_dim), 16)
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse,
        scale * math.log2(math.e), split_len,
        q.stride(0), q.stride(1), part.stride(0), part.stride(-2), part.stride(1) if splits > 1 else 0, lse.stride(0), lse.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=max(next_power_of_2(group), 16),
        BLOCK_D=block_d, BLOCK_N=_BLOCK_N, PRECISION=dot_precision(k_cache.dtype),
    )
    if splits > 1:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            part, lse, out, splits,
            part.stride(0), part.stride(2), part.stride(1), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SPLITS=next_power_of_2(splits),
        )
    return out
