"""Linear layers at a few rows: the compiled `linear_small` (and, in bf16 on a CPU with
AMX, `linear_amx`) against oneDNN and `F.linear`.

Every linear layer of SmolLM2-135M (30 layers' qkv, o, gate_up, down and the tied
lm_head: 538 MB in fp32, 269 MB in bf16), each with its own weights so
they stream from memory as in a real step, timed side by side for 1 to 48 rows of x
(to 512 with AMX). Prints milliseconds per pass over the whole model, the weight bytes
read per second and the ratios; the smallest row count where oneDNN wins is where
`kernels.linear`'s SMALL_ROWS (AMX_ROWS) should stop. (In bf16 with AVX512-BF16 but no AMX
the engine leaves every row count to oneDNN: see kernels/linear.py.)

    .venv/bin/python bench/linear_small.py [--dtype bfloat16]    # one to two minutes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import cpu_ext  # noqa: E402
from kernels.linear import pack_amx  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]


def best_of(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    dtype = getattr(torch, ap.parse_args().dtype)
    ext = cpu_ext.load()
    if ext is None:
        sys.exit("the CPU extension did not build")
    amx = dtype == torch.bfloat16 and ext.linear_amx_available()
    if dtype == torch.bfloat16 and not amx and not ext.linear_small_bf16(HIDDEN):
        sys.exit("this build has no bf16 path for a few rows (it needs AMX or AVX512-BF16)")
    weights = [(torch.randn(n, k) * 0.02).to(dtype) for n, k in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    tiles = [pack_amx(w) for w in weights] if amx else []
    small_ok = dtype == torch.float32 or ext.linear_small_bf16(HIDDEN)
    total = sum(w.numel() * w.element_size() for w in weights)
    print(f"# {total / 1e6:.0f} MB of {dtype} weights, {torch.get_num_threads()} threads, torch {torch.__version__}")
    first = "linear_amx" if amx else "linear_small"
    print(f"| rows | {first} | linear_small | oneDNN packed | F.linear | oneDNN / {first} | F.linear / {first} |")
    print("|---|---|---|---|---|---|---|")
    for rows in (1, 2, 4, 8, 16, 24, 32, 48) + ((64, 128, 256, 512) if amx else ()):
        xs = {k: torch.randn(rows, k).to(dtype) for k in (HIDDEN, INTER)}
        small = best_of(lambda: [ext.linear_small(xs[w.shape[1]], w) for w in weights]) if small_ok else float("nan")
        fast = best_of(lambda: [ext.linear_amx(xs[w.shape[1]], t) for w, t in zip(weights, tiles)]) if amx else small
        onednn = best_of(
            lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, packed)]
        )
        plain = best_of(lambda: [F.linear(xs[w.shape[1]], w) for w in weights])
        print(
            f"| {rows} | {fast * 1e3:.1f} ms ({total / fast / 1e9:.1f} GB/s) | {small * 1e3:.1f} ms | {onednn * 1e3:.1f} ms "
            f"| {plain * 1e3:.1f} ms | {onednn / fast:.2f}x | {plain / fast:.2f}x |",
            flush=True,
        )

if __name__ == "__main__":
    main()
