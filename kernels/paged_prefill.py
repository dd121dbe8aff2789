"""Paged prefill attention for chunked prefill: each sequence's chunk of new query
tokens attends causally to its cached prefix and to itself, every sequence of the
batch (each with its own chunk and prefix length) in one launch.

Query rows are the flat token axis from `query_start_loc[first_seq]` on; a sequence
of `seq_len` tokens with a chunk of `L` holds its queries at positions seq_len - L ..
seq_len - 1, and its keys and values (the chunk's already written) in its blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels._triton import dot_precision, next_power_of_2, output, tl, triton
from kernels.attention_tile import check_attention, kv_tile_offsets, load_tile, online_softmax_step


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    # cache: [num_blocks, block_size, kv_heads, head_dim] -> [length, kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


def _prefill_one_ref(q, k_cache, v_cache, block_table, seq_len, scale):
    # [1, heads, tokens, head_dim]: PyTorch's CPU flash attention takes only 4-D inputs; 3-D
    # ones fall back to the math path, which materialises the scores (SmolLM2's 9/3 heads at
    # 256 tokens in bf16: 3.2 ms there, 0.4 ms here).
    query_len = q.shape[0]
    keys = _gather(k_cache, block_table, seq_len).transpose(0, 1)[None]
    values = _gather(v_cache, block_table, seq_len).transpose(0, 1)[None]
    q = q.transpose(0, 1)[None]
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        offset = seq_len - query_len
        rows = torch.arange(query_len, device=q.device)[:, None] + offset
        mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_prefill_ref(q, k_cache, v_cache, meta, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for the sequences from meta.num_decodes on (their rows of q); the decodes'
    rows of the result are left unwritten."""
    out = torch.empty_like(q) if out is None else out
    start = meta.num_decodes  # each decode has one query row
    for i in range(meta.num_decodes, meta.num_seqs):
        end = start + meta.query_lens_host[i]
        out[start:end] = _prefill_one_ref(q[start:end], k_cache, v_cache, meta.block_tables[i], meta.seq_lens_host[i], scale)
        start = end
    return out


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr, out_ptr,
    qk_scale, first_seq,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_block, stride_slot, stride_head, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    # Program (sequence, query head, tile of BLOCK_M query rows); tiles past a shorter
    # sequence's chunk have nothing to do.
    seq = first_seq + tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    positions = seq_len - query_len + rows  # of the query tokens in their sequence
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_rows = (query_start + rows).to(tl.int64)
    q = load_tile(q_ptr + head * stride_qh, q_rows * stride_qt, row_mask, dims, dim_mask)

    kv_head = head // GROUP
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_table
    end = tl.minimum(seq_len - query_len + (tile + 1) * BLOCK_M, seq_len)  # keys the tile's last row sees
    for first in range(0, end, BLOCK_N):
        tokens = first + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        offsets = kv_tile_offsets(table_ptr, tokens, token_mask, kv_head, stride_block, stride_slot, stride_head, BLOCK_SIZE)
        k = load_tile(k_cache_ptr, offsets, token_mask, dims, dim_mask)
        v = load_tile(v_cache_ptr, offsets, token_mask, dims, dim_mask)
        causal = token_mask[None, :] & (tokens[None, :] <= positions[:, None])
        m, l, acc = online_softmax_step(q, k, v, causal, m, l, acc, qk_scale, PRECISION)

    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptrs, acc / l[:, None], mask=row_mask[:, None] & dim_mask[None, :])


# Not measured yet (no GPU was lent while writing this): 32x32 tiles of fp32 operands keep a
# head_dim-128 program's q, k, v and accumulator in registers with 4 warps. bench/gpu_check.sh
# times the kernel on a lent GPU; tune these there.
_BLOCK_M = 32  # query rows per program
_BLOCK_N = 32  # keys per tile


def paged_prefill_triton(q, k_cache, v_cache, meta, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as paged_prefill_ref: q [num_tokens, heads, head_dim] with the decodes'
    rows first (left unwritten), caches [num_blocks, block_size, kv_heads, head_dim]."""
    check_attention("paged_prefill", q, k_cache, v_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = output("paged_prefill", out, q, tuple(q.shape))
    num_prefills = meta.num_seqs - meta.num_decodes
    if not num_prefills:
        return out
    longest_chunk = max(meta.query_lens_host[meta.num_decodes :])
    grid = (num_prefills, num_heads, triton.cdiv(longest_chunk, _BLOCK_M))
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, out,
        scale * math.log2(math.e), meta.num_decodes,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=_BLOCK_M, BLOCK_D=max(next_power_of_2(head_dim), 16), BLOCK_N=_BLOCK_N, PRECISION=dot_precision(k_cache.dtype),
    )
    return out
