"""Do batch jobs slow interactive traffic? P0 time to first token with and without a
running 500-item batch, through the whole platform.

One run starts everything for real: its own Redis, daphne with the SmolLM2 engine, a
Celery worker (thread pool, BATCH_WORKER_CONCURRENCY items in flight). The same seeded
sequence of P0 chat streams (SSE, short prompts, 16 new tokens, Poisson arrivals) is
sent twice: first on an idle platform, then while a 500-line batch (P2, 64 new tokens an
item) runs. TTFT is measured by the client: request sent -> first content delta read.

    .venv/bin/python bench/batch_interference.py --requests 120     # ~3 minutes on 2 cores
    .venv/bin/python bench/batch_interference.py --requests 120 --worker-prefix ''

The worker runs as platform/Procfile runs it, under `nice -n 10`: batch work is
background work, and a worker sharing the engine's cores must not take them from it at
every item turnover (`--worker-prefix ''` measures it without).

Target: P0 TTFT p99 with the batch under 1.5x the idle p99. The batch must still be
running when the second pass ends (otherwise it measured nothing) and it must keep
moving meanwhile (items finished during the pass are reported).
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.live import ROOT as _ROOT, start_live_server  # noqa: E402

BIG = {"requests_per_minute": 1_000_000, "tokens_per_minute": 10**9, "concurrent_streams": 10_000,
       "max_tokens_per_request": 512, "monthly_token_budget": 10**15}
TIERS = {"bench-p0": {"lane": 0, **BIG}, "bench-batch": {"lane": 2, **BIG, "allow_batch": True}}
TENANTS = {"interactive": "bench-p0", "data-team": "bench-batch"}
TOPICS = ["the sea", "a mountain", "bread", "rain", "a library", "trains", "the moon", "coffee", "winter", "a garden"]


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile: with few samples p99 is the worst one, not an interpolation."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def ttft_of_one_stream(url: str, key: str, topic: str) -> tuple[float, float]:
    """(TTFT, admitted): admitted is when the stream's headers arrived, i.e. when the
    platform had authenticated, tokenized, admitted and submitted the request."""
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 16, "temperature": 0,
                       "messages": [{"role": "user", "content": f"Write one sentence about {topic}."}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    sent = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=120) as response:
        admitted = time.perf_counter() - sent
        for raw in response:
            line = raw.decode().strip()
            if first is None and line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    first = time.perf_counter() - sent
    if first is None:
        raise RuntimeError("a stream ended without content")
    return first, admitted


def p0_pass(url: str, key: str, n: int, rate: float, seed: int) -> list[tuple[float, float]]:
    """`n` streams arriving as a Poisson process of `rate`/s; their (TTFT, admitted) in seconds."""
    rng = random.Random(seed)
    start, at, futures = time.perf_counter(), 0.0, []
    with ThreadPoolExecutor(max_workers=16) as pool:
        for i in range(n):
            at += rng.expovariate(rate)
            time.sleep(max(0.0, start + at - time.perf_counter()))
            futures.append(pool.submit(ttft_of_one_stream, url, key, TOPICS[i % len(TOPICS)]))
        return [f.result() for f in futures]


def batch_file(n: int, max_tokens: int) -> bytes:
    lines = []
    for i in range(n):
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "messages": [{"role": "user", "content": f"Describe item number {i} of a warehouse inventory."}]}
        lines.append(json.dumps({"custom_id": f"item-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return ("\n".join(lines) + "\n").encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=120, help="P0 streams per pass")
    parser.add_argument("--rate", type=float, default=2.0, help="P0 arrivals per second")
    parser.add_argument("--batch-items", type=int, default=500)
    parser.add_argument("--batch-tokens", type=int, default=64, help="new tokens per batch item")
    parser.add_argument("--concurrency", type=int, default=8, help="batch items in flight per worker")
    parser.add_argument("--worker-prefix", default="nice -n 10",
                        help="what the worker runs under; platform/Procfile's default, '' for none")
    args = parser.parse_args()

    from openai import OpenAI

    tmp = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    env = {"INFERENCE_KV_CACHE_BYTES": str(256 * 1024**2), "LOG_LEVEL": "WARNING", "MAX_REQUEST_BYTES": str(1024**2)}
    server, stop_server = start_live_server(tmp, TIERS, TENANTS, env)
    worker = subprocess.Popen(
        [*args.worker_prefix.split(), sys.executable, "-m", "celery", "-A", "config", "worker", "-l", "warning", "--without-mingle",
         "--without-gossip", "--without-heartbeat"],
        cwd=_ROOT, env={**server.env, "BATCH_ENGINE_URL": server.url, "BATCH_WORKER_CONCURRENCY": str(args.concurrency),
                        "BATCH_SWEEP_INTERVAL_S": "1"},
        stdout=(tmp / "worker.log").open("w"), stderr=subprocess.STDOUT)
    key = server.keys["interactive"]
    try:
        p0_pass(server.url, key, 8, 4.0, seed=99)  # warm-up: first-request costs stay out of both passes
        idle = p0_pass(server.url, key, args.requests, args.rate, seed=1)

        client = OpenAI(base_url=server.url + "/v1", api_key=server.keys["data-team"], max_retries=0)
        upload = client.files.create(file=("inventory.jsonl", batch_file(args.batch_items, args.batch_tokens)),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while server.stats()["requests_running"] < args.concurrency // 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the batch never started running:\n" + (tmp / "worker.log").read_text())
            time.sleep(0.2)
        before = client.batches.retrieve(batch.id).request_counts.completed
        loaded = p0_pass(server.url, key, args.requests, args.rate, seed=1)
        after = client.batches.retrieve(batch.id)
        if after.status != "in_progress":
            raise RuntimeError(f"the batch was {after.status} before the loaded pass ended: enlarge it")
        client.batches.cancel(batch.id)
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
        stop_server()

    ratio = pct([t for t, _ in loaded], 99) / pct([t for t, _ in idle], 99)
    print(f"\nP0 TTFT, {args.requests} streams at {args.rate}/s, 16 new tokens; batch: {args.batch_items} items x "
          f"{args.batch_tokens} tokens, {args.concurrency} in flight, worker under {args.worker_prefix or 'no prefix'!r}")
    print(f"{'':<22}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'admitted p99':>14}")
    for name, results in (("idle", idle), ("with running batch", loaded)):
        ttft = [t for t, _ in results]
        print(f"{name:<22}{pct(ttft, 50) * 1000:>10.0f}{pct(ttft, 90) * 1000:>10.0f}{pct(ttft, 99) * 1000:>10.0f}"
              f"{pct([a for _, a in results], 99) * 1000:>14.0f}")
    print(f"batch items finished during the loaded pass: {after.request_counts.completed - before}")
    print(f"p99 ratio (with batch / idle): {ratio:.2f}x  (target < 1.5x: {'met' if ratio < 1.5 else 'NOT met'})")


if __name__ == "__main__":
    main()
