"""`make run` with WEB_WORKERS=2: the front (platform/front.py) on PORT hands connections to two
web processes that share one engine (`manage.py engine_server`). Through the front the API
serves as with one process (the openai client, streams, a batch through the Celery worker);
a tenant's burst keeps its own web process and another tenant goes to the other; a web process
or the engine killed is started again while the rest serves on; SIGINT stops everything.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from openai import OpenAI

from tests.conftest import free_port
from tests.integration.test_run import (
    _a_batch_runs_through_the_worker,
    alive,
    descendants,
    listen_backlog,
    stop_launcher,
)
from tests.live import http_status
from tests.reliability.test_connection_burst import burst, listen_overflows

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("front", ROOT / "platform" / "front.py")
front = sys.modules["front"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(front)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc").exists(), reason="walks /proc")]
TIMEOUT_S = 300


def processes(launcher: int, marker: bytes) -> set[int]:
    """The launcher's descendants running `marker` themselves (not a shell naming it)."""
    found = set()
    for pid in descendants(launcher):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if alive(pid) and Path(os.fsdecode(args[0])).name.startswith("python") and any(
                marker in arg for arg in args[1:3]):
            found.add(pid)
    return found


def wait(condition, what: str, log: Path, timeout: float = TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what}:\n{log.read_text()[-5000:]}"
        time.sleep(0.2)
    return result


def manage(env: dict, *args: str) -> str:
    done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout.strip().splitlines()[-1].split()[-1]


def served_by(log: Path, local_port: int) -> set[str]:
    """Which web processes logged a request from this client port (daphne's access log)."""
    return set(re.findall(rf"(web\d)\.1 +\| 127\.0\.0\.1:{local_port} ", log.read_text()))


def get_from(port: int, key: str) -> int:
    """GET /v1/models on a connection of its own; its local port."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                     f"Connection: close\r\n\r\n".encode())
        while sock.recv(65536):
            pass
        return sock.getsockname()[1]


def test_two_web_processes_behind_the_front_share_one_engine(tmp_path):
    port, token = free_port(), secrets.token_urlsafe(32)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DJANGO_ENV", "DATABASE_URL")}
    env.update(PORT=str(port), RUN_DIR=str(tmp_path), DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
               WEB_WORKERS="2", INTERNAL_API_TOKEN=token, FLEET_HEARTBEAT_S="1", SUPERVISE_RESTART_S="0.5")
    log = tmp_path / "run.log"
    launcher = subprocess.Popen([sys.executable, "platform/run.py"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def fleet() -> dict:
        try:
            return requests.get(base + "/api/v1/engine/fleet", headers={"Authorization": f"Bearer {token}"},
                                timeout=30).json()
        except (OSError, ValueError):
            return {}

    started: set[int] = set()
    try:
        wait(lambda: launcher.poll() is None and fleet().get("totals", {}).get("replicas_ready") == 2,
             "two ready web processes", log)
        started = descendants(launcher.pid)
        engines, fronts = processes(launcher.pid, b"engine_server"), processes(launcher.pid, b"front.py")
        webs = processes(launcher.pid, b"daphne")
        assert (len(engines), len(fronts), len(webs)) == (1, 1, 2), (engines, fronts, webs)
        assert listen_backlog(port) >= 2048
        listed = fleet()
        assert sorted(r["id"] for r in listed["replicas"]) == ["web-1", "web-2"]
        assert len({r["stats"]["engine"] for r in listed["replicas"]}) == 1 and listed["totals"]["engines"] == 1

        # The API through the front, as with one process.
        key = manage(env, "create_tenant", "acme", "--tier", "standard")
        client = OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert reply.usage.completion_tokens == 4
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=4, stream=True))
        assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) >= 1
        _a_batch_runs_through_the_worker(port, env, "workers")

        # A burst keeps one web process; another tenant is served by the other meanwhile.
        heavy = manage(env, "create_tenant", "heavy", "--tier", "standard")
        light = manage(env, "create_tenant", "light", "--tier", "standard")
        get_from(port, light)
        with concurrent.futures.ThreadPoolExecutor(40) as pool:
            heavy_ports = list(pool.map(lambda _: get_from(port, heavy), range(front.HEAVY_CONNECTIONS + 8)))
        during = get_from(port, light)
        wait(lambda: served_by(log, during) and all(served_by(log, p) for p in heavy_ports), "the access log lines",
             log, 30)
        burst_on = set.union(*(served_by(log, p) for p in heavy_ports))
        assert len(burst_on) == 1 and served_by(log, during) == {"web1", "web2"} - burst_on

        # 400 concurrent streams of one lane-1 tenant through the front: every one connects
        # and completes (issue 24 item 13, tests/reliability/test_connection_burst.py's burst).
        manage(env, "create_tier", "wide", "--lane", "1", "--rpm", "100000", "--tpm", "50000000",
               "--concurrency", "1000", "--max-tokens", "512", "--monthly-tokens", str(10**12))
        wide = manage(env, "create_tenant", "wide", "--tier", "wide")
        overflows = listen_overflows()
        results = asyncio.run(burst(base, wide))
        errors = [repr(r) for r in results if isinstance(r, BaseException)]
        assert not errors, f"{len(errors)} of {len(results)} clients failed, e.g. {errors[:3]}"
        assert [r for r in results if r != (200, True)] == []
        assert listen_overflows() == overflows

        # A web process killed: the other serves its callers meanwhile, and it is started again.
        victim = next(iter(webs))
        os.kill(victim, signal.SIGKILL)
        wait(lambda: not alive(victim), "the killed web process gone", log, 30)
        for _ in range(6):
            assert http_status(base + "/readyz") == 200
        wait(lambda: len(replicas := fleet().get("replicas", [])) == 2 and victim not in {r["pid"] for r in replicas}
             and all(r["stats"].get("ready") for r in replicas), "the killed web process back", log)

        # The engine killed: it is started again and both web processes connect to it.
        engine = engines.pop()
        restarts = {r["id"]: r["stats"]["restarts"] for r in fleet()["replicas"]}
        os.kill(engine, signal.SIGKILL)
        wait(lambda: processes(launcher.pid, b"engine_server") - {engine}, "a new engine process", log)
        # Each web process counts connecting again as a restart of its engine.
        wait(lambda: {r["id"]: (r["stats"].get("ready"), r["stats"].get("restarts")) for r in fleet().get("replicas", [])}
             == {name: (True, count + 1) for name, count in restarts.items()},
             "both web processes connected to the new engine", log)
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert reply.usage.completion_tokens == 4
        assert fleet()["totals"]["engines"] == 1
    finally:
        survivors = stop_launcher(launcher, started, timeout=60)
    assert not survivors, f"still running after SIGINT: {survivors}"
