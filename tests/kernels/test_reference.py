"""The PyTorch references in kernels/, each against a plain computation written here.

These references are what the Triton kernels will be tested against, so they are
checked on their own first: awkward lengths (1, 15, 16, 17, 100), two block sizes,
GQA head ratios, random block tables, and outputs poisoned before in-place writes.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels.activation import silu_and_mul_impl, silu_and_mul_ref
from kernels.dispatch import pick
from kernels.kv_cache import write_kv_ref
from kernels.paged_attention import PagedAttentionMetadata, paged_attention_ref
from kernels.rmsnorm import add_rms_norm_ref, rms_norm_ref
from kernels.rotary import apply_rotary_ref

CONTEXT_LENS = (1, 15, 16, 17, 100)
HEADS = [(9, 3), (32, 8)]
HEAD_DIM = 32
GARBAGE = 1e4  # unused cache slots hold this: any slot read that should not be shows up


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q (the last Lq positions) over k/v (all L positions), in float64.

    q: [Lq, heads, D]; k, v: [L, kv_heads, D]. Query head h reads kv head h // (heads / kv_heads).
    """
    lq, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    group = heads // kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    offset = length - lq
    allowed = torch.arange(length)[None, :] <= (torch.arange(lq)[:, None] + offset)
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class PagedBatch:
    """Sequences' keys and values scattered over a cache through random block tables."""

    def __init__(self, lens: list[int], block_size: int, kv_heads: int, seed: int):
        g = gen(seed)
        self.block_size = block_size
        needed = [-(-n // block_size) for n in lens]
        num_blocks = sum(needed) + 3  # a few blocks nobody owns
        shape = (num_blocks, block_size, kv_heads, HEAD_DIM)
        self.k_cache = torch.full(shape, GARBAGE)
        self.v_cache = torch.full(shape, -GARBAGE)
        perm = torch.randperm(num_blocks, generator=g).tolist()
        self.keys, self.values, self.tables = [], [], []
        for n, nb in zip(lens, needed):
            table, perm = perm[:nb], perm[nb:]
            k = torch.randn(n, kv_heads, HEAD_DIM, generator=g)
            v = torch.randn(n, kv_heads, HEAD_DIM, generator=g)
            for p in range(n):
                self.k_cache[table[p // block_size], p % block_size] = k[p]
                self.v_cache[table[p // block_size], p % block_size] = v[p]
            self.keys.append(k)
            self.values.append(v)
            self.tables.append(table)

    def meta(self, query_lens: list[int], seq_lens: list[int], num_decodes: int) -> PagedAttentionMetadata:
        width = max(len(t) for t in self.tables)
        # Padding points at block 0, which belongs to someone else or holds garbage.
        tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return PagedAttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            num_decodes=num_decodes,
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
        )


@pytest.mark.parametrize("heads, kv_heads", HEADS, ids=["9/3", "32/8"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_matches_dense_attention(heads, kv_heads, block_size):
    lens = list(CONTEXT_LENS)
    batch = PagedBatch(lens, block_size, kv_heads, seed=block_size + heads)
    q = torch.randn(len(lens), heads, HEAD_DIM, generator=gen(1))
    scale = HEAD_DIM**-0.5
    out = paged_attention_ref(q, batch.k_cache, batch.v_cache, batch.meta([1] * len(lens), lens, len(lens)), scale)
    for i, n in enumerate(lens):
        expected = dense_attention(q[i : i + 1], batch.keys[i], batch.values[i], scale)
        torch.testing.assert_close(out[i : i + 1].double(), expected, rtol=1e-5, atol=1e-5, msg=f"context {n}")


@pytest.mark.parametrize("heads, kv_heads", HEADS, ids=["9/3", "32/8"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_prefill_with_prefix_matches_dense_attention(heads, kv_heads, block_size):
    # Decodes first, then prefill chunks: whole prompts, chunks after a cached prefix, a 1-token chunk.
    decodes = [17, 1, 100]
    prefills = [(1, 1), (15, 15), (16, 16), (17, 17), (100, 100), (17, 1), (100, 37), (16, 5), (100, 84)]
    lens = decodes + [n for n, _ in prefills]
    query_lens = [1] * len(decodes) + [lq for _, lq in prefills]
    batch = PagedBatch(lens, block_size, kv_heads, seed=7 * block_size + heads)
    q = torch.randn(sum(query_lens), heads, HEAD_DIM, generator=gen(2))
    scale = 0.37  # not 1/sqrt(d): the scale must be the one passed in
    out = paged_attention_ref(q, batch.k_cache, batch.v_cache, batch.meta(query_lens, lens, len(decodes)), scale)
    assert not out.isnan().any()
    start = 0
    for i, (n, lq) in enumerate(zip(lens, query_lens)):
        expected = dense_attention(q[start : start + lq], batch.keys[i], batch.values[i], scale)
        torch.testing.assert_close(out[start : start + lq].double(), expected, rtol=1e-5, atol=1e-5, msg=f"seq {i}: {lq} of {n}")
        start += lq


def test_paged_attention_in_bf16_is_close_to_fp32():
    lens = [15, 100]
    batch = PagedBatch(lens, 16, 3, seed=3)
    q = torch.randn(1 + 40, 9, HEAD_DIM, generator=gen(3))
    meta = batch.meta([1, 40], lens, 1)
    ref = paged_attention_ref(q, batch.k_cache, batch.v_cache, meta, HEAD_DIM**-0.5)
    low = paged_attention_ref(q.bfloat16(), batch.k_cache.bfloat16(), batch.v_cache.bfloat16(), meta, HEAD_DIM**-0.5)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, rtol=3e-2, atol=3e-2)


# -- write_kv ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_fills_exactly_the_mapped_slots(cache_dtype, block_size):
    num_blocks, kv_heads, n = 6, 3, 37
    k_cache = torch.full((num_blocks, block_size, kv_heads, HEAD_DIM), math.nan, dtype=cache_dtype)
    v_cache = torch.full_like(k_cache, math.nan)
    slots = torch.randperm(num_blocks * block_size, generator=gen(4))[:n]
    key = torch.randn(n, kv_heads, HEAD_DIM, generator=gen(5))
    value = torch.randn(n, kv_heads, HEAD_DIM, generator=gen(6))

    write_kv_ref(key, value, k_cache, v_cache, slots)

    flat_k, flat_v = k_cache.view(-1, kv_heads, HEAD_DIM), v_cache.view(-1, kv_heads, HEAD_DIM)
    assert torch.equal(flat_k[slots], key.to(cache_dtype))
    assert torch.equal(flat_v[slots], value.to(cache_dtype))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()
    # Slot = block * block_size + offset, as the model runner computes it.
    s = int(slots[0])
    assert torch.equal(k_cache[s // block_size, s % block_size], key[0].to(cache_dtype))


def test_write_kv_then_paged_attention_round_trip():
    """write_kv and paged_attention agree on the cache layout."""
    block_size, kv_heads, heads, n = 16, 2, 4, 21
    table = [3, 0]
    k_cache = torch.zeros(4, block_size, kv_heads, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(n, kv_heads, HEAD_DIM, generator=gen(7))
    value = torch.randn(n, kv_heads, HEAD_DIM, generator=gen(8))
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
    write_kv_ref(key, value, k_cache, v_cache, slots)
    q = torch.randn(n, heads, HEAD_DIM, generator=gen(9))
    meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([table], dtype=torch.int32),
        num_decodes=0,
        query_lens_host=(n,),
        seq_lens_host=(n,),
    )
    out = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out.double(), dense_attention(q, key, value, 0.25), rtol=1e-5, atol=1e-5)


# -- norms, rotary, activation ----------------------------------------------------------------

SHAPES = [(1, 7), (5, 64), (129, 781)]
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_add_rms_norm_matches_transformers_rmsnorm(shape, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = gen(10)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    residual = torch.randn(*shape, generator=g).to(dtype)
    weight = (1 + torch.randn(shape[-1], generator=g) * 0.1).to(dtype)
    eps = 1e-6
    hf = LlamaRMSNorm(shape[-1], eps=eps).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
    x_before, res_before = x.clone(), residual.clone()

    normed, summed = add_rms_norm_ref(x, residual, weight, eps)

    assert torch.equal(summed, x + residual)
    with torch.no_grad():
        expected = hf(x + residual)
    assert normed.dtype == dtype
    torch.testing.assert_close(normed, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(rms_norm_ref(x, weight, eps), hf(x).detach(), **TOLERANCES[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)


def test_rms_norm_by_hand():
    x = torch.tensor([[3.0, 4.0]])
    out = rms_norm_ref(x, torch.tensor([1.0, 2.0]), eps=0.0)
    rms = math.sqrt((9 + 16) / 2)
    torch.testing.assert_close(out, torch.tensor([[3 / rms, 8 / rms]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, heads, head_dim", [(1, 1, 2), (7, 9, 64), (129, 3, 32)])
def test_apply_rotary_matches_transformers(num_tokens, heads, head_dim, dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = gen(11)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]  # [tokens, head_dim / 2]
    x = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)

    ours = apply_rotary_ref(x, freqs.cos(), freqs.sin())

    emb = torch.cat((freqs, freqs), dim=-1)[None]  # HF: [batch, tokens, head_dim]
    hf_x = x.float().transpose(0, 1)[None]  # [batch, heads, tokens, head_dim]
    expected, _ = apply_rotary_pos_emb(hf_x, hf_x, emb.cos(), emb.sin())
    expected = expected[0].transpose(0, 1)
    assert ours.dtype == dtype and ours.shape == x.shape
    torch.testing.assert_close(ours.float(), expected, **TOLERANCES[dtype])


def test_rotary_at_position_zero_is_the_identity():
    x = torch.randn(3, 2, 8, generator=gen(12))
    zeros = torch.zeros(3, 4)
    torch.testing.assert_close(apply_rotary_ref(x, zeros.cos(), zeros.sin()), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, intermediate", [(1, 1), (7, 96), (129, 781)])
def test_silu_and_mul(num_tokens, intermediate, dtype):
    x = (torch.randn(num_tokens, 2 * intermediate, generator=gen(13)) * 4).to(dtype)
    gate, up = x[:, :intermediate].float(), x[:, intermediate:].float()
    expected = gate * torch.sigmoid(gate) * up
    out = silu_and_mul_ref(x)
    assert out.shape == (num_tokens, intermediate) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


# -- the dispatcher ---------------------------------------------------------------------------


def test_dispatcher_uses_the_reference_on_cpu():
    x = torch.randn(4, 10, generator=gen(14))
    torch.testing.assert_close(kernels.silu_and_mul(x), silu_and_mul_ref(x))
    assert silu_and_mul_impl(x, "reference") is silu_and_mul_ref
    assert kernels.ops_for(torch.device("cpu"), choice="reference").silu_and_mul is silu_and_mul_ref


def test_dispatcher_rejects_unknown_backends():
    with pytest.raises(ValueError, match="kernels must be one of"):
        pick(silu_and_mul_ref, None, torch.randn(2, 4), choice="cuda-magic")
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels.ops_for(torch.device("cpu"), choice="cuda-magic")


def test_dispatcher_reads_no_environment_variable(monkeypatch):
    # The choice is the caller's (EngineConfig.kernels): KERNELS in the environment steers nothing.
    monkeypatch.setenv("KERNELS", "cuda-magic")
    x = torch.randn(2, 4)
    torch.testing.assert_close(kernels.silu_and_mul(x), silu_and_mul_ref(x))
    assert kernels.ops_for(torch.device("cpu"), choice="reference").silu_and_mul is silu_and_mul_ref


def test_dispatcher_says_when_triton_is_forced_but_missing():
    with pytest.raises(NotImplementedError, match="no Triton implementation"):
        pick(silu_and_mul_ref, None, torch.randn(2, 4), choice="triton")


def test_dispatcher_picks_triton_only_for_cuda_tensors_or_when_forced():
    def triton_impl():
        pass

    cpu = torch.randn(2, 4)
    assert pick(silu_and_mul_ref, triton_impl, cpu) is silu_and_mul_ref
    assert pick(silu_and_mul_ref, triton_impl, cpu, choice="auto") is silu_and_mul_ref
    assert pick(silu_and_mul_ref, triton_impl, cpu, choice="triton") is triton_impl
    assert pick(silu_and_mul_ref, triton_impl, cpu, choice="reference") is silu_and_mul_ref
