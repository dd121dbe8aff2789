"""Weight-only quantization: int8 and int4 weights in groups of 32, and linear layers over them.

A group is 32 consecutive weights of an output row (along in_features), as GGUF's Q8_0 and
Q4_1 blocks are:

- w = d * q + m, m = min(w) and d = (max(w) - m) / (2^bits - 1), or the grid centred on zero
  (Q8_0's) where that is closer, or for int8 int4's 16 levels where those are (a Q4_1 group's);
- int8: q in 0..255, a byte each, d and m fp32 (10 bits a weight);
- int4: q in 0..15, two a byte, d and m fp16 (5 bits a weight): in each group's 16 bytes, byte
  j holds q[j] in its low nibble and q[j + 16] in its high.

int4 is Q4_1's form, so the packaged Q4_1 GGUF, dequantized at load, quantizes back onto the
same grid (a group's min and max are two of its 16 levels): requantizing loses only the fp16
rounding of d and m, and no second copy of the weights in their GGUF blocks is needed. int8
holds those 16 levels exactly on int4's grid (q in 0..15, d and m fp16 values kept in fp32);
on its own 255 steps only to the last bit (d / 17), which in a bf16 engine put 4.8% of
SmolLM2's weights a bf16 step off. A symmetric int8 (w = d * q) did not hold them at all, and
its greedy output left the unquantized model's on 1 of 5 chat prompts at the second token.

`QuantLinear` runs the compiled `quant_linear` (kernels/csrc/cpu_kernels.cpp) for the rows of a
decode step, where it streams 10 or 5 bits per weight instead of 16; longer prefill chunks
dequantize the weights into a temporary and take oneDNN's GEMM, which is compute-bound there.
Where the CPU dots bf16 natively (AVX512-BF16) and x is bf16, `quant_gemm` takes int8 at every
row count and int4 above `QuantRows.int4` rows: it dequantizes 32 weight rows at a time into a
buffer that stays in cache and runs the rows of x against it in bf16 (at par with oneDNN's bf16
GEMM at 256-1,024 rows, ahead below), so int8 computes x @ W_bf16.T with the same bits for a
row whatever batch it is in. Without AMX a bf16 model's int8 layers hold their weights in
those panels' order (`interleave`, int8: 16 outputs' pairs of bytes a vector), so quant_gemm
widens them into a panel's vectors with no gather or transpose, up to 12 rows in registers
with no panel written: a row's output has the bits of the bf16 model's own kernel
(linear_panels) over the same weights, and a bf16 engine's int8 greedy output and perplexity
equal its bf16's. SmolLM2's 30 layers and LM head streamed from memory on a 2-core Zen 5 EPYC,
time over linear_panels' bf16: 0.84-1.0x at 1-8 rows, 1.1x at 12, 1.2-1.45x at 13-32, 1.12x
at 64, 1.04-1.09x at 128-256; from weight rows with a transpose it was 2.3-3.2x at 1-32 rows,
1.5x at 64, 1.15-1.3x at 128-256. Past a few rows it stays above 1x: each weight costs a
widening, an FMA and a rounding on the ports the bf16 dots use, and bf16 is compute-bound
from ~10 rows there. On a CPU with AMX the panels feed AMX's tiles (0.4-0.97x linear_amx's
bf16 at 1-1,024 rows on a 2-core Xeon whose L3 holds the bf16 model, where the vdpbf16ps form
ran 0.2x at 64 rows). int4 keeps `quant_linear` up to `QuantRows.int4` rows: every row count,
except where AMX runs quant_gemm (INT4_LINEAR_ROWS there, raised by the engine to a verifying
pass's 1 + k rows: a verifying pass of speculative decoding must compute a row as a one-row
decode does).
On every CPU a layer holds int4 weights interleaved by 8 output rows (`interleave`: the same
bytes and scales, reordered once at load), so the kernel dots 8 rows in one vector and applies
their scales as they lie: SmolLM2's layers and LM head took 0.66-0.83x the row-by-row form's
time at one row and 0.41-0.53x at 5-32 rows on a 2-core Zen 3 EPYC (batch-1 int4 decode there
went from level with llama.cpp to 1.26x it, paired), and 0.6-0.7x at 1 row, 0.5x at 4-16 on a
2-core Zen 4 EPYC (batch-1 int4 decode there from 1.16-1.24x llama.cpp to 1.57x, paired).
With AVX512-VNNI, from 8 rows it takes two blocks at a time in 512-bit vectors. Where there
is no quant_gemm it takes every row count (0.75x the fp32 engine's layers even at 128-2,048
rows on the Zen 3 EPYC: `maddubs` multiplies 32 byte pairs where an FMA does 8 floats), and
where quant_gemm runs without AMX too (0.65-0.85x quant_gemm's time at 8-2,048 rows on the Zen
4): there a row's int4 output does not depend on the batch. Every reader of the weights
(dequantize, the embedding's rows, quant_gemm, quant_gemm_f32) takes the flag.
Where there is no quant_gemm and x is fp32 (the engine's dtype without AVX512-BF16), int8 rows
past `QuantRows.int8` (INT8_LINEAR_ROWS, 20 with AVX-512; raised like int4's for a verifying pass) and int4
rows past `KERNEL_ROWS` where not interleaved take `quant_gemm_f32`: 64 weight rows at a time
dequantized into a buffer that stays in L2, times x by ATen's GEMM. Over SmolLM2's layers on a
2-core Zen 1 EPYC (AVX2) it ran 1.1-1.8x the fp32 GEMM at 33-256 rows (it reads a byte or half
a byte a weight where fp32 reads four), where dequantizing each layer whole into a fresh copy
ran 0.7-0.8x.
On CUDA, `quant_linear_triton` dequantizes each tile of the weights in registers for every row
count (checked against the dequantized copy under the interpreter and compiled for sm_90 and
sm_80 in the tests; not yet measured on a GPU).
The reference (`quant_linear_reference`) does what the kernel does, in PyTorch: int8 dots x in
fp32 with the dequantized weights; int4 quantizes x to int8 per row and group (as llama.cpp's
Q4_1 x Q8_1 does), takes integer dots and applies the scales per group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import _triton, cpu_ext
from kernels._triton import check, dot_precision, next_power_of_2, tl, triton

GROUP = 32
BITS = {"int8": 8, "int4": 4}
# int8's d and m in fp32: in fp16, d = (max - min) / 255 of a Q4_1 group is rounded off its grid
# (0.05% of the weights' norm), and greedy output left the unquantized model's on 1 of 5 chat
# prompts at the 11th token; in fp32 it did on none.
SCALE_DTYPES = {8: torch.float32, 4: torch.float16}
# Rows up to which the compiled kernel takes a CPU linear layer; above it, the dequantized
# weights and oneDNN. No bench times this crossing alone (bench/kernels_ab.py times
# quant_linear at 1, 2 and 5 rows); the offline rows of bench/engine_throughput.py show its effect.
KERNEL_ROWS = 32
# int4 where quant_gemm runs on AMX tiles (bf16 x): quant_linear up to this many rows, quant_gemm
# past it; where quant_gemm runs without AMX, quant_linear at every row count (int4_linear_rows).
# On a 2-core Zen 4 EPYC (quant_gemm's vdpbf16ps form, which reads the interleaved
# weights as fast as rows: 0.98-1.02x), SmolLM2's 30 layers and LM head, the interleaved kernel's
# time over quant_gemm's with 8-row blocks one at a time: 0.50x at 4 rows, 0.56x at 8, 0.79x at
# 16, 0.92x at 24, 0.95x at 32, 1.11x at 64, 1.25x at 256 (the row-by-row form before it: 0.40x
# at 1 row, 1.18x at 9, 1.91x at 32, so this was 8). With two blocks at a time from 8 rows
# (int4_x16_blocks) it ran 0.65-0.85x at every count (offline int4 480 -> 571 tok/s). Prompts'
# activations quantized to int8 cost the model little: perplexity on tests/engine/data's text,
# bf16 engine, +5.68% over the unquantized model's against +5.61% with quant_gemm's bf16 x past
# 32 rows (2-core AMX Xeon). They once sent 1-2 of the 20 person records of
# tests/serving/test_structured_output.py to max_tokens, which records depending on the
# numerics; that test now bounds its documents. On a 2-core AMX Xeon (quant_gemm on AMX tiles),
# the interleaved kernel's time over quant_gemm's: 0.30x at 1 row, 0.39x at 4, 0.45x at 8,
# 0.65x at 16, 1.05x at 32, 1.44x at 64, 2.3x at 256.
INT4_LINEAR_ROWS = 32
# int8 where there is no quant_gemm and x is fp32: quant_linear up to this many rows,
# quant_gemm_f32 past it. SmolLM2's 30 layers on a 2-core Zen 3 EPYC (AVX2), time over the fp32
# engine's: quant_linear 0.57x at 2 rows, 1.08x at 6 and 8, 1.21x at 16, 1.56x at 32 (it widens
# each weight to fp32 once per 4 rows of x); quant_gemm_f32 1.33x at 6, 1.00x at 8 and 16,
# 0.90x at 32.
INT8_LINEAR_ROWS = 7
# The same on a CPU with AVX-512 but not AVX512-BF16, where MKL's GEMM is slower at these
# sizes: on a 2-core Ice Lake Xeon, over oneDNN's fp32 time, quant_linear 0.74x at 8 rows,
# 0.95x at 12, 1.12x at 16, 1.19x at 20, 1.35x at 24; quant_gemm_f32 0.98x, 1.09x, 1.33x,
# 1.40x, 1.26x.
INT8_LINEAR_ROWS_AVX512 = 20


def int4_linear_rows() -> float:
    """Rows up to which interleaved int4 takes quant_linear where quant_gemm runs: INT4_LINEAR_ROWS
    where quant_gemm runs on AMX tiles, every row count (inf) where it runs without them."""
    module = cpu_ext.load()
    amx = module is not None and module.quant_gemm_available() and module.linear_amx_available()
    return INT4_LINEAR_ROWS if amx else math.inf


def int8_linear_rows() -> int:
    """INT8_LINEAR_ROWS for the CPU the kernels were built for."""
    module = cpu_ext.load()
    return INT8_LINEAR_ROWS_AVX512 if module is not None and module.avx512() else INT8_LINEAR_ROWS


@dataclass
class QuantRows:
    """Row counts a model's quantized layers switch kernels at, one object shared by them all,
    so the engine can set them for the model it was handed (`LlamaModel.verify_rows`)."""

    int4: float = field(default_factory=int4_linear_rows)
    int8: int = field(default_factory=int8_linear_rows)
    # The leading rows of the model's current forward pass that are decodes (or a verifying
    # pass's rows), set by the model around it; None outside one.
    decodes: int | None = None


@dataclass(frozen=True)
class QuantizedWeight:
    bits: int
    qweight: torch.Tensor  # uint8 [n, k] (8 bits) or [n, k / 2] (4 bits)
    scales: torch.Tensor  # [n, k / 32], SCALE_DTYPES[bits]
    mins: torch.Tensor  # likewise
    in_features: int
    # int4 in blocks of 8 output rows, int8 in half panels of 16 (`interleave`): the same bytes
    # and scales, in the order a compiled kernel reads them.
    interleaved: bool = False

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))


def quantize(weight: torch.Tensor, bits: int) -> QuantizedWeight:
    """[n, k] weights (k a multiple of 32) in groups of 32, round to nearest."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"in_features must be a multiple of {GROUP} to quantize, got {k}")
    w = weight.detach().float().view(n, k // GROUP, GROUP)
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    top = (1 << bits) - 1
    lo, hi = w.amin(-1), w.amax(-1)
    # Two grids per group, the closer kept: the group's own range (Q4_1's), or one centred on
    # zero, d = max|w| / (top // 2) and m = -(top // 2 + 1) * d (Q8_0's, whose levels it holds).
    scale_dtype = SCALE_DTYPES[bits]
    low = lo.to(scale_dtype).float()
    ranged = _fit(w, low, (hi - low) / top, top, scale_dtype)
    amax = torch.maximum(hi.abs(), lo.abs())
    d_sym = (amax / (top // 2)).to(scale_dtype).float()
    centred = _fit(w, -(top // 2 + 1) * d_sym, d_sym, top, scale_dtype)
    take = (centred[2] < ranged[2])[..., None]
    q = torch.where(take, centred[0], ranged[0])
    d = torch.where(take[..., 0], centred[1], ranged[1]).contiguous()
    m = torch.where(take[..., 0], centred[3], ranged[3]).contiguous()
    if bits == 8:
        # A third grid: int4's, 16 levels from d and m in fp16 (kept in fp32). A Q4_1 GGUF's
        # group (its minimum and maximum are levels 0 and 15) lands on it exactly, where on the
        # range's 255 steps it does only through d / 17 rounded in fp32, a last bit off: its
        # levels have few significant bits and often sit on a bf16 rounding tie, so 4.8% of
        # SmolLM2's first qkv weights came out of a bf16 engine's int8 a bf16 step off the bf16
        # model's (greedy output then agreed with it on 54% of 5 x 64 tokens; now 100%).
        low16 = lo.to(torch.float16).float()
        sixteen = _fit(w, low16, ((hi - low16) / 15).to(torch.float16).float(), top, scale_dtype)
        error = torch.where(take[..., 0], centred[2], ranged[2])
        own = (sixteen[2] <= error)[..., None]
        q = torch.where(own, sixteen[0], q)
        d = torch.where(own[..., 0], sixteen[1], d).contiguous()
        m = torch.where(own[..., 0], sixteen[3], m).contiguous()
        return QuantizedWeight(8, q.view(n, k).contiguous(), d.contiguous(), m.contiguous(), k)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return QuantizedWeight(4, packed.reshape(n, k // 2).contiguous(), d.contiguous(), m.contiguous(), k)


def _fit(w: torch.Tensor, m: torch.Tensor, d: torch.Tensor, top: int, scale_dtype: torch.dtype):
    """Levels of w on the grid m + d * q (q in 0..top): (q uint8, d, squared error per group, m)."""
    d, m = d.to(scale_dtype), m.to(scale_dtype)
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round((w - m.float()[..., None]) * inv[..., None]).clamp(0, top)
    error = ((q * d.float()[..., None] + m.float()[..., None] - w) ** 2).sum(-1)
    return q.to(torch.uint8), d, error, m


# Output rows a block of `interleave` holds: int4's 8, int8's 16 (a half panel of quant_gemm).
INTERLEAVE = 8
INTERLEAVE_INT8 = 16


def block_rows(bits: int) -> int:
    """Output rows in one interleaved block of `bits`-bit weights."""
    return INTERLEAVE if bits == 4 else INTERLEAVE_INT8


def interleave(qw: QuantizedWeight) -> QuantizedWeight:
    """The weights reordered once at load into the order a compiled kernel reads them, their
    bytes and scales unchanged (`nbytes` the same):

    - int4 in blocks of 8 output rows, group by group: a block's group is 4 vectors of 32 bytes,
      bytes 4i..4i+3 of vector p holding row i's weights 4p..4p+3 (low nibbles) and 4p+16..4p+19
      (high), d and m [n / 8, k / 32, 8]. The compiled kernel then dots 8 rows in one vector,
      lane by lane (kernels/csrc/cpu_kernels.cpp, int4_x8_block).
    - int8 in blocks of 16 output rows, input pair by input pair: [n / 16, k / 2, 16, 2] bytes,
      d and m [n / 16, k / 32, 16] (out_features a multiple of 32): quant_gemm's panels
      (kernels.linear.pack_panels' order), so it widens 32 bytes into a panel's vector as they
      lie, with no transpose (p8_tile)."""
    n, k = qw.out_features, qw.in_features
    groups = k // GROUP
    if qw.interleaved:
        raise ValueError("the weights are interleaved already")
    if qw.bits == 8:
        if n % (2 * INTERLEAVE_INT8):
            raise ValueError(f"interleave takes int8 weights with out_features a multiple of {2 * INTERLEAVE_INT8}")
        q = qw.qweight.view(n // INTERLEAVE_INT8, INTERLEAVE_INT8, k // 2, 2).transpose(1, 2)
        scales, mins = (t.view(n // INTERLEAVE_INT8, INTERLEAVE_INT8, groups).transpose(1, 2) for t in (qw.scales, qw.mins))
        return QuantizedWeight(8, q.reshape(n, k).contiguous(), scales.reshape(n, groups).contiguous(),
                               mins.reshape(n, groups).contiguous(), k, interleaved=True)
    if n % INTERLEAVE:
        raise ValueError(f"interleave takes int4 weights with out_features a multiple of {INTERLEAVE}")
    # Standard byte 4p + c of a group is vector p's byte 4i + c for row i.
    q = qw.qweight.view(n // INTERLEAVE, INTERLEAVE, groups, 4, 4).permute(0, 2, 3, 1, 4)
    scales, mins = (t.view(n // INTERLEAVE, INTERLEAVE, groups).transpose(1, 2) for t in (qw.scales, qw.mins))
    return QuantizedWeight(4, q.reshape(n, k // 2).contiguous(), scales.reshape(n, groups).contiguous(),
                           mins.reshape(n, groups).contiguous(), k, interleaved=True)


def deinterleave(qw: QuantizedWeight) -> QuantizedWeight:
    """`interleave` undone."""
    if not qw.interleaved:
        return qw
    n, k = qw.out_features, qw.in_features
    groups = k // GROUP
    rows = block_rows(qw.bits)
    if qw.bits == 8:
        q = qw.qweight.view(n // rows, k // 2, rows, 2).transpose(1, 2).reshape(n, k)
    else:
        q = qw.qweight.view(n // rows, groups, 4, rows, 4).permute(0, 3, 1, 2, 4).reshape(n, k // 2)
    scales, mins = (t.view(n // rows, groups, rows).transpose(1, 2) for t in (qw.scales, qw.mins))
    return QuantizedWeight(qw.bits, q.contiguous(), scales.reshape(n, groups).contiguous(),
                           mins.reshape(n, groups).contiguous(), k)


def _levels(qw: QuantizedWeight) -> torch.Tensor:
    """The integer levels, [n, k / 32, 32] as int32."""
    qw = deinterleave(qw)
    n = qw.out_features
    if qw.bits == 8:
        return qw.qweight.view(n, -1, GROUP).to(torch.int32)
    packed = qw.qweight.view(n, -1, GROUP // 2)
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.int32)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights back as [n, k]: the compiled kernel on CPU where it is built, else PyTorch."""
    if qw.qweight.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        module = cpu_ext.load()
        if module is not None:
            return module.quant_dequantize(qw.qweight, qw.scales, qw.mins, qw.bits, qw.in_features, dtype,
                                           qw.interleaved)
    qw = deinterleave(qw)
    w = _levels(qw).float() * qw.scales.float()[..., None] + qw.mins.float()[..., None]
    return w.view(qw.out_features, qw.in_features).to(dtype)


def dequantize_rows(qw: QuantizedWeight, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Only `rows` of the weights (an embedding lookup), [len(rows), k]."""
    if qw.interleaved and qw.bits == 8:
        # Each row's bytes and scales gathered back into rows: no block dequantized whole.
        n, k, size = qw.out_features, qw.in_features, INTERLEAVE_INT8
        blocks, lanes = rows // size, rows % size
        q = qw.qweight.view(n // size, k // 2, size, 2)[blocks, :, lanes].reshape(len(rows), k)
        scales, mins = (t.view(n // size, -1, size)[blocks, :, lanes] for t in (qw.scales, qw.mins))
        return dequantize(QuantizedWeight(8, q, scales.contiguous(), mins.contiguous(), k), dtype)
    if qw.interleaved:
        # The blocks that hold the rows, dequantized whole; then each row from its block.
        blocks = rows // INTERLEAVE
        span = qw.qweight.shape[1] * INTERLEAVE, qw.scales.shape[1] * INTERLEAVE
        part = QuantizedWeight(
            4, qw.qweight.view(-1, span[0])[blocks].view(-1, qw.qweight.shape[1]),
            qw.scales.view(-1, span[1])[blocks].view(-1, qw.scales.shape[1]),
            qw.mins.view(-1, span[1])[blocks].view(-1, qw.mins.shape[1]), qw.in_features, interleaved=True)
        whole = dequantize(part, dtype).view(len(rows), INTERLEAVE, qw.in_features)
        return whole[torch.arange(len(rows)), rows % INTERLEAVE]
    part = QuantizedWeight(qw.bits, qw.qweight[rows], qw.scales[rows], qw.mins[rows], qw.in_features)
    return dequantize(part, dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (xq int32 [m, k / 32, 32], xd fp32 [m, k / 32]), as the kernel quantizes it."""
    m, k = x.shape
    g = x.float().view(m, k // GROUP, GROUP)
    amax = g.abs().amax(-1)
    xd = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(g * inv[..., None]).to(torch.int32), xd


def quant_linear_reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `quant_linear` computes, in PyTorch (int4: exact integer dots, fp32 scaling)."""
    qw = deinterleave(qw)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if qw.bits == 8:
        out = x2.float() @ dequantize(qw, torch.float32).T + (bias.float() if bias is not None else 0)
        return out.to(x.dtype).view(*shape[:-1], qw.out_features)
    xq, xd = quantize_activations(x2)
    levels = _levels(qw)
    # [m, n, groups]: each group's integer dot, exact in float64 (at most 32 * 127 * 127).
    dots = torch.einsum("mgc,ngc->mng", xq.double(), levels.double()).float()
    out = (dots * qw.scales.float()[None] * xd[:, None, :]).sum(-1)
    sums = xq.sum(-1).float() * xd  # [m, groups]
    out = out + (sums[:, None, :] * qw.mins.float()[None]).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*shape[:-1], qw.out_features)


@triton.jit
def _quant_linear_kernel(
    x_ptr, q_ptr, d_ptr, m_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_qn, stride_dn, stride_om,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # A [BLOCK_M, BLOCK_N] tile of out = x @ W.T: each step along k dequantizes a [BLOCK_K,
    # BLOCK_N] slice of W in registers (q * d + m, a group's d and m per 32 weights) and takes
    # its dot with x, so W crosses memory as 8 or 4 bits a weight and never as a full copy.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        group = k // 32
        w_mask = k_mask[:, None] & n_mask[None, :]
        if BITS == 8:
            q = tl.load(q_ptr + rn[None, :] * stride_qn + k[:, None], mask=w_mask, other=0)
        else:
            # A group's 16 bytes hold its weight j in byte j's low nibble and j + 16 in its high.
            j = k % 32
            packed = tl.load(q_ptr + rn[None, :] * stride_qn + (group * 16 + j % 16)[:, None], mask=w_mask, other=0)
            q = (packed >> ((j // 16) * 4).to(tl.uint8)[:, None]) & 0xF
        d = tl.load(d_ptr + rn[None, :] * stride_dn + group[:, None], mask=w_mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + rn[None, :] * stride_dn + group[:, None], mask=w_mask, other=0.0).to(tl.float32)
        # The weights rounded to x's dtype, as the CPU path's dequantized copy is; both tiles
        # then in fp32 (dot_precision: the interpreter multiplies bf16 tiles as raw bits).
        w = (q.to(tl.float32) * d + m).to(x.dtype).to(tl.float32)
        acc += tl.dot(x.to(tl.float32), w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# tl.dot's smallest tile is 16 a side: a decode step's one row rides in a 16-row tile, which
# costs nothing that matters where reading W is the whole cost. Not tuned on a GPU yet.
_BLOCK_M_MAX, _BLOCK_N, _BLOCK_K = 64, 64, 64


def quant_linear_triton(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + b over quantized weights, in Triton (CUDA, or CPU under the interpreter)."""
    check("quant_linear", x, *(() if bias is None else (bias,)))
    k, n = qw.in_features, qw.out_features
    if x.shape[-1] != k:
        raise ValueError(f"quant_linear: x has {x.shape[-1]} features, the weights take {k}")
    if qw.qweight.device != x.device or qw.qweight.dtype != torch.uint8 or qw.qweight.stride(-1) != 1:
        raise ValueError("quant_linear: the quantized weights must be contiguous uint8 on x's device")
    shape = x.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        block_m = min(_BLOCK_M_MAX, max(16, next_power_of_2(rows)))
        grid = (triton.cdiv(n, _BLOCK_N), triton.cdiv(rows, block_m))
        _quant_linear_kernel[grid](
            x2, qw.qweight, qw.scales, qw.mins, bias if bias is not None else x2, out,
            rows, n, k, x2.stride(0), qw.qweight.stride(0), qw.scales.stride(0), out.stride(0),
            BITS=qw.bits, HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype),
            BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        )
    return out.view(*shape[:-1], n)


class QuantLinear:
    """y = x @ W.T + b over quantized weights; holds only the quantized form."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, use_triton: bool = True,
                 rows: QuantRows | None = None, dtype: torch.dtype | None = None):
        self.qw = qw
        self.rows = rows or QuantRows()
        self.bias = bias
        self.out_features, self.in_features = qw.out_features, qw.in_features
        self.module = cpu_ext.load() if qw.qweight.device.type == "cpu" else None
        # On CUDA the Triton kernel reads the quantized weights as they are; without Triton
        # each call dequantizes a copy for cuBLAS.
        self.triton = use_triton and qw.qweight.is_cuda and _triton.available()
        self.gemm = self.module is not None and self.module.quant_gemm_available()
        # int4's kernel reads 8 rows interleaved, and quant_gemm reads that layout as well.
        if self.module is not None and qw.bits == 4 and not qw.interleaved and qw.out_features % INTERLEAVE == 0:
            self.qw = interleave(qw)
        # int8 in a bf16 model (`dtype`, the x it will take) where quant_gemm runs without AMX:
        # in its panels' order (AMX's forms read weight rows as they are).
        if (self.module is not None and qw.bits == 8 and not qw.interleaved and dtype == torch.bfloat16 and self.gemm
                and not self.module.linear_amx_available() and qw.out_features % (2 * INTERLEAVE_INT8) == 0):
            self.qw = interleave(qw)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton:
            return quant_linear_triton(x, self.qw, self.bias)
        rows = x.numel() // self.in_features
        qw = self.qw
        if self.gemm and x.dtype == torch.bfloat16 and (qw.bits == 8 or rows > self.rows.int4):
            decodes = self.rows.decodes or 0
            if qw.bits == 4 and 0 < decodes <= self.rows.int4 and x.dim() == 2:
                # Decodes beside a prompt's chunk keep the kernel they take alone, so a greedy
                # int4 reply does not change with another request's prefill (on AMX, where
                # quant_gemm takes a step past 32 rows).
                out = x.new_empty(rows, self.out_features)
                out[:decodes] = self.module.quant_linear(x[:decodes], qw.qweight, qw.scales, qw.mins, self.bias, 4,
                                                         qw.interleaved)
                out[decodes:] = self.module.quant_gemm(x[decodes:], qw.qweight, qw.scales, qw.mins, self.bias, 4,
                                                       qw.interleaved)
                return out
            return self.module.quant_gemm(x, qw.qweight, qw.scales, qw.mins, self.bias, qw.bits, qw.interleaved)
        if self.module is not None and rows <= self._linear_rows(x) and x.dtype in (torch.float32, torch.bfloat16):
            return self.module.quant_linear(x, qw.qweight, qw.scales, qw.mins, self.bias, qw.bits, qw.interleaved)
        if self.module is not None and x.dtype == torch.float32:
            return self.module.quant_gemm_f32(x, qw.qweight, qw.scales, qw.mins, self.bias, qw.bits, qw.interleaved)
        return F.linear(x, dequantize(qw, x.dtype), self.bias)

    def _linear_rows(self, x: torch.Tensor) -> float:
        """Rows up to which quant_linear takes x where quant_gemm does not. Interleaved int4 at
        every count (where quant_gemm takes bf16 x past `rows.int4`, fp32 x too): its integer
        dots ran 0.32-0.75x the fp32 engine's layers at 4-2,048 rows on a 2-core Zen 3 EPYC,
        where quant_gemm_f32 ran 1.04-1.58x."""
        if self.qw.interleaved:
            # int8 in panels is quant_gemm's; x of another dtype (not the model's) takes the panels
            # to ATen (quant_gemm_f32) or a dequantized copy.
            return math.inf if self.qw.bits == 4 else 0
        if self.qw.bits == 8 and not self.gemm and x.dtype == torch.float32:
            return self.rows.int8
        return KERNEL_ROWS
