"""Another tenant's time to first token while one tenant attacks the platform, in one run.

A live platform (daphne, the real SmolLM2 engine, its own Redis and database, as the
end-to-end tests start it) serves two tenants of the same lane: a bystander and an
attacker on a tier with ordinary limits. The bystander sends short streamed chats one
after another (TTFT = until the first content delta arrives) while nothing else runs,
then again during each attack:

  long stops     the attacker's chats carry 4 stop strings: first 260,000 characters each
                 (refused now), then the longest allowed, decoding 256 tokens
  n fan-out      8 parallel streams with the largest `n`
  blank file     POST /v1/files of 40 MiB of blank lines, over and over
  stalled readers  16 streams that never read a byte, max_tokens 512
  Redis stall    every 3 s Redis pauses writes for 1.5 s (a dependency fault, not a tenant)
  DB lock        the attacker's key row (PostgreSQL) or the whole SQLite file held by a writer
  400 burst      400 concurrent streamed chats from the attacker, opened and written one after
                 another by a process of its own (all out in ~12 ms), max_tokens 4, once per
                 bystander request, which starts as they connect
  400 GETs       the same with GET /v1/models: a sync view, a thread of its own per request
                 (INTAKE_PENDING_PER_CALLER bounds how many of a tenant's run at once)

Target: the bystander's p99 within 2x its idle p99 on every row. In the Redis stall row
admission misses Redis's deadline (LIMITS_REDIS_TIMEOUT_S) once per pause and the process
decides alone until a write lands (tenants.fallback).

    .venv/bin/python bench/isolation.py             # ~3-4 minutes on 2 cores
    .venv/bin/python bench/isolation.py --samples 40
    .venv/bin/python bench/isolation.py --front nginx   # through deploy/nginx.conf, as production runs
    .venv/bin/python bench/isolation.py --front nginx --replicas 2   # make cluster's shape
    .venv/bin/python bench/isolation.py --front python --replicas 2  # make run with WEB_WORKERS=2
    .venv/bin/python bench/isolation.py --only "400 burst" --attacker-nice 19
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import selectors
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from tests.conftest import free_port  # noqa: E402
from tests.live import (  # noqa: E402
    DEFAULT_ENV,
    READY_TIMEOUT_S,
    WEB_BACKLOG,
    LiveServer,
    http_status,
    start_live_server,
)
from tests.nginx_front import start_nginx  # noqa: E402
from tests.serving.rawsse import SocketStream, request_bytes  # noqa: E402

BIG = {"requests_per_minute": 100_000, "tokens_per_minute": 50_000_000, "concurrent_streams": 1000,
       "max_tokens_per_request": 512, "monthly_token_budget": 10**12}
# The attacker pays for an ordinary tier: what a hostile tenant can do within its rights.
ORDINARY = {"requests_per_minute": 6_000, "tokens_per_minute": 2_000_000, "concurrent_streams": 16,
            "max_tokens_per_request": 512, "monthly_token_budget": 10**12, "allow_batch": True}
TIERS = {"bench-bystander": {"lane": 1, **BIG}, "bench-ordinary": {"lane": 1, **ORDINARY}}
TENANTS = {"bystander": "bench-bystander", "attacker": "bench-ordinary"}
ENV = {"STREAM_STALL_S": "10", "FILES_MAX_BYTES": str(64 * 1024**2)}


def chat(content: str, max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": True, **extra}


def ttft(server: LiveServer, key: str) -> float | None:
    """Seconds until the first content delta of a short streamed chat; None if it failed."""
    start = time.monotonic()
    try:
        stream = SocketStream(server.url, "/v1/chat/completions", key, chat("Say hello.", 8, temperature=0), timeout=60)
    except OSError:
        return None
    try:
        while True:
            event = stream.next_event()
            if event is None or event.data == "[DONE]":
                return None
            data = event.json()
            if "error" in data:
                return None
            if any(c.get("delta", {}).get("content") for c in data.get("choices", ())):
                return time.monotonic() - start
    except (OSError, ValueError):
        return None
    finally:
        stream.close()


def probe(server: LiveServer, samples: int) -> tuple[list[float], int]:
    times, failed = [], 0
    for _ in range(samples):
        t = ttft(server, server.keys["bystander"])
        if t is None:
            failed += 1
        else:
            times.append(t)
        time.sleep(0.05)
    return sorted(times), failed


def pct(values: list[float], q: float) -> float:
    """Nearest rank: with few samples p99 is the worst one."""
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, int(round(q / 100 * len(values) + 0.5)) - 1))]


# --- attacks: each runs until `stop` is set ----------------------------------------------------


def post(server: LiveServer, path: str, body: bytes, headers: dict[str, str], timeout: float = 60) -> int:
    """Send a request, return its status (0 when the connection failed)."""
    host, port = server.url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            try:
                sock.sendall(head.encode() + body)
            except OSError:  # answered and closed before the body was all sent: as urllib3 and
                pass         # httpcore do, read the answer, which the kernel still holds
            status = sock.recv(64).split(b" ", 2)
            while sock.recv(65536):
                pass
            return int(status[1]) if len(status) > 1 else 0
    except (OSError, ValueError):
        return 0


def in_threads(count: int, work: Callable[[], None], stop: threading.Event) -> list[threading.Thread]:
    def loop() -> None:
        while not stop.is_set():
            work()
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def long_stops(server: LiveServer, stop: threading.Event, outcome: dict) -> list[threading.Thread]:
    key = server.keys["attacker"]
    huge = chat("Tell me a long story.", 256, stop=["x" * 260_000 + str(i) for i in range(4)], ignore_eos=True)
    outcome["260k stops"] = post(server, "/v1/chat/completions", json.dumps(huge).encode(),
                                 {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    allowed = int(outcome.get("stop_chars") or 1000)
    body = json.dumps(chat("Tell me a long story.", 256, stop=["q" * (allowed - 1) + str(i) for i in range(4)],
                           ignore_eos=True)).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return in_threads(4, lambda: outcome.setdefault("statuses", []).append(
        post(server, "/v1/chat/completions", body, headers)), stop)


def fan_out(server: LiveServer, stop: threading.Event, outcome: dict) -> list[threading.Thread]:
    body = json.dumps(chat("Write a poem.", 256, n=16, ignore_eos=True)).encode()
    headers = {"Authorization": f"Bearer {server.keys['attacker']}", "Content-Type": "application/json"}
    return in_threads(8, lambda: outcome.setdefault("statuses", []).append(
        post(server, "/v1/chat/completions", body, headers)), stop)


def blank_file(server: LiveServer, stop: threading.Event, outcome: dict) -> list[threading.Thread]:
    boundary = "benchboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b.jsonl\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode() + b"\n" * (40 * 1024**2) + f"\r\n--{boundary}--\r\n".encode()
    headers = {"Authorization": f"Bearer {server.keys['attacker']}",
               "Content-Type": f"multipart/form-data; boundary={boundary}"}
    return in_threads(2, lambda: outcome.setdefault("statuses", []).append(post(server, "/v1/files", body, headers)), stop)


def stalled_readers(server: LiveServer, stop: threading.Event, outcome: dict) -> list[threading.Thread]:
    host, port = server.url.removeprefix("http://").split(":")
    wire = request_bytes(server.url, "/v1/chat/completions", server.keys["attacker"],
                         chat("Count to ten thousand.", 512, ignore_eos=True))
    sockets = []
    for _ in range(16):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few hundred events
        sock.connect((host, int(port)))
        sock.sendall(wire)
        sockets.append(sock)

    def hold() -> None:
        stop.wait()
        for sock in sockets:
            sock.close()
    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    return [thread]


def redis_stall(server: LiveServer, stop: threading.Event, outcome: dict) -> list[threading.Thread]:
    client = redis.Redis.from_url(server.redis_url)

    def pause() -> None:
        while not stop.is_set():
            client.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
            stop.wait(3.0)
        client.execute_command("CLIENT", "UNPAUSE")
    thread = threading.Thread(target=pause, daemon=True)
    thread.start()
    return [thread]


def db_lock(server: LiveServer, stop: threading.Event, outcome: dict) -> list[threading.Thread]:
    url = server.env["DATABASE_URL"]
    ready = threading.Event()

    def hold() -> None:
        if url.startswith("sqlite:///"):
            conn = sqlite3.connect(url.removeprefix("sqlite:///"), timeout=30, isolation_level=None)
            conn.execute("BEGIN IMMEDIATE")  # the one write lock of the file
            outcome["lock"] = "SQLite write lock"
        else:
            import psycopg
            conn = psycopg.connect(url.replace("postgres://", "postgresql://", 1))
            prefix = server.keys["attacker"].split("_")[0].removeprefix("sk-")
            conn.execute("SELECT 1 FROM tenants_apikey WHERE prefix = %s FOR UPDATE", (prefix,))
            outcome["lock"] = "attacker's key row FOR UPDATE"
        ready.set()
        stop.wait()
        conn.rollback()
        conn.close()
    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    ready.wait(30)
    headers = {"Authorization": f"Bearer {server.keys['attacker']}", "Content-Type": "application/json"}
    body = json.dumps(chat("Hi.", 4)).encode()
    return [thread, *in_threads(2, lambda: outcome.setdefault("statuses", []).append(
        post(server, "/v1/chat/completions", body, headers)), stop)]


def _burst_sockets(url: str, wire: bytes, count: int) -> tuple[list[int], dict]:
    """`count` requests (`wire`) on as many connections, each one's status (0: no answer), and
    what the client spent: the seconds from the first connect to the last request sent, and its
    CPU seconds. A load generator's loop, as wrk or h2load run one: each connection opened and
    its request written in turn (on loopback the kernel completes the handshake without the
    server), then every answer read through one selector. The asyncio client this replaced (a
    task, a stream reader and writer a connection) spent 98 ms of CPU a burst against 32 here,
    and sent its burst so slowly that the bystander's request usually landed ahead of it: the
    same server, 30 bursts each, interleaved, gave the bystander a first token at p50 0.050 s
    behind it and 0.163 s behind this one."""
    host, port = url.removeprefix("http://").split(":")
    cpu, start = time.process_time(), time.monotonic()
    heads: dict[socket.socket, bytes] = {}
    failed = 0
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.connect((host, int(port)))
            sock.sendall(wire)
        except OSError:
            sock.close()
            failed += 1
            continue
        heads[sock] = b""
    sent = time.monotonic() - start
    statuses = [0] * failed
    with selectors.DefaultSelector() as selector:
        for sock in heads:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        while heads:
            ready = selector.select(timeout=120)
            if not ready:
                break
            for event, _ in ready:
                sock = event.fileobj
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if data and len(heads[sock]) < 16:
                    heads[sock] += data[:16]
                if not data:
                    selector.unregister(sock)
                    sock.close()
                    parts = heads.pop(sock).split(b" ", 2)
                    statuses.append(int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0)
        for sock in heads:  # no answer in two minutes
            sock.close()
            statuses.append(0)
    return statuses, {"sent_s": sent, "cpu_s": time.process_time() - cpu}


# The burst's client shares the server's cores on one box, where a real attacker would not:
# --attacker-nice 19 shows what that costs the bystander (its client stays at 0).
ATTACKER_NICE = [0]


def _burst_process(url: str, wire: bytes, count: int, statuses, spent, fired, nice: int) -> None:
    os.nice(nice)
    fired.set()
    done, costs = _burst_sockets(url, wire, count)
    statuses.extend(done)
    spent.update(costs)


def _chats(server: LiveServer) -> bytes:
    return request_bytes(server.url, "/v1/chat/completions", server.keys["attacker"], chat("Hi.", 4))


def _gets(server: LiveServer) -> bytes:
    host = server.url.removeprefix("http://")
    return (f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {server.keys['attacker']}\r\n"
            "Connection: close\r\n\r\n").encode()


def burst(server: LiveServer, stop: threading.Event, outcome: dict, wire=_chats) -> list[threading.Thread]:
    # From a process of its own, on one event loop: 400 client threads in this process took the
    # GIL from the bystander's client and inflated its times (p99 0.34 s, half of it here).
    manager = multiprocessing.Manager()
    statuses, spent, fired = manager.list(), manager.dict(), manager.Event()
    child = multiprocessing.Process(target=_burst_process, args=(server.url, wire(server), 400, statuses, spent, fired,
                                                                 ATTACKER_NICE[0]))
    child.start()
    fired.wait(30)

    def collect() -> None:
        child.join()
        outcome["statuses"] = list(statuses)
        outcome["client"] = dict(spent)
        manager.shutdown()
    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    return [thread]


def bursts(server: LiveServer, samples: int, wire=_chats) -> tuple[list[float], int, dict]:
    """A burst per bystander sample, the sample sent as the burst's connections open, and the
    server idle again before the next: every sample meets a burst. One burst under `samples`
    sequential requests met 1-2 of 40 (a burst is over in about a second), so its p99 was one
    sample and its p50 the idle one."""
    times, failed, statuses, sent, cpu = [], 0, [], [], []
    for _ in range(samples):
        outcome: dict = {}
        threads = burst(server, threading.Event(), outcome, wire)
        t = ttft(server, server.keys["bystander"])
        if t is None:
            failed += 1
        else:
            times.append(t)
        for thread in threads:
            thread.join(timeout=120)
        statuses.extend(outcome.get("statuses", []))
        client = outcome.get("client", {})
        if client:
            sent.append(client["sent_s"])
            cpu.append(client["cpu_s"])
        server.wait_idle(timeout=60)
    note = {"statuses": statuses}
    if sent:
        note["burst sent in (median)"] = f"{pct(sorted(sent), 50) * 1000:.0f} ms"
        note["its client's CPU (median)"] = f"{pct(sorted(cpu), 50) * 1000:.0f} ms"
    return sorted(times), failed, note


# Rows whose attack is fired once per sample, the sample taken inside it.
PER_SAMPLE = {"400 burst": bursts, "400 GETs": lambda server, samples: bursts(server, samples, _gets)}

ATTACKS = [("long stops", long_stops), ("n fan-out", fan_out), ("blank file", blank_file),
           ("stalled readers", stalled_readers), ("Redis stall", redis_stall), ("DB lock", db_lock),
           ("400 burst", None), ("400 GETs", None)]  # None: fired once per sample (PER_SAMPLE)


def summary(outcome: dict) -> str:
    statuses = outcome.get("statuses", [])
    counts: dict[int, int] = {}
    for s in statuses:
        counts[s] = counts.get(s, 0) + 1
    parts = [f"{k}: {v}" for k, v in outcome.items() if k not in ("statuses", "stop_chars")]
    if counts:
        parts.append("attacker statuses " + ", ".join(f"{s or 'conn error'} x{n}" for s, n in sorted(counts.items())))
    return "; ".join(parts)


def start_replicas(server: LiveServer, tmp: Path, count: int,
                   env_of: Callable[[int], dict[str, str]] = lambda number: {}) -> tuple[list[str], Callable[[], None]]:
    """`count` more daphne replicas of `server` (its database, Redis and settings, a usage journal
    each, and `env_of(its number)`: 2, 3...), as `make cluster` runs them; returns their addresses
    and how to stop them."""
    procs: list[subprocess.Popen] = []

    def stop() -> None:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)

    addresses = []
    try:
        for i in range(count):
            port = free_port()
            env = dict(server.env, REPLICA_URL=f"http://127.0.0.1:{port}",
                       USAGE_OUTBOX_DIR=str(tmp / f"usage-outbox-{i + 2}"), **env_of(i + 2))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "daphne", "-e", f"tcp:port={port}:interface=127.0.0.1:backlog={WEB_BACKLOG}",
                 "config.asgi:application"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                stdout=(tmp / f"replica-{i + 2}.log").open("w"), stderr=subprocess.STDOUT))
            addresses.append(f"127.0.0.1:{port}")
        deadline = time.monotonic() + READY_TIMEOUT_S
        for address, proc in zip(addresses, procs):
            while http_status(f"http://{address}/readyz") != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"replica {address} never became ready")
                time.sleep(0.25)
    except BaseException:
        stop()
        raise
    return addresses, stop


def workers_env(tmp: Path, workers: int) -> dict[str, str]:
    """What `make run` with WEB_WORKERS sets for its web processes (platform/run.py)."""
    return {"INFERENCE_ENGINE_SOCKET": str(tmp / "engine.sock"), "FRONT_SOCKET": str(tmp / "front.sock"),
            "WEB_WORKER": "0", "REPLICA_ID": "web-1", "LIMITS_FALLBACK_SHARE": str(1 / workers)}


def start_engine_server(tmp: Path, env: dict[str, str]) -> Callable[[], None]:
    """`manage.py engine_server`, which the web processes connect to (they wait while it loads)."""
    child_env = {k: v for k, v in os.environ.items() if k != "DJANGO_ENV"}
    child_env.update(DEFAULT_ENV, **env, DJANGO_SETTINGS_MODULE="config.settings")
    proc = subprocess.Popen([sys.executable, "manage.py", "engine_server"], cwd=ROOT, env=child_env,
                            stdin=subprocess.DEVNULL, stdout=(tmp / "engine.log").open("w"), stderr=subprocess.STDOUT)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return stop


def start_python_front(tmp: Path, port: int, env: dict[str, str], workers: int) -> Callable[[], None]:
    """platform/front.py on `port`, handing connections to `workers` web processes."""
    child_env = dict(os.environ, WEB_WORKERS=str(workers), WEB_PORT=str(port), WEB_BACKLOG=str(WEB_BACKLOG),
                     FRONT_SOCKET=env["FRONT_SOCKET"], LOG_LEVEL="WARNING", DRAIN_TIMEOUT_S=DEFAULT_ENV["DRAIN_TIMEOUT_S"])
    proc = subprocess.Popen([sys.executable, "platform/front.py"], cwd=ROOT, env=child_env, stdin=subprocess.DEVNULL,
                            stdout=(tmp / "front.log").open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while http_status(f"http://127.0.0.1:{port}/healthz") != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the front never served: " + (tmp / "front.log").read_text())
        time.sleep(0.1)

    def stop() -> None:
        proc.terminate()
        proc.wait(timeout=30)
    return stop


def replica_of(server: LiveServer, logs: list[Path], tenant: str) -> int:
    """Which replica (1-based, in `logs`' order) serves `tenant`'s key: the one whose access
    log gains a chat line for one of its requests."""
    def counts() -> list[int]:
        return [log.read_text(errors="replace").count('"POST /v1/chat/completions"') for log in logs]
    before = counts()
    server.post_json("/v1/chat/completions", {**chat("Hi.", 1), "stream": False}, server.keys[tenant])
    for _ in range(50):
        grown = [i for i, (a, b) in enumerate(zip(before, counts())) if b > a]
        if grown:
            return grown[0] + 1
        time.sleep(0.1)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=25, help="bystander requests per row")
    parser.add_argument("--only", action="append", choices=[name for name, _ in ATTACKS], metavar="ATTACK",
                        help="run only this attack (again for more), beside the idle row; default: all")
    parser.add_argument("--attacker-nice", type=int, default=0, help="the 400 burst's client process's nice value")
    parser.add_argument("--front", choices=["none", "nginx", "python"], default="none",
                        help="nginx: every request (bystander's and attacker's) through deploy/nginx.conf in "
                             "front of the server, as production runs it (Debian's nginx); python: through "
                             "platform/front.py to --replicas web processes sharing one engine (`make run` with "
                             "WEB_WORKERS)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="with --front nginx: this many daphne replicas (each with its engine) behind it, sharing "
                             "the database and Redis, routed by key as deploy/nginx.conf does; with --front python: "
                             "this many web processes sharing one engine; the table says which replica each "
                             "tenant's key lands on (when idle)")
    parser.add_argument("--bystander-on", choices=["any", "other", "same"], default="any",
                        help="with --replicas: give the bystander new keys until its key lands on another replica "
                             "than the attacker's, or on the same one (default: wherever its first key lands)")
    args = parser.parse_args()
    if args.replicas > 1 and args.front == "none":
        parser.error("--replicas needs --front nginx or python")
    ATTACKER_NICE[0] = args.attacker_nice
    attacks = [(name, attack) for name, attack in ATTACKS if not args.only or name in args.only]
    with tempfile.TemporaryDirectory() as tmp:
        env, stop_engine = dict(ENV), None
        if args.front == "python":
            env.update(workers_env(Path(tmp), args.replicas))
            stop_engine = start_engine_server(Path(tmp), env)
        server, stop_server = start_live_server(Path(tmp), TIERS, TENANTS, env)
        stop_front = stop_replicas = None
        placed = ""
        try:
            if args.front in ("nginx", "python"):
                extra, stop_replicas = start_replicas(
                    server, Path(tmp), args.replicas - 1,
                    lambda n: {"WEB_WORKER": str(n - 1), "REPLICA_ID": f"web-{n}"} if args.front == "python" else {})
                port = free_port()
                if args.front == "nginx":
                    stop_front = start_nginx(Path(tmp) / "nginx", port, [server.url.removeprefix("http://"), *extra])
                else:
                    stop_front = start_python_front(Path(tmp), port, env, args.replicas)
                server = dataclasses.replace(server, url=f"http://127.0.0.1:{port}", ws_url=f"ws://127.0.0.1:{port}")
                if extra:
                    logs = [server.log_path] + [Path(tmp) / f"replica-{i + 2}.log" for i in range(len(extra))]
                    attacker_on = replica_of(server, logs, "attacker")
                    for attempt in range(40):
                        bystander_on = replica_of(server, logs, "bystander")
                        if args.bystander_on == "any" or (bystander_on == attacker_on) == (args.bystander_on == "same"):
                            break
                        server.keys["bystander"] = server.django(
                            "from tenants import actions\nfrom tenants.models import Tenant\n"
                            f"result = actions.issue_key(Tenant.objects.get(pk={server.tenant_ids['bystander']!r}), "
                            f"name='live-{attempt}').plaintext")
                    placed = (f"; {args.replicas} replicas: the bystander's key on replica {bystander_on}, "
                              f"the attacker's on {attacker_on}")
            stop_chars = server.django("from django.conf import settings\n"
                                       "result = getattr(settings, 'MAX_STOP_CHARS', 0)")
            for _ in range(20):  # warm: the first requests after start ran up to 0.11 s (idle p99 0.05)
                ttft(server, server.keys["bystander"])
            idle, idle_failed = probe(server, args.samples)
            rows = [("idle", idle, idle_failed, "")]
            for name, attack in attacks:
                if name in PER_SAMPLE:
                    times, failed, outcome = PER_SAMPLE[name](server, args.samples)
                    rows.append((name, times, failed, summary(outcome)))
                    print(f"{name}: done", file=sys.stderr, flush=True)
                    continue
                stop = threading.Event()
                outcome: dict = {"stop_chars": stop_chars}
                threads = attack(server, stop, outcome)
                time.sleep(1.0)  # let the attack take hold
                times, failed = probe(server, args.samples)
                stop.set()
                for t in threads:
                    t.join(timeout=120)
                server.wait_idle(timeout=60)
                rows.append((name, times, failed, summary(outcome)))
                print(f"{name}: done", file=sys.stderr, flush=True)
        finally:
            if stop_front is not None and args.front == "nginx":
                stop_front()
            if stop_replicas is not None:
                stop_replicas()
            stop_server()
            if stop_front is not None and args.front == "python":  # it waits for its web processes to leave
                stop_front()
            if stop_engine is not None:
                stop_engine()
    base = pct(idle, 99)
    print(f"\nbystander: streamed chat, max_tokens 8, {args.samples} sequential requests per row; "
          f"attacker on a tier of {ORDINARY['concurrent_streams']} concurrent generations; "
          f"database {'PostgreSQL' if os.environ.get('DATABASE_URL', '').startswith('postgres') else 'SQLite'}"
          + ("; through nginx (deploy/nginx.conf)" if args.front == "nginx" else "")
          + ("; through platform/front.py, the web processes sharing one engine" if args.front == "python" else "")
          + placed
          + ("; the engine in a thread of the web process"
             if os.environ.get("INFERENCE_ENGINE_PROCESS", "").lower() in ("0", "false", "off", "no")
             else "; the engine in a process of its own")
          + (f"; the burst's client at nice {args.attacker_nice}" if args.attacker_nice else "")
          + "\n")
    print("| attack | TTFT p50 (s) | TTFT p99 (s) | p99 / idle p99 | bystander failures | what the attacker got |")
    print("|---|---|---|---|---|---|")
    for name, times, failed, note in rows:
        p99 = pct(times, 99)
        print(f"| {name} | {pct(times, 50):.3f} | {p99:.3f} | {p99 / base:.2f}x | {failed} | {note} |")


if __name__ == "__main__":
    main()
