"""Two builds of the CPU kernels side by side in one process: a git revision's
kernels/csrc/cpu_kernels.cpp (the base) against the working tree's.

On a shared VM the speed of a run moves by 10-25% within the hour, more than most kernel
changes are worth, so two runs at different times cannot tell them apart. Here both builds
load into one process and take turns on the same inputs, and the medians are compared.
Workloads, where both builds have the op: decode attention over 30 layers' caches (64
sequences of 32-500 tokens, and 16), and SmolLM2's four layer linears over 30 layers at
1, 16 and 64 rows (linear_amx in bf16 where AMX is usable, else linear_small, and
linear_panels in bf16 where the CPU dots bf16 without AMX), int4
`quant_linear` over the same linears at 1, 2 and 5 rows (a decode, and a verifying pass of 4
speculative tokens; again with the weights interleaved by 8 rows where both builds take them),
and in bf16 where the CPU dots bf16, int8 `quant_gemm` at 1-64 rows (a
batch's decode steps).

    .venv/bin/python bench/kernels_ab.py [--base HEAD] [--dtype bfloat16] [--reps 8]   # ~2 minutes
"""

from __future__ import annotations

import argparse
import hashlib
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels import cpu_ext, quant  # noqa: E402
from kernels.linear import pack_amx, pack_panels  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
LINEARS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def build(source: str, tag: str, workdir: Path):
    path = workdir / f"{tag}.cpp"
    path.write_text(source)
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    return load(name=f"kernels_ab_{tag}_{digest}", sources=[str(path)], extra_cflags=cpu_ext.CFLAGS,
                extra_ldflags=cpu_ext.LDFLAGS, build_directory=str(workdir), verbose=False)


def decode_workload(dtype: torch.dtype, seqs: int):
    rng = random.Random(0)
    lens = [rng.randint(32, 500) for _ in range(seqs)]
    blocks = sum(-(-n // BLOCK) for n in lens)
    order = list(range(blocks))
    rng.shuffle(order)  # blocks scattered through the cache, as a running engine leaves them
    tables = torch.zeros(seqs, 32, dtype=torch.int32)
    it = iter(order)
    for i, n in enumerate(lens):
        for j in range(-(-n // BLOCK)):
            tables[i, j] = next(it)
    caches = [(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype), torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype))
              for _ in range(LAYERS)]
    q = torch.randn(seqs, HEADS, HEAD_DIM).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    def run(ext):
        for k, v in caches:
            ext.paged_decode(q, k, v, tables, seq_lens, HEAD_DIM**-0.5)

    return run


def linear_workload(dtype: torch.dtype, rows: int, amx: bool):
    weights = [[(torch.randn(n, k) * 0.02).to(dtype) for n, k in LINEARS] for _ in range(LAYERS)]
    xs = [torch.randn(rows, k).to(dtype) for _, k in LINEARS]
    if amx:
        packed = [[pack_amx(w) for w in layer] for layer in weights]
        return lambda ext: [ext.linear_amx(x, p) for layer in packed for x, p in zip(xs, layer)]
    return lambda ext: [ext.linear_small(x, w) for layer in weights for x, w in zip(xs, layer)]


def panels_workload(rows: int):
    """linear_panels (bf16 where the CPU dots it natively, no AMX) over SmolLM2's four layer
    linears, 30 layers, each weight packed as the engine packs it."""
    panels = [[pack_panels((torch.randn(n, k) * 0.02).to(torch.bfloat16)) for n, k in LINEARS] for _ in range(LAYERS)]
    xs = [torch.randn(rows, k).to(torch.bfloat16) for _, k in LINEARS]
    return lambda ext: [ext.linear_panels(x, p) for layer in panels for x, p in zip(xs, layer)]


def quant_workload(dtype: torch.dtype, rows: int, op: str = "quant_linear", bits: int = 4, interleaved: bool = False):
    """`op` (quant_linear, quant_gemm) over SmolLM2's four layer linears, 30 layers, the
    weights at `bits` in groups of 32 (int4 interleaved by 8 rows, as AVX2 CPUs hold them)."""
    weights = [[quant.quantize(torch.randn(n, k) * 0.02, bits) for n, k in LINEARS] for _ in range(LAYERS)]
    xs = [torch.randn(rows, k).to(dtype) for _, k in LINEARS]
    if interleaved:
        weights = [[quant.interleave(q) for q in layer] for layer in weights]
        return lambda ext: [ext.quant_linear(x, q.qweight, q.scales, q.mins, None, bits, True)
                            for layer in weights for x, q in zip(xs, layer)]
    return lambda ext: [getattr(ext, op)(x, q.qweight, q.scales, q.mins, None, bits)
                        for layer in weights for x, q in zip(xs, layer)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision whose kernels are the base (default HEAD)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=8, help="turns each build takes per workload")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rel = "kernels/csrc/cpu_kernels.cpp"
    base_src = subprocess.run(["git", "show", f"{args.base}:{rel}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    work_src = (ROOT / rel).read_text()
    if base_src == work_src:
        print(f"# the working tree's kernels are {args.base}'s: comparing a build with itself")
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"base": build(base_src, "base", Path(tmp)), "work": build(work_src, "work", Path(tmp))}
        both = lambda op: all(hasattr(b, op) for b in builds.values())  # noqa: E731
        amx = dtype == torch.bfloat16 and both("linear_amx") and all(b.linear_amx_available() for b in builds.values())
        workloads = [(f"paged_decode, {n} sequences", decode_workload(dtype, n)) for n in (64, 16)]
        if amx or (both("linear_small") and (dtype == torch.float32 or all(b.linear_small_bf16(576) for b in builds.values()))):
            name = "linear_amx" if amx else "linear_small"
            workloads += [(f"{name}, {r} rows", linear_workload(dtype, r, amx)) for r in (1, 16, 64)]
        if (dtype == torch.bfloat16 and not amx and both("linear_panels")
                and all(b.linear_panels_available() for b in builds.values())):
            workloads += [(f"linear_panels, {r} rows", panels_workload(r)) for r in (1, 16, 64)]
        if both("quant_linear"):
            workloads += [(f"quant_linear int4, {r} rows", quant_workload(dtype, r)) for r in (1, 2, 5)]
        if both("quant_linear") and all("interleaved" in b.quant_linear.__doc__ for b in builds.values()):
            workloads += [(f"quant_linear int4 interleaved, {r} rows", quant_workload(dtype, r, interleaved=True))
                          for r in (1, 2, 5)]
        if dtype == torch.bfloat16 and both("quant_gemm") and all(b.quant_gemm_available() for b in builds.values()):
            workloads += [(f"quant_gemm int8, {r} rows", quant_workload(dtype, r, "quant_gemm", 8)) for r in (1, 4, 16, 32, 64)]
        print(f"# base {args.base} vs working tree, {dtype}, {torch.get_num_threads()} threads, {args.reps} turns each")
        print("| workload | base | working tree | base / working tree |\n|---|---|---|---|")
        for name, run in workloads:
            times = {tag: [] for tag in builds}
            for tag, ext in builds.items():
                run(ext)  # warm-up
            for _ in range(args.reps):
                for tag, ext in builds.items():
                    start = time.perf_counter()
                    run(ext)
                    times[tag].append(time.perf_counter() - start)
            med = {tag: sorted(t)[len(t) // 2] * 1e3 for tag, t in times.items()}
            print(f"| {name} | {med['base']:.2f} ms | {med['work']:.2f} ms | {med['base'] / med['work']:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
