"""The Triton kernels against their PyTorch references, on CPU tensors through Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before `kernels` is imported).

Every output is NaN before a kernel runs, so an element it fails to write fails the
test; every cache slot no sequence owns is NaN too, so a read outside a context does.
Shapes are awkward on purpose: SmolLM2's 9 query heads over 3 KV heads, 32/8 at
head_dim 128, 4/4 at an odd 24, rows of 1 and 129, a hidden size of 1823.

The same launches are then compiled for sm_90 and sm_80 without a GPU.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from kernels._triton import INTERPRETING
from kernels.activation import silu_and_mul_impl, silu_and_mul_ref, silu_and_mul_triton
from kernels.kv_cache import write_kv_impl, write_kv_triton
from kernels.rmsnorm import add_rms_norm_impl, add_rms_norm_ref, add_rms_norm_triton, rms_norm_impl, rms_norm_ref, rms_norm_triton
from kernels.rotary import apply_rotary_impl, apply_rotary_ref, apply_rotary_triton
from tests.kernels.gpu_compile import compile_launches, kernels as all_kernels, record_launches
from tests.kernels.test_cpu_kernels import (
    ATTENTION_IDS,
    ATTENTION_SHAPES,
    DTYPES,
    gen,
    norm_inputs,
    one_thread,  # noqa: F401  (an autouse fixture: one thread, as there)
    rope,
    same_bits,
)

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


# -- silu_and_mul ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", [1, 781, 1536])  # 1536 > one program's 1024 columns
@pytest.mark.parametrize("rows", [1, 7, 129])
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
@pytest.mark.parametrize("rows", [1, 7, 129])
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
@pytest.mark.parametrize("rows", [1, 129])
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
@pytest.mark.parametrize("rows", [1, 7, 129])
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


# -- errors ----------------------------------------------------------------------------------


def test_unsupported_inputs_are_refused_with_the_reason():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        silu_and_mul_triton(x.double())
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul_triton(torch.randn(4, 7))
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        rms_norm_triton(x.t(), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul_triton(x, out=torch.empty(4, 8))
    cache = torch.zeros(4, 16, 3, 64)
    with pytest.raises(ValueError, match="share strides"):
        write_kv_triton(torch.randn(1, 3, 64), torch.randn(1, 3, 64), cache, cache.transpose(0, 1).contiguous().transpose(0, 1), torch.tensor([0]))


# -- the dispatcher ----------------------------------------------------------------------


def test_kernels_triton_resolves_the_ops_to_triton(monkeypatch):
    monkeypatch.setenv("KERNELS", "triton")
    probe = torch.empty(0)
    assert silu_and_mul_impl(probe) is silu_and_mul_triton
    assert rms_norm_impl(probe) is rms_norm_triton and add_rms_norm_impl(probe) is add_rms_norm_triton
    assert apply_rotary_impl(probe) is apply_rotary_triton
    assert write_kv_impl(probe) is write_kv_triton
    monkeypatch.setenv("KERNELS", "auto")  # CPU tensors: never Triton unless forced
    assert silu_and_mul_impl(probe) is not silu_and_mul_triton


def test_kernels_import_and_refuse_triton_clearly_where_it_is_not_installed():
    # The CPU install has no Triton: `kernels` must import, use its references and compiled
    # CPU kernels, and KERNELS=triton must say why it cannot run.
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import os, torch, kernels\n"
        "os.environ['KERNELS'] = 'reference'\n"
        "assert kernels.silu_and_mul(torch.ones(1, 4)).shape == (1, 2)\n"
        "os.environ['KERNELS'] = 'triton'\n"
        "try:\n    kernels.ops_for(torch.device('cpu'))\n"
        "except NotImplementedError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Triton is not installed" in done.stdout


def test_every_kernel_compiles_for_sm90_and_sm80():
    """The launches the tests above make, compiled as a GPU machine would (15 s with an empty
    Triton cache, ~/.triton/cache; less once it holds them)."""
    with record_launches() as launches:
        for dtype in (torch.float32, torch.bfloat16):  # fp16 compiles as bf16 does
            key, value = fused_kv(3, 3, 64, dtype, seed=2)
            write_kv_triton(key, value, *poisoned((2, 1, 16, 3, 64), dtype), torch.tensor([0, 1, 2]))
            x, residual, weight = norm_inputs(2, 576, dtype, seed=3)
            add_rms_norm_triton(x, residual, weight, 1e-5)
            rms_norm_triton(x, weight, 1e-5)
            apply_rotary_triton(torch.randn(3, 9, 64).to(dtype), *rope(3, 64, seed=4))
            silu_and_mul_triton(torch.randn(2, 64).to(dtype))
    assert {launch["kernel"] for launch in launches.values()} == set(all_kernels())
    assert compile_launches(list(launches.values())) == []

