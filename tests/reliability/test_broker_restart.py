"""A Redis restart while the worker holds unacknowledged messages (issue 24, item 12): the
worker died with `Unrecoverable error: AttributeError("'NoneType' object has no attribute
'hostname'")` and never came back.

How it happened (kombu 5.7.0, kombu/transport/redis.py): the worker saw the broker go away
first on its remote-control (pidbox) connection, while its task channel still waited for
a BRPOP reply. Celery's reconnect calls `Connection.collect()`: the task channel's close()
drained that BRPOP reply, got a connection error (it only expects `Empty`) and stopped
half-way, still open and holding its unacknowledged messages; the pidbox channel's close
failed too, and collect() then detached the transport (`transport.client = None`).
Celery's `connection.close()` closed the task channel again: restoring its messages
needed a new connection pool, and `Channel._connparams` read
`self.connection.client.hostname`, None. That AttributeError is no connection error, so
it ended the worker. config/celery.py patches the channel (`_harden_kombu_redis_channel`).

A real redis-server, killed and restarted empty, and a real `celery -A config worker`.
Which of its connections the worker notices first is up to the kernel (the pidbox one in 7
of 10 runs here without a proxy), so the worker reaches Redis through a small TCP proxy, and
the test drops the pidbox connection a moment before Redis dies. The unacknowledged messages are
pings with a countdown: the worker holds them unacked until they are due, as it holds a
running acks_late batch item, and meanwhile keeps a BRPOP waiting. No database and no
engine are involved: the worker's own batch sweep is pushed past the test's end.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from celery import Celery

from tests.conftest import free_port, start_redis
from tests.live import ROOT

pytestmark = pytest.mark.timeout(180)

HELD = 3  # unacknowledged messages the worker holds when Redis dies
WAIT_S = 60  # how long any one step may take before the test fails; never a timing assertion


class Proxy:
    """A TCP proxy to Redis that can refuse new connections and drop kombu's fanout
    listeners (the connections that sent PSUBSCRIBE: the worker's pidbox) on their own. A
    close on either side is passed on, so when Redis dies every open connection closes too."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.lock = threading.Lock()
        self.conns: list[tuple[socket.socket, bytearray]] = []  # worker side, what it sent first
        self.server: socket.socket | None = None
        self.accept_again()

    def accept_again(self) -> None:
        self.server = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR: same port again
        threading.Thread(target=self._accept, args=(self.server,), daemon=True).start()

    def refuse_new(self) -> None:
        self.server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.server.close()

    def drop_subscribers(self) -> int:
        with self.lock:
            subscribers = [c for c, sent in self.conns if b"\r\nPSUBSCRIBE\r\n" in sent]
        for conn in subscribers:
            _close(conn)
        return len(subscribers)

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                conn, _ = server.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                return
            sent = bytearray()
            with self.lock:
                self.conns.append((conn, sent))
            threading.Thread(target=self._pump, args=(conn, upstream, sent), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn, None), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, seen: bytearray | None) -> None:
        try:
            while data := src.recv(65536):
                if seen is not None and len(seen) < 65536:
                    seen += data
                dst.sendall(data)
        except OSError:
            pass
        _close(dst)
        _close(src)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _wait_log(worker: subprocess.Popen, log: Path, text: str, count: int = 1) -> str:
    """The worker's log once `text` appears in it `count` times; fails if the worker exits first."""
    deadline = time.monotonic() + WAIT_S
    while True:
        content = log.read_text(errors="replace")
        if content.count(text) >= count:
            return content
        if worker.poll() is not None:
            raise AssertionError(f"the worker exited ({worker.returncode}) waiting for {text!r}:\n{content[-6000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} in the worker's log after {WAIT_S} s:\n{content[-6000:]}")
        time.sleep(0.05)


@pytest.fixture
def stack(tmp_path: Path):
    redis_proc, redis_url = start_redis(tmp_path)
    redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = Proxy(redis_port)
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_ENV"}
    env.update(REDIS_URL=f"redis://127.0.0.1:{proxy.port}/0", DATABASE_URL=f"sqlite:///{tmp_path / 'unused.sqlite3'}",
               DJANGO_SETTINGS_MODULE="config.settings", PYTHONUNBUFFERED="1",
               BATCH_SWEEP_INTERVAL_S="3600", BATCH_WORKER_CONCURRENCY="4")
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "-l", "info", "--without-mingle",
         "--without-gossip", "--without-heartbeat"],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
    )
    state = {"redis": redis_proc, "redis_url": redis_url, "redis_port": redis_port, "proxy": proxy,
             "worker": worker, "log": log}
    try:
        yield state
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        state["redis"].kill()
        state["redis"].wait(timeout=10)


def _client(url: str) -> Celery:
    return Celery("broker-restart-test", broker=url, backend=url)


def test_the_worker_survives_a_redis_restart_while_it_holds_unacked_messages(stack, tmp_path):
    worker, log, proxy = stack["worker"], stack["log"], stack["proxy"]
    _wait_log(worker, log, "ready.")
    client = _client(stack["redis_url"])  # straight to Redis, not through the proxy
    try:
        for _ in range(HELD):
            client.send_task("inference.ping", countdown=3600)
    finally:
        client.close()
    _wait_log(worker, log, "received", count=HELD)

    # Redis goes away; the worker hears it first on its pidbox connection.
    proxy.refuse_new()
    assert proxy.drop_subscribers() == 1
    stack["redis"].kill()
    stack["redis"].wait(timeout=10)
    _wait_log(worker, log, "Connection to broker lost")
    # Redis stays away until the worker has torn the old connection down (where it died)
    # and tried to connect again: a restart that takes more than an instant.
    assert "Unrecoverable error" not in _wait_log(worker, log, "Cannot connect to")
    stack["redis"], _ = start_redis(tmp_path, stack["redis_port"])  # empty: the held messages are gone
    proxy.accept_again()

    client = _client(stack["redis_url"])
    try:
        assert client.send_task("inference.ping").get(timeout=WAIT_S) == "pong"
    finally:
        client.close()
    assert worker.poll() is None
    assert "Unrecoverable error" not in log.read_text(errors="replace")
