"""The two steps both paged attention kernels take per tile of keys: reading the tile
through a block table, and folding it into an online softmax.

Scores live in the log2 domain (the caller's `qk_scale` carries log2(e)) so the
kernels use exp2, the GPU's native exponential.
"""

from __future__ import annotations

import torch

from kernels._triton import check, tl, triton

MAX_HEAD_DIM = 256  # a [BLOCK, head_dim] fp32 tile per operand must fit a program's registers


def check_attention(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """q: [rows, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim] with the
    same strides (the engine's are views of one allocation), heads a multiple of kv_heads."""
    check(op, q, k_cache, v_cache)
    if q.dim() != 3 or k_cache.dim() != 4 or q.shape[1] % k_cache.shape[2] or k_cache.shape[3] != q.shape[2] or v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: q [rows, heads, head_dim] with heads a multiple of the caches' kv_heads, got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"{op}: k_cache and v_cache must share strides, got {k_cache.stride()} and {v_cache.stride()}")
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim up to {MAX_HEAD_DIM}, got {q.shape[2]}")


@triton.jit
def kv_tile_offsets(table_ptr, tokens, mask, kv_head, stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr):
    """Offsets of tokens' first elements for one KV head: [len(tokens)], int64."""
    blocks = tl.load(table_ptr + tokens // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    return blocks * stride_block + (tokens % BLOCK_SIZE) * stride_slot + kv_head * stride_head


@triton.jit
def load_tile(cache_ptr, offsets, mask, dims, dim_mask):
    """[len(offsets), len(dims)] in fp32, zeros where masked (a NaN there would survive p = 0)."""
    return tl.load(cache_ptr + offsets[:, None] + dims[None, :], mask=mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def online_softmax_step(q, k, v, allowed, m, l, acc, qk_scale, PRECISION: tl.constexpr):
    """Fold one tile into the running max `m`, sum `l` and unnormalised output `acc` of each query row.

    q: [M, D]; k, v: [N, D]; allowed: [M, N] (or broadcastable). The first tile of
    every row must allow at least one key, so `m` is finite from then on.
    """
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l, acc
