"""A platform of its own for the batch tests: a Redis the tests may kill and restart
empty, daphne with the real engine, and Celery worker processes they may SIGKILL or
SIGTERM and start again. Short leases and sweep intervals make recovery take seconds.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from openai import OpenAI

from tests.conftest import start_redis
from tests.live import ROOT, LiveServer, start_live_server

BIG = {"requests_per_minute": 100_000, "tokens_per_minute": 50_000_000, "concurrent_streams": 1000,
       "max_tokens_per_request": 512, "monthly_token_budget": 10**12}
TIERS = {
    "batch-p2": {"lane": 2, **BIG, "allow_batch": True},
    "batch-p0": {"lane": 0, **BIG, "allow_batch": True},
    "no-batch": {"lane": 1, **BIG},
}
TENANTS = {"acme": "batch-p2", "globex": "batch-p2", "initech": "batch-p0", "hooli": "no-batch",
           "recover": "batch-p2", "paused": "batch-p2"}

# Recovery in seconds, not minutes: a worker that stops heartbeating loses its items after
# 10 s (it heartbeats every 2.5 s; a shorter lease let a live worker on a saturated CI box
# lose items it was still running, and the engine ran them twice); every worker sweeps
# twice a second.
WORKER_ENV = {
    "BATCH_ITEM_LEASE_S": "10",
    "BATCH_SWEEP_INTERVAL_S": "0.5",
    "BATCH_DISPATCH_STALE_S": "30",
    "BATCH_RETRY_BASE_S": "0.5",
    "BATCH_RETRY_MAX_S": "4",
    "BATCH_WORKER_CONCURRENCY": "8",
    "BATCH_DISPATCH_WINDOW": "32",
}


@dataclass
class Worker:
    """One Celery worker process (thread pool) consuming the stack's Redis."""

    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> "Worker":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "config", "worker", "-l", "info", "--without-mingle",
             "--without-gossip", "--without-heartbeat"],
            cwd=ROOT, env=self.env, stdout=self.log_path.open("a"), stderr=subprocess.STDOUT,
        )
        return self

    def signal(self, sig: int, timeout: float = 60) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Stack:
    server: LiveServer
    tmp: Path
    redis_port: int
    redis_proc: subprocess.Popen
    workers: list[Worker] = field(default_factory=list)

    def client(self, tenant: str) -> OpenAI:
        return OpenAI(base_url=self.server.url + "/v1", api_key=self.server.keys[tenant], max_retries=0, timeout=60)

    def worker(self) -> Worker:
        worker = Worker({**self.server.env, **WORKER_ENV, "BATCH_ENGINE_URL": self.server.url},
                        self.tmp / f"worker-{len(self.workers)}.log")
        self.workers.append(worker)
        return worker.start()

    def ensure_worker(self) -> Worker:
        """A running worker: one already started, or a new one."""
        alive = [w for w in self.workers if w.proc is not None and w.proc.poll() is None]
        return alive[0] if alive else self.worker()

    def kill_redis(self) -> None:
        self.redis_proc.kill()
        self.redis_proc.wait(timeout=10)

    def start_redis(self) -> None:
        self.redis_proc, _ = start_redis(self.tmp, self.redis_port)

    def items(self, batch_id: str) -> dict[str, int]:
        """How many items of the batch are in each state (read from the database)."""
        return self.server.django(f"""
from django.db.models import Count
from batches.models import BatchItem
result = dict(BatchItem.objects.filter(batch_id={batch_id!r}).values_list("state").annotate(n=Count("id")))
""")

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("batches")
    redis_proc, redis_url = start_redis(tmp)
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    server, stop_server = start_live_server(tmp, TIERS, TENANTS, {"BATCH_ITEM_LEASE_S": WORKER_ENV["BATCH_ITEM_LEASE_S"]},
                                          redis_url=redis_url)
    stack = Stack(server, tmp, port, redis_proc)
    try:
        yield stack
    finally:
        stack.stop()
        stop_server()
        stack.redis_proc.kill()
        stack.redis_proc.wait(timeout=10)


def chat_lines(n: int, max_tokens: int = 6, prefix: str = "req") -> str:
    """A batch input file of `n` short, distinct chat requests (greedy, so reproducible)."""
    lines = []
    for i in range(n):
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Count to {i % 17 + 2}, please. ({i})"}]}
        lines.append(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    return "\n".join(lines) + "\n"


def wait_for(predicate, timeout: float, interval: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def read_jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]

