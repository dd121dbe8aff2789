"""Attention over the paged KV cache for a flat, ragged batch.

A step's batch holds some sequences decoding one token and some prefilling a
chunk of several tokens; the model runner orders decodes first. Each sequence's
keys and values live in cache blocks listed by its row of `block_tables`, and
`seq_lens` counts every token it attends to (cached prefix plus this step's).
Every backend runs the decodes as one batched decode (kernels/paged_decode.py) and
the prefill chunks as one prefill (kernels/paged_prefill.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.dispatch import pick
from kernels.paged_decode import paged_decode_ref, paged_decode_triton
from kernels.paged_prefill import paged_prefill_ref, paged_prefill_triton


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

    @classmethod
    def of(cls, query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, device) -> PagedAttentionMetadata:
        """From each sequence's query and context lengths (its decodes, one query token, first)."""
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            num_decodes=sum(1 for q in query_lens if q == 1),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
        )


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = paged_prefill_ref(q, k_cache, v_cache, meta, scale)
    nd = meta.num_decodes
    if nd:
        out[:nd] = paged_decode_ref(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens_host[:nd], scale)
    return out


def paged_attention_triton(
    q, k_cache, v_cache, meta: PagedAttentionMetadata, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    out = q.new_empty(q.shape) if out is None else out
    nd = meta.num_decodes
    if nd:
        paged_decode_triton(
            q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
            max_seq_len=max(meta.seq_lens_host[:nd]), out=out[:nd],
        )
    return paged_prefill_triton(q, k_cache, v_cache, meta, scale, out=out)


@functools.cache
def _cpu_impl():
    from kernels import cpu_ext

    ext = cpu_ext.load()
    if ext is None:
        return None

    def paged_attention_cpu(q, k_cache, v_cache, meta, scale):
        # Decodes read the cache in place in C++. Prefill chunks too in fp32 and bf16 on
        # AVX-512 CPUs; elsewhere (fp16, AVX2, odd head sizes) SDPA takes them one by one.
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return ext.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        if ext.paged_prefill_available(q.dtype, q.shape[-1]):
            out = ext.paged_prefill(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, nd, scale, q.new_empty(q.shape)
            )
        else:
            out = paged_prefill_ref(q, k_cache, v_cache, meta, scale)
        if nd:
            out[:nd] = ext.paged_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        return out

    return paged_attention_cpu


def paged_attention_impl(probe: torch.Tensor, choice: str = "auto"):
    return pick(paged_attention_ref, paged_attention_triton, probe, cpu_impl=_cpu_impl, choice=choice)


def paged_attention(q, k_cache, v_cache, meta, scale):
    return paged_attention_impl(q)(q, k_cache, v_cache, meta, scale)
