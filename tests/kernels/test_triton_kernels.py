"""The Triton kernels against their PyTorch references, on CPU tensors through Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before `kernels` is imported).

Every output is NaN before a kernel runs, so an element it fails to write fails the
test; every cache slot no sequence owns is NaN too, so a read outside a context does.
Shapes are awkward on purpose: contexts 1, 15, 16, 17 and 1000 around both block sizes,
SmolLM2's 9 query heads over 3 KV heads, 32/8 at head_dim 128, 4/4 at an odd 24, rows
of 1, 7 and 33 (one program per row: 33 is as awkward as 129 at a quarter of the interpreter's
time), a hidden size of 1823. The interpreter runs each program in numpy (about
3 ms per 32-key attention tile here), so 1000-token contexts appear in a few cases only.

The same launches are then compiled for sm_90 and sm_80 without a GPU, and a tiny
engine must produce the same greedy tokens with the kernels choice triton and reference.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels._triton import INTERPRETING
from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.kv_cache import rotary_write_kv_ref, rotary_write_kv_triton, write_kv_triton
from kernels.paged_attention import paged_attention_ref, paged_attention_triton
from kernels.paged_decode import num_splits_for, paged_decode_ref, paged_decode_triton
from kernels.paged_prefill import paged_prefill_triton
from kernels.rmsnorm import add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from kernels.quant import dequantize, quant_linear_triton, quantize
from kernels.rotary import apply_rotary_ref, apply_rotary_triton
from tests.kernels.gpu_compile import compile_launches, kernels as all_kernels, record_launches
from tests.kernels.test_cpu_kernels import (
    ATTENTION_IDS,
    ATTENTION_SHAPES,
    CPU,
    DECODE_BATCHES as CPU_DECODE_BATCHES,
    DTYPES,
    PagedCache,
    gen,
    greedy_tokens,
    norm_inputs,
    one_thread,  # noqa: F401  (an autouse fixture: one thread, as there)
    query_slice,
    rope,
    same_bits,
)

# Triton's interpreter runs every program in numpy: this module took 306 s of the 476 s that
# the tests without a live platform took on the 2-core dev box, so `make test-fast` leaves it
# out; `make test` runs it.
pytestmark = pytest.mark.slow

HALF = [torch.bfloat16, torch.float16]


def test_the_session_interprets_triton():
    assert INTERPRETING, "TRITON_INTERPRET=1 must be set before kernels is imported (tests/conftest.py does)"


def poisoned(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, math.nan, dtype=dtype)


def tolerance(dtype: torch.dtype, roundings: int = 1) -> dict:
    """How far a Triton kernel may be from its reference.

    fp32: the issue's 1e-4 (sums in another order, exp2 for exp, rsqrt).
    fp16: both sides compute in fp32 and round to fp16 at the same points; a value near a
    rounding boundary can land one ulp (eps = 2^-10) apart per rounding.
    bf16: triton 3.9's interpreter rounds fp32 to bf16 toward zero where the GPU and
    PyTorch round to nearest even, so each of the kernel's roundings can be a whole ulp
    (eps = 2^-7) off instead of half: one eps per rounding, plus one for the reference's.
    `roundings` counts the dtype roundings on the kernel's path to the output.
    """
    if dtype == torch.float32:
        return dict(rtol=1e-4, atol=1e-4)
    eps = torch.finfo(dtype).eps
    return dict(rtol=(roundings + 1) * eps, atol=(roundings + 1) * eps)


def attention_tolerance(dtype: torch.dtype) -> dict:
    # The kernels keep scores, probabilities and sums in fp32 and round once; the reference's
    # SDPA in bf16/fp16 rounds its intermediate products on the way: 4 eps, as the CPU kernels.
    if dtype == torch.float32:
        return dict(rtol=1e-4, atol=1e-4)
    eps = torch.finfo(dtype).eps
    return dict(rtol=4 * eps, atol=4 * eps)


# -- silu_and_mul ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", [1, 781, 1536])  # 1536 > one program's 1024 columns
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_silu_and_mul(rows, intermediate, dtype):
    wide = (torch.randn(rows, 2 * intermediate + 5, generator=gen(rows + intermediate)) * 4).to(dtype)
    x = wide[:, 3 : 3 + 2 * intermediate]  # strided rows, as a slice of a wider output
    x_before = x.clone()
    out = silu_and_mul_triton(x, out=poisoned((rows, intermediate), dtype))
    assert out.shape == (rows, intermediate) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_ref(x), **tolerance(dtype, roundings=2))
    assert same_bits(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_of_large_gates_saturates_without_nan(dtype):
    gate = torch.tensor([[-1000.0, -100.0, -89.0, -20.0, 0.0, 20.0, 89.0, 100.0, 1000.0]])
    x = torch.cat([gate, torch.full_like(gate, 0.5)], dim=-1).to(dtype)
    with pytest.warns(RuntimeWarning, match="overflow"):  # numpy's exp(1000): the GPU says nothing
        out = silu_and_mul_triton(x, out=poisoned((1, 9), dtype))
    assert out.isfinite().all(), f"silu_and_mul({gate.tolist()}) = {out.tolist()}"
    torch.testing.assert_close(out, silu_and_mul_ref(x), **tolerance(dtype, roundings=2))


# -- RMSNorm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 1823])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_add_rms_norm_writes_the_sum_into_residual(rows, hidden, dtype):
    x, residual, weight = norm_inputs(rows, hidden, dtype, seed=rows + hidden)
    x_before = x.clone()
    expected, summed = add_rms_norm_ref(x, residual, weight, 1e-5)

    normed, res_out = add_rms_norm_triton(x, residual, weight, 1e-5, out=poisoned((rows, hidden), dtype))

    assert res_out is residual
    if dtype == torch.bfloat16:  # the interpreter's truncation: within one ulp (see tolerance)
        torch.testing.assert_close(residual, summed, rtol=torch.finfo(dtype).eps, atol=0)
    else:  # one rounding to nearest on both sides: the same bits
        assert torch.equal(residual, summed)
    torch.testing.assert_close(normed, expected, **tolerance(dtype, roundings=3))
    assert same_bits(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [576, 1823])
@pytest.mark.parametrize("rows", [1, 33])
def test_rms_norm_of_strided_rows(rows, hidden, dtype):
    wide, _, weight = norm_inputs(rows, hidden + 9, dtype, seed=rows)
    x, weight = wide[:, 9:], weight[9:]
    x_before = x.clone()
    out = rms_norm_triton(x, weight, 1e-6, out=poisoned((rows, hidden), dtype))
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), **tolerance(dtype, roundings=2))
    assert same_bits(x, x_before)


# -- rotary ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads, head_dim", ATTENTION_SHAPES, ids=ATTENTION_IDS)
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_rotary_on_slices_of_a_fused_qkv(rows, heads, kv_heads, head_dim, dtype):
    # The model rotates q.view(n, heads, dim) and k.view(n, kv_heads, dim), column slices of one
    # qkv output, in place: those columns must hold the result and v's must not change.
    cos, sin = rope(rows, head_dim, seed=rows)
    q_cols, kv_cols = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(rows, q_cols + 2 * kv_cols, generator=gen(rows + head_dim)).to(dtype)
    before = qkv.clone()
    q, k, _ = qkv.split([q_cols, kv_cols, kv_cols], dim=-1)
    q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
    q_expected, k_expected = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)

    assert apply_rotary_triton(q, cos, sin) is q
    assert apply_rotary_triton(k, cos, sin) is k

    torch.testing.assert_close(q, q_expected, **tolerance(dtype))
    torch.testing.assert_close(k, k_expected, **tolerance(dtype))
    assert same_bits(qkv[:, q_cols + kv_cols :], before[:, q_cols + kv_cols :]), "rotary wrote into the v columns"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_into_an_out_tensor_leaves_x_alone(dtype):
    rows, heads, head_dim = 129, 9, 64
    cos, sin = rope(rows, head_dim, seed=3)
    x = torch.randn(rows, heads, head_dim, generator=gen(4)).to(dtype)
    x_before = x.clone()
    out = apply_rotary_triton(x, cos, sin, out=poisoned(x.shape, dtype))
    torch.testing.assert_close(out, apply_rotary_ref(x, cos, sin), **tolerance(dtype))
    assert same_bits(x, x_before)


# -- write_kv --------------------------------------------------------------------------------


def fused_kv(num_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """key and value as the model has them: column slices of one qkv output, viewed per head."""
    qkv = torch.randn(num_tokens, 4 * kv_heads * head_dim, generator=gen(seed)).to(dtype)
    _, key, value = qkv.split([2 * kv_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return key.view(num_tokens, kv_heads, head_dim), value.view(num_tokens, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads, head_dim", [(3, 64), (8, 128), (4, 24)], ids=["3x64", "8x128", "4x24"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_fills_exactly_the_mapped_slots(block_size, kv_heads, head_dim, dtype):
    num_blocks, n = 7, 37
    k_cache = poisoned((num_blocks, block_size, kv_heads, head_dim), dtype)
    v_cache = poisoned(k_cache.shape, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen(block_size))[:n]
    key, value = fused_kv(n, kv_heads, head_dim, dtype, seed=head_dim)

    write_kv_triton(key, value, k_cache, v_cache, slots)

    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    assert same_bits(flat_k[slots], key.contiguous()) and same_bits(flat_v[slots], value.contiguous())
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def test_write_kv_skips_tokens_without_a_slot():
    k_cache, v_cache = poisoned((2, 16, 3, 64), torch.float32), poisoned((2, 16, 3, 64), torch.float32)
    key, value = fused_kv(3, 3, 64, torch.float32, seed=1)
    write_kv_triton(key, value, k_cache, v_cache, torch.tensor([5, -1, 17]))
    assert torch.equal(k_cache[0, 5], key[0]) and torch.equal(v_cache[1, 1], value[2])
    assert k_cache.isnan().sum() == k_cache.numel() - 2 * 3 * 64


def test_rotary_write_kv_in_triton_matches_the_reference():
    # The fused op on Triton is Triton's rotary and write_kv over the qkv row's parts.
    heads, kv_heads, head_dim, n = 9, 3, 64, 5
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen(4))
    angles = torch.rand(n, head_dim // 2, generator=gen(5)) * 50
    slots = torch.tensor([3, -1, 17, 0, 30])
    out = []
    for fn in (rotary_write_kv_triton, rotary_write_kv_ref):
        k_cache, v_cache = poisoned((2, 16, kv_heads, head_dim), torch.float32), poisoned((2, 16, kv_heads, head_dim), torch.float32)
        if fn is rotary_write_kv_ref:  # the reference has no padding rule of its own: give it the kept tokens
            kept = slots >= 0
            q = fn(qkv[kept].clone(), angles[kept].cos(), angles[kept].sin(), k_cache, v_cache, slots[kept], heads)
        else:  # Triton rotates in place: the qkv it is given is scratch
            q = fn(qkv.clone(), angles.cos(), angles.sin(), k_cache, v_cache, slots, heads)[slots >= 0]
        out.append((q, k_cache.nan_to_num(7.0), v_cache.nan_to_num(7.0)))
    for got, want in zip(*out):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- paged decode ----------------------------------------------------------------------------

DECODE_BATCHES = {name: CPU_DECODE_BATCHES[name] for name in ("1", "15", "16", "17", "1000+short")}
# 14 sequences: the block edges of both block sizes, then 5 random lengths up to 300.
DECODE_BATCHES["14seqs"] = CPU_DECODE_BATCHES["37seqs"][:14]
DECODE_CASES = [
    pytest.param(batch, block_size, *shape, torch.float32, id=f"{batch}-bs{block_size}-{shape_id}-fp32")
    for batch in DECODE_BATCHES
    for block_size in (16, 32)
    for shape, shape_id in zip(ATTENTION_SHAPES, ATTENTION_IDS)
    if batch != "1000+short" or shape_id != "4/4x24"
] + [
    pytest.param(batch, 16, 9, 3, 64, dtype, id=f"{batch}-bs16-9/3x64-{str(dtype)[6:]}")
    for batch in ("17", "1000+short", "14seqs")
    for dtype in HALF
]


def run_decode(lens, block_size, heads, kv_heads, head_dim, dtype, num_splits=None):
    """(Triton's output, the reference's), checking the inputs are left as they were."""
    cache = PagedCache(lens, block_size, kv_heads, head_dim, dtype, seed=len(lens) + block_size + heads)
    q = query_slice(len(lens), heads, head_dim, dtype, seed=block_size + head_dim)
    scale = 1.3 * head_dim**-0.5  # not 1/sqrt(d): the scale must be the one passed in
    k_before, v_before, q_before = cache.k_cache.clone(), cache.v_cache.clone(), q.clone()
    expected = paged_decode_ref(q, cache.finite_k, cache.finite_v, cache.block_tables, tuple(lens), scale)
    out = paged_decode_triton(
        q, cache.k_cache, cache.v_cache, cache.block_tables, torch.tensor(lens, dtype=torch.int32), scale,
        max_seq_len=max(lens), num_splits=num_splits, out=poisoned(q.shape, dtype),
    )
    assert same_bits(cache.k_cache, k_before) and same_bits(cache.v_cache, v_before) and same_bits(q, q_before)
    assert out.isfinite().all(), "an output left unwritten, or a read outside a context"
    return out, expected


@pytest.mark.parametrize("batch, block_size, heads, kv_heads, head_dim, dtype", DECODE_CASES)
def test_paged_decode(batch, block_size, heads, kv_heads, head_dim, dtype):
    out, expected = run_decode(DECODE_BATCHES[batch], block_size, heads, kv_heads, head_dim, dtype)
    torch.testing.assert_close(out, expected, **attention_tolerance(dtype))


@pytest.mark.parametrize(
    # ~4.5 s a case interpreted: splits that divide the blocks unevenly, and so many that most are
    # empty, each in one dtype.
    "num_splits, dtype", [(3, torch.float32), (32, torch.float32), (3, torch.bfloat16)], ids=str
)
def test_paged_decode_split_across_programs(num_splits, dtype):
    # 32 splits of the 1000-token context are 32 tokens each: the short sequences' later splits
    # are empty and must weigh nothing.
    out, expected = run_decode([1000, 1, 16, 33, 15], 16, 9, 3, 64, dtype, num_splits=num_splits)
    torch.testing.assert_close(out, expected, **attention_tolerance(dtype))


def test_decode_splits_long_contexts_only_when_the_gpu_has_room():
    h200 = 132  # multiprocessors; num_splits_for asks the device, here it is given
    assert num_splits_for(2, 8, 4000, h200) == 15  # 16 programs on 132 SMs: 4000 // 256 splits
    assert num_splits_for(1, 3, 32000, h200) == 32  # capped
    assert num_splits_for(64, 8, 4000, h200) == 1  # 512 programs fill the GPU already
    assert num_splits_for(2, 8, 200, h200) == 1  # too short to be worth a split
    assert num_splits_for(2, 8, 4000, 1) == 1  # the interpreter's single "multiprocessor"


# -- paged prefill and the mixed batch -------------------------------------------------------


def mixed_batch(decodes, prefills, block_size, heads, kv_heads, head_dim, dtype, seed):
    lens = decodes + [n for n, _ in prefills]
    query_lens = [1] * len(decodes) + [lq for _, lq in prefills]
    cache = PagedCache(lens, block_size, kv_heads, head_dim, dtype, seed=seed)
    q = query_slice(sum(query_lens), heads, head_dim, dtype, seed=seed + 1)
    return cache, q, cache.meta(query_lens, lens, len(decodes))


MIXED_CASES = [
    pytest.param(block_size, *shape, torch.float32, id=f"bs{block_size}-{shape_id}-fp32")
    for block_size in (16, 32)
    for shape, shape_id in zip(ATTENTION_SHAPES, ATTENTION_IDS)
    if block_size == 16 or shape_id != "32/8x128"  # 32 heads cost 5 s a case interpreted
] + [pytest.param(16, 9, 3, 64, dtype, id=f"bs16-9/3x64-{str(dtype)[6:]}") for dtype in HALF]


@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim, dtype", MIXED_CASES)
def test_paged_attention_of_a_mixed_batch(block_size, heads, kv_heads, head_dim, dtype):
    # Decodes first, as the runner orders them, then prefill chunks: whole prompts, chunks after
    # a cached prefix (ending on and just past block edges, longer than a 32-row tile), 1-token chunks.
    decodes = [1, 16, 17, 15, 100]
    prefills = [(1, 1), (15, 15), (16, 16), (17, 17), (40, 1), (100, 37), (33, 16), (64, 32), (100, 84)]
    cache, q, meta = mixed_batch(decodes, prefills, block_size, heads, kv_heads, head_dim, dtype, seed=3 * block_size + heads)
    expected = paged_attention_ref(q, cache.finite_k, cache.finite_v, meta, 0.37)

    out = paged_attention_triton(q, cache.k_cache, cache.v_cache, meta, 0.37, out=poisoned(q.shape, dtype))

    assert out.isfinite().all(), "an output left unwritten, or a read outside a context"
    torch.testing.assert_close(out, expected, **attention_tolerance(dtype))


# Each block size once (~13 s a case under the interpreter on 2 cores); fp16's prefill chunks
# are in the mixed batch above.
@pytest.mark.parametrize("block_size, dtype", [(16, torch.float32), (32, torch.bfloat16)], ids=str)
def test_paged_prefill_chunks_after_a_long_prefix(block_size, dtype):
    # Prefills only, no decode rows: chunks of 7 and 40 after 993 and 960 cached tokens.
    cache, q, meta = mixed_batch([], [(1000, 7), (1000, 40), (17, 17)], block_size, 9, 3, 64, dtype, seed=block_size)
    expected = paged_attention_ref(q, cache.finite_k, cache.finite_v, meta, 0.125)
    out = paged_prefill_triton(q, cache.k_cache, cache.v_cache, meta, 0.125, out=poisoned(q.shape, dtype))
    assert out.isfinite().all()
    torch.testing.assert_close(out, expected, **attention_tolerance(dtype))


def test_paged_prefill_leaves_the_decode_rows_alone():
    cache, q, meta = mixed_batch([5, 9], [(20, 20)], 16, 9, 3, 64, torch.float32, seed=5)
    out = paged_prefill_triton(q, cache.k_cache, cache.v_cache, meta, 0.125, out=poisoned(q.shape, torch.float32))
    assert out[:2].isnan().all() and out[2:].isfinite().all()


# -- errors ----------------------------------------------------------------------------------


def test_unsupported_inputs_are_refused_with_the_reason():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        silu_and_mul_triton(x.double())
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul_triton(torch.randn(4, 7))
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        rms_norm_triton(x.t(), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="hidden size 20000 is over"):
        rms_norm_triton(torch.randn(1, 20000), torch.ones(20000), 1e-5)
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul_triton(x, out=torch.empty(4, 8))
    cache = torch.zeros(4, 16, 3, 64)
    with pytest.raises(ValueError, match="multiple of the caches' kv_heads"):
        paged_decode_triton(torch.randn(2, 8, 64), cache, cache, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 1.0, 1)
    big = torch.zeros(4, 16, 1, 512)
    with pytest.raises(ValueError, match="head_dim up to 256"):
        paged_decode_triton(torch.randn(2, 1, 512), big, big, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 1.0, 1)
    with pytest.raises(ValueError, match="share strides"):
        write_kv_triton(torch.randn(1, 3, 64), torch.randn(1, 3, 64), cache, cache.transpose(0, 1).contiguous().transpose(0, 1), torch.tensor([0]))


# -- the dispatcher and the model ------------------------------------------------------------


def test_kernels_triton_resolves_every_op_to_triton():
    ops = kernels.ops_for(CPU, torch.float32, "triton")
    assert ops.silu_and_mul is silu_and_mul_triton
    assert ops.rms_norm is rms_norm_triton and ops.add_rms_norm is add_rms_norm_triton
    assert ops.apply_rotary is apply_rotary_triton
    assert ops.write_kv is write_kv_triton
    assert ops.rotary_write_kv is rotary_write_kv_triton
    assert ops.paged_attention is paged_attention_triton
    # CPU tensors: never Triton unless forced
    assert kernels.ops_for(CPU, torch.float32, "auto").paged_attention is not paged_attention_triton


def test_engine_greedy_output_is_identical_with_triton_kernels():
    # The tiny 9/3-head model of the CPU kernels' parity test: mixed prompt lengths, prefills
    # chunked by a 24-token budget alongside decodes, and a shared prefix served from the cache.
    # 8 tokens each: the prompts' chunks and the first decodes are where the kernels differ from
    # the reference's path; interpreted, 20 tokens took 18 s and 8 take 9 s on the dev box.
    reference = greedy_tokens("reference", torch.float32, max_tokens=8)
    triton_tokens = greedy_tokens("triton", torch.float32, max_tokens=8)
    assert triton_tokens == reference


def quant_inputs(rows: int, n: int, k: int, bits: int, dtype: torch.dtype, seed: int):
    g = gen(seed)
    weight = torch.randn(n, k, generator=g) * 0.05
    return torch.randn(rows, k, generator=g).to(dtype), quantize(weight, bits), torch.randn(n, generator=g).to(dtype)


# rows 1 (a decode), 7 and 33 (tiles of 16 and 64 rows, partly masked); 100 outputs and 96
# inputs leave the last output tile and the last k step partly empty.
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_reads_the_quantized_weights_as_their_dequantized_copy(bits, rows, dtype):
    x, qw, bias = quant_inputs(rows, 100, 96, bits, dtype, seed=rows * bits)
    got = quant_linear_triton(x, qw, bias)
    # What the CPU's prefill path computes: the dequantized weights in x's dtype, one GEMM.
    want = torch.nn.functional.linear(x.float(), dequantize(qw, dtype).float(), bias.float())
    assert got.shape == (rows, 100) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want, atol=tolerance, rtol=tolerance), (got.float() - want).abs().max()
    # Without a bias, and as a batch of rows of rows.
    flat = quant_linear_triton(x.view(1, rows, 96), qw)
    assert torch.allclose(flat.view(rows, 100).float(), want - bias.float(), atol=tolerance, rtol=tolerance)


def test_quant_linear_refuses_weights_of_another_width():
    x, qw, _ = quant_inputs(2, 32, 64, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="the weights take 64"):
        quant_linear_triton(x[:, :32], qw)


def test_kernels_import_and_refuse_triton_clearly_where_it_is_not_installed():
    # The CPU install has no Triton: `kernels` must import, use its references and compiled
    # CPU kernels, and the choice triton must say why it cannot run.
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kernels\n"
        "assert not kernels._triton.INTERPRETING\n"
        "assert kernels.ops_for(torch.device('cpu'), choice='reference').silu_and_mul(torch.ones(1, 4)).shape == (1, 2)\n"
        "assert kernels.silu_and_mul(torch.ones(1, 4)).shape == (1, 2)\n"
        "try:\n    kernels.ops_for(torch.device('cpu'), choice='triton')\n"
        "except NotImplementedError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Triton is not installed" in done.stdout


def test_every_kernel_compiles_for_sm90_and_sm80():
    """The launches the tests above make, compiled as a GPU machine would (15 s with an empty
    Triton cache, ~/.triton/cache; less once it holds them)."""
    with record_launches() as launches:
        for dtype in (torch.float32, torch.bfloat16):  # fp16 compiles as bf16 does
            run_decode([40, 3], 16, 9, 3, 64, dtype, num_splits=2)
            cache, q, meta = mixed_batch([5], [(40, 40)], 16, 9, 3, 64, dtype, seed=1)
            paged_attention_triton(q, cache.k_cache, cache.v_cache, meta, 0.1)
            key, value = fused_kv(3, 3, 64, dtype, seed=2)
            write_kv_triton(key, value, cache.k_cache, cache.v_cache, torch.tensor([0, 1, 2]))
            x, residual, weight = norm_inputs(2, 576, dtype, seed=3)
            add_rms_norm_triton(x, residual, weight, 1e-5)
            rms_norm_triton(x, weight, 1e-5)
            apply_rotary_triton(q, *rope(q.shape[0], 64, seed=4))
            silu_and_mul_triton(torch.randn(2, 64).to(dtype))
            for bits in (8, 4):
                x, qw, bias = quant_inputs(3, 64, 64, bits, dtype, seed=5)
                quant_linear_triton(x, qw, bias)
    assert {launch["kernel"] for launch in launches.values()} == set(all_kernels())
    assert compile_launches(list(launches.values())) == []


def test_the_gpu_kernel_check_runs_its_cpu_dry_run():
    # bench/gpu_check.sh runs on lent GPU machines only: its kernel half must not rot meanwhile.
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "bench/gpu_kernel_check.py", "--dry-run"], cwd=root, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| paged_decode |" in done.stdout and "FAIL" not in done.stdout
