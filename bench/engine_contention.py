"""A one-row decode step of the real engine while other work runs on the same cores: in this
process (as the web tier runs beside the engine in daphne) or in other processes (as it would
with the engine in a process of its own), with the engine's kernels on every core or on one.

The other work is request-like Python: 2 ms of interpreter work, then 0.5 ms waiting, over
and over, in `--workers` threads or processes. Printed: the step's p50 and p90 in each
condition and p50 over the quiet one's at the same thread count.

A last row steps the quiet engine from a second thread while this one, which loaded it, lives
on: libgomp then manages two teams of threads, more than the cores, and has each team's
workers sleep between parallel regions instead of spinning. The engine process loads on a
thread that ends before its engine thread starts for this (inference.engine.process).

    .venv/bin/python bench/engine_contention.py [--workers 1 2] [--steps 60]   # ~1 minute
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from inference.engine.api import SamplingParams  # noqa: E402
from inference.engine.config import EngineConfig, resolve_device, resolve_dtype  # noqa: E402
from inference.engine.engine import LLMEngine  # noqa: E402

BUSY_S, WAIT_S = 0.002, 0.0005


def request_like(stop) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < BUSY_S:
            sum(range(200))
        time.sleep(WAIT_S)


def step_times(engine: LLMEngine, steps: int) -> tuple[float, float]:
    """p50 and p90 of a lone sequence's decode steps, in ms."""
    engine.add_request(f"c{time.monotonic_ns()}", list(range(100, 132)),
                       SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))
    engine.step()  # the prompt
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times) * 1000, times[int(len(times) * 0.9)] * 1000


def beside(engine: LLMEngine, steps: int, workers: int, where: str) -> tuple[float, float]:
    if where == "thread":
        stop = threading.Event()
        others = [threading.Thread(target=request_like, args=(stop,), daemon=True) for _ in range(workers)]
    else:
        stop = multiprocessing.Event()
        others = [multiprocessing.Process(target=request_like, args=(stop,), daemon=True) for _ in range(workers)]
    for other in others:
        other.start()
    time.sleep(0.2)
    try:
        return step_times(engine, steps)
    finally:
        stop.set()
        for other in others:
            other.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="threads or processes of other work")
    parser.add_argument("--steps", type=int, default=60, help="decode steps per condition")
    args = parser.parse_args()
    cores = torch.get_num_threads()
    engine = LLMEngine.from_config(EngineConfig(kv_cache_bytes=1 << 28, max_num_seqs=8, enable_prefix_caching=False))
    dtype = resolve_dtype(engine.config.dtype, resolve_device(engine.config.device))
    print(f"# {str(dtype).removeprefix('torch.')}, {cores} cores; "
          f"other work: {BUSY_S * 1000:g} ms busy, {WAIT_S * 1000:g} ms waiting")
    print("\n| engine threads | other work | step p50 (ms) | step p90 (ms) | p50 / quiet |")
    print("|---|---|---|---|---|")
    for threads in sorted({1, cores}, reverse=True):
        torch.set_num_threads(threads)
        step_times(engine, 10)  # warm
        quiet = step_times(engine, args.steps)
        print(f"| {threads} | none | {quiet[0]:.1f} | {quiet[1]:.1f} | 1.00x |", flush=True)
        for workers in args.workers:
            for where in ("thread", "process"):
                p50, p90 = beside(engine, args.steps, workers, where)
                plural = {"thread": "threads", "process": "processes"}[where] if workers > 1 else where
                label = f"{workers} {plural} {'in this process' if where == 'thread' else 'apart'}"
                print(f"| {threads} | {label} | {p50:.1f} | {p90:.1f} | {p50 / quiet[0]:.2f}x |", flush=True)
    torch.set_num_threads(cores)
    quiet = step_times(engine, args.steps)
    apart: list = []
    second = threading.Thread(target=lambda: (step_times(engine, 10), apart.append(step_times(engine, args.steps))))
    second.start()
    second.join()
    p50, p90 = apart[0]
    print(f"| {cores} | none; stepped on a second thread, the loading one alive | {p50:.1f} | {p90:.1f} | "
          f"{p50 / quiet[0]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
