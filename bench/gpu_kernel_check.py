"""The Triton kernels on a CUDA GPU: each against its PyTorch reference, then timed, with
its achieved bandwidth against the GPU's copy bandwidth measured in the same run.

Outputs are NaN before each kernel runs, so an unwritten element fails the check.
Correctness is checked in bf16 (the serving dtype, at the timed sizes) and in fp32 (a
smaller case: fp32 attention takes another `tl.dot` precision). Timed sizes move far more
than the H200's 60 MB of L2, so the bandwidth is HBM's. Bytes are the least a kernel must
move (read its inputs once, write its outputs once); attention prefill is bound by
arithmetic, not bytes, so its TFLOP/s (causal, counted as 4 * q * k * head_dim per pair)
is given beside.

    python3 bench/gpu_kernel_check.py                                   # on a GPU
    TRITON_INTERPRET=1 python3 bench/gpu_kernel_check.py --dry-run      # CPU smoke run, tiny sizes
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton  # noqa: E402
from kernels.kv_cache import write_kv_ref, write_kv_triton  # noqa: E402
from kernels.paged_attention import PagedAttentionMetadata  # noqa: E402
from kernels.paged_decode import paged_decode_ref, paged_decode_triton  # noqa: E402
from kernels.paged_prefill import paged_prefill_ref, paged_prefill_triton  # noqa: E402
from kernels.rmsnorm import add_rms_norm_ref, add_rms_norm_triton  # noqa: E402
from kernels.rotary import apply_rotary_ref, apply_rotary_triton  # noqa: E402


@dataclass
class Result:
    kernel: str
    shape: str
    dtype: torch.dtype
    max_error: float  # relative to the reference's largest magnitude
    ok: bool
    ms: float = math.nan
    gbytes: float = 0.0  # bytes moved, in GB
    tflop: float = 0.0


def tolerance(dtype: torch.dtype) -> float:
    # On a GPU both sides round to nearest; attention's fp32 softmax vs SDPA's bf16 steps: 4 eps.
    return 1e-4 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps


def compare(name: str, shape: str, out: torch.Tensor, expected: torch.Tensor) -> Result:
    finite = bool(out.isfinite().all())
    err = ((out.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-6)).item()
    return Result(name, shape, out.dtype, err, finite and err <= tolerance(out.dtype))


def time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()  # compiles on first call
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def copy_bandwidth_gbs(device: torch.device, nbytes: int) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=20)
    return 2 * nbytes / ms / 1e6  # read + write


def nan(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, math.nan, dtype=dtype, device=device)


def size_gb(*tensors: torch.Tensor) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 1e9


# -- the cases ---------------------------------------------------------------------------------


def check_silu_and_mul(rows, inter, dtype, device) -> tuple[Result, Callable]:
    x = torch.randn(rows, 2 * inter, dtype=dtype, device=device) * 4
    out = silu_and_mul_triton(x, out=nan((rows, inter), dtype, device))
    result = compare("silu_and_mul", f"{rows}x{inter}", out, silu_and_mul_ref(x))
    result.gbytes = size_gb(x, out)
    return result, lambda: silu_and_mul_triton(x, out=out)


def check_add_rms_norm(rows, hidden, dtype, device) -> tuple[Result, Callable]:
    x, residual = torch.randn(2, rows, hidden, dtype=dtype, device=device)
    weight = 1 + 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    expected, _ = add_rms_norm_ref(x, residual, weight, 1e-5)
    out, _ = add_rms_norm_triton(x, residual.clone(), weight, 1e-5, out=nan(x.shape, dtype, device))
    result = compare("add_rms_norm", f"{rows}x{hidden}", out, expected)
    result.gbytes = size_gb(x, residual, residual, out)  # reads x and residual, writes residual and out
    return result, lambda: add_rms_norm_triton(x, residual, weight, 1e-5, out=out)


def check_rotary(tokens, heads, head_dim, dtype, device) -> tuple[Result, Callable]:
    x = torch.randn(tokens, heads, head_dim, dtype=dtype, device=device)
    angles = torch.rand(tokens, head_dim // 2, device=device) * 100
    cos, sin = angles.cos(), angles.sin()
    out = apply_rotary_triton(x, cos, sin, out=nan(x.shape, dtype, device))
    result = compare("apply_rotary", f"{tokens}x{heads}x{head_dim}", out, apply_rotary_ref(x, cos, sin))
    result.gbytes = size_gb(x, x, cos, sin)
    return result, lambda: apply_rotary_triton(x, cos, sin)


def check_write_kv(tokens, kv_heads, head_dim, dtype, device) -> tuple[Result, Callable]:
    block_size = 16
    key, value = torch.randn(2, tokens, kv_heads, head_dim, dtype=dtype, device=device)
    k_cache, v_cache = nan((2, tokens // block_size + 8, block_size, kv_heads, head_dim), dtype, device)
    slots = torch.randperm(k_cache.shape[0] * block_size, device=device)[:tokens]
    write_kv_triton(key, value, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv_ref(key, value, k_ref, v_ref, slots)
    flat = lambda c: c.view(-1, kv_heads, head_dim)[slots]  # noqa: E731
    result = compare("write_kv", f"{tokens}x{kv_heads}x{head_dim}", torch.cat([flat(k_cache), flat(v_cache)]), torch.cat([flat(k_ref), flat(v_ref)]))
    result.gbytes = 2 * size_gb(key, value)
    return result, lambda: write_kv_triton(key, value, k_cache, v_cache, slots)


def paged(lens, query_lens, block_size, kv_heads, head_dim, dtype, device):
    """A cache holding sequences of `lens` tokens in shuffled blocks, and their metadata."""
    needed = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(needed), device=device, dtype=torch.int32)
    k_cache, v_cache = torch.randn(2, sum(needed), block_size, kv_heads, head_dim, dtype=dtype, device=device)
    width = max(needed)
    tables = torch.zeros(len(lens), width, dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[start : start + n]
        start += n
    return k_cache, v_cache, PagedAttentionMetadata.of(query_lens, lens, tables, device)


def check_decode(num_seqs, context, heads, kv_heads, head_dim, dtype, device) -> tuple[Result, Callable]:
    lens = [context] * num_seqs
    k_cache, v_cache, meta = paged(lens, [1] * num_seqs, 16, kv_heads, head_dim, dtype, device)
    q = torch.randn(num_seqs, heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5

    def run(out=None):
        return paged_decode_triton(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, max_seq_len=context, out=out)

    out = run(out=nan(q.shape, dtype, device))
    expected = paged_decode_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_host, scale)
    result = compare("paged_decode", f"{num_seqs}x{context} {heads}/{kv_heads}x{head_dim}", out, expected)
    result.gbytes = 2 * num_seqs * context * kv_heads * head_dim * k_cache.element_size() / 1e9 + size_gb(q, out)
    return result, run


def check_prefill(num_seqs, prefix, chunk, heads, kv_heads, head_dim, dtype, device) -> tuple[Result, Callable]:
    lens = [prefix + chunk] * num_seqs
    k_cache, v_cache, meta = paged(lens, [chunk] * num_seqs, 16, kv_heads, head_dim, dtype, device)
    q = torch.randn(num_seqs * chunk, heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    out = paged_prefill_triton(q, k_cache, v_cache, meta, scale, out=nan(q.shape, dtype, device))
    result = compare("paged_prefill", f"{num_seqs}x({prefix}+{chunk}) {heads}/{kv_heads}x{head_dim}", out, paged_prefill_ref(q, k_cache, v_cache, meta, scale))
    result.gbytes = 2 * sum(lens) * kv_heads * head_dim * k_cache.element_size() / 1e9 + size_gb(q, out)
    pairs = num_seqs * (chunk * prefix + chunk * (chunk + 1) / 2)  # (query, key) pairs under the causal mask
    result.tflop = 4 * pairs * heads * head_dim / 1e12
    return result, lambda: paged_prefill_triton(q, k_cache, v_cache, meta, scale, out=out)


def cases(dry_run: bool):
    """(check, args, timed): bf16 at sizes that move hundreds of MB, then fp32 for correctness only."""
    bf16, fp32 = torch.bfloat16, torch.float32
    if dry_run:
        yield check_silu_and_mul, (3, 96, bf16), True
        yield check_add_rms_norm, (3, 576, bf16), True
        yield check_rotary, (3, 9, 64, bf16), True
        yield check_write_kv, (20, 3, 64, bf16), True
        yield check_decode, (2, 40, 9, 3, 64, bf16), True
        yield check_prefill, (2, 20, 17, 9, 3, 64, fp32), False
        return
    yield check_silu_and_mul, (16384, 8192, bf16), True
    yield check_add_rms_norm, (16384, 4096, bf16), True
    yield check_rotary, (16384, 32, 128, bf16), True
    yield check_write_kv, (65536, 8, 128, bf16), True
    yield check_decode, (64, 2048, 9, 3, 64, bf16), True  # SmolLM2's heads, a full batch
    yield check_decode, (64, 2048, 32, 8, 128, bf16), True  # Llama-3-8B's
    yield check_decode, (2, 32768, 32, 8, 128, bf16), True  # few long contexts: split across programs
    yield check_prefill, (8, 1536, 512, 9, 3, 64, bf16), True
    yield check_prefill, (8, 1536, 512, 32, 8, 128, bf16), True
    yield check_decode, (16, 1000, 32, 8, 128, fp32), False
    yield check_prefill, (4, 300, 200, 9, 3, 64, fp32), False


def table(results: list[Result], copy_gbs: float) -> str:
    lines = [
        f"| kernel | shape | dtype | vs reference (max rel. error) | time | bandwidth | of copy ({copy_gbs:.0f} GB/s) | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        check = f"{'ok' if r.ok else 'FAIL'} ({r.max_error:.1e})"
        dtype = str(r.dtype).removeprefix("torch.")
        if math.isnan(r.ms):
            lines.append(f"| {r.kernel} | {r.shape} | {dtype} | {check} | | | | correctness only |")
            continue
        gbs = r.gbytes / (r.ms / 1e3)
        note = f"{r.tflop / (r.ms / 1e3):.0f} TFLOP/s" if r.tflop else ""
        lines.append(f"| {r.kernel} | {r.shape} | {dtype} | {check} | {r.ms * 1e3:.0f} us | {gbs:.0f} GB/s | {gbs / copy_gbs:.0%} | {note} |")
    return "\n".join(lines)


def parse_args(doc: str, dry_run_help: str, kernels_option: bool = False) -> tuple[argparse.Namespace, torch.device]:
    """The options bench/gpu_check.sh passes (--dry-run, --table FILE, and with kernels_option
    --kernels CHOICE); the device they mean."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help=dry_run_help)
    ap.add_argument("--table", help="also write the table (markdown) to this file")
    if kernels_option:
        from kernels import CHOICES

        ap.add_argument("--kernels", default="auto", choices=CHOICES, help="the engine's kernels choice (EngineConfig.kernels)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name} torch={torch.__version__}", flush=True)
    return args, device


def print_table(text: str, path: str | None) -> None:
    print("\n" + text)
    if path:
        Path(path).write_text(text + "\n")


def main() -> int:
    args, device = parse_args(__doc__, "tiny sizes on CPU (run it with TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs(device, (64 << 20) if args.dry_run else (2 << 30))
    results = []
    for check, check_args, timed in cases(args.dry_run):
        result, run = check(*check_args, device)
        if timed:
            result.ms = time_ms(run, device, reps=20)
        print(f"{result.kernel} {result.shape} {result.dtype}: {'ok' if result.ok else 'FAIL'} ({result.max_error:.1e}), {result.ms:.3f} ms", flush=True)
        results.append(result)
        del run  # frees this case's tensors before the next allocates
    print_table(table(results, copy_gbs), args.table)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
