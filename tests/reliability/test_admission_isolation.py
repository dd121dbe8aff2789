"""A stalled dependency on one tenant's path delays no other tenant, and every failure of one
is a 503 in the OpenAI shape with Retry-After (issue 24 item 7: "All streaming and WebSocket
authentication and admission share one thread (`database_sync_to_async` is
thread-sensitive): a Redis stall made three requests wait 2.0/3.9/5.8 s in a row; one
tenant's key-touch UPDATE waiting on a lock delayed another tenant's first byte 0.06 -> 14.6
s, and past 20 s the caller got daphne's HTML 500").

Admission runs on a pool of its own (tenants.admission) under ADMISSION_TIMEOUT_S (4 s on
this server), and the key's `last_used` is written off the request's path (tenants.ledger).
The bounds below are how long a hang may last before the test fails, not speed claims.
"""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from batches.models import File

from tests.live import LiveServer

ADMISSION_TIMEOUT_S = 4.0  # tests/isolation_env.py
CALM = ["calm-a", "calm-b", "calm-c", "calm-d", "bystander"]


def _chat(live: LiveServer, tenant: str, stream: bool = False) -> tuple[int, dict[str, str], bytes, float]:
    """(status, headers, body, seconds) of a short chat."""
    body = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2, "stream": stream}
    request = urllib.request.Request(live.url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {live.keys[tenant]}",
                                              "Content-Type": "application/json"})
    return _send(request)


def _send(request: urllib.request.Request) -> tuple[int, dict[str, str], bytes, float]:
    """(status, headers, body, seconds) of a request."""
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), response.read(), time.monotonic() - started
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read(), time.monotonic() - started


def _assert_openai_503(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 503, (status, body[:300])
    assert headers.get("Content-Type", "").startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert error["type"] == "server_error" and error["code"] == "service_unavailable"
    assert int(headers["Retry-After"]) >= 1


def _redis_pid(live: LiveServer) -> int:
    return int(redis.Redis.from_url(live.redis_url).info("server")["process_id"])


def test_a_stalled_redis_leaves_admission_to_this_process_for_the_tenants_it_serves(hostile_live: LiveServer):
    """Each calm tenant has been served, so this process knows what is left of its limits and
    its budget: while Redis answers nothing, they are served (tenants.fallback). A tenant it
    has never reserved a budget for is served too, from the month's use in the usage records
    (it was refused with a 503, which made every false trip of the breaker refuse tenants)."""
    for tenant in CALM:
        assert _chat(hostile_live, tenant)[0] == 200
    pid = _redis_pid(hostile_live)
    os.kill(pid, signal.SIGSTOP)  # connections are accepted, nothing is answered
    try:
        with ThreadPoolExecutor(len(CALM) + 1) as pool:
            answers = list(pool.map(lambda tenant: _chat(hostile_live, tenant), [*CALM, "stranger"]))
        with urllib.request.urlopen(hostile_live.url + "/readyz", timeout=30) as response:
            ready = response.status, json.loads(response.read())
        with urllib.request.urlopen(hostile_live.url + "/metrics", timeout=30) as response:
            metrics = response.read().decode()
    finally:
        os.kill(pid, signal.SIGCONT)
    for served_status, _, served_body, seconds in answers:
        assert served_status == 200, (served_status, served_body[:300])
        # It did not wait out the admission deadline on Redis (which fails closed with a 503).
        assert seconds < ADMISSION_TIMEOUT_S, seconds
    # Still in the balancer's rotation: every replica shares this Redis.
    assert ready[0] == 200 and ready[1]["checks"]["limits"] == "local", ready
    assert "\nllm_limits_local 1\n" in metrics
    # Redis is back: once its probe sees a write land, the process asks Redis again.
    deadline = time.monotonic() + 10
    while _metric(hostile_live, "llm_limits_local") != 0:
        assert time.monotonic() < deadline, "the process still decides alone after Redis answered"
        time.sleep(0.2)
    assert _chat(hostile_live, "stranger")[0] == 200


def _metric(live: LiveServer, name: str) -> float:
    with urllib.request.urlopen(live.url + "/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


class _Lock:
    """Holds a database lock from another connection until released."""

    def __init__(self, live: LiveServer, how: str, key: str | None = None, row: tuple[str, str] | None = None) -> None:
        self.url, self.how, self.live = live.env["DATABASE_URL"], how, live
        self.key = key or live.keys["locked"]  # PostgreSQL's "write": this key's row
        self.row = row  # PostgreSQL's "row": (table, id) held FOR UPDATE; SQLite's is the write lock
        self.ready, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def __enter__(self) -> _Lock:
        self.thread.start()
        assert self.ready.wait(30), "could not take the lock"
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.thread.join(30)

    def _hold(self) -> None:
        if self.url.startswith("sqlite:///"):
            conn = sqlite3.connect(self.url.removeprefix("sqlite:///"), timeout=30, isolation_level=None)
            if self.how == "unreadable":
                # In WAL mode no lock keeps readers out while the server holds the file open: the
                # keys' table goes away instead, and every read of it fails.
                conn.execute("ALTER TABLE tenants_apikey RENAME TO test_apikey_away")
                self.ready.set()
                self.release.wait(120)
                conn.execute("ALTER TABLE test_apikey_away RENAME TO tenants_apikey")
            else:  # the one write lock of the file
                conn.execute("BEGIN IMMEDIATE")
                self.ready.set()
                self.release.wait(120)
                conn.rollback()
            conn.close()
            return
        import psycopg

        with psycopg.connect(self.url.replace("postgres://", "postgresql://", 1)) as conn:
            if self.how == "unreadable":  # every read of the keys waits
                conn.execute("LOCK TABLE tenants_apikey IN ACCESS EXCLUSIVE MODE")
            elif self.how == "row":  # as an open psql session holding a row would
                table, row_id = self.row
                conn.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR UPDATE", (row_id,))
            else:  # the locked tenant's key row, as a long transaction elsewhere would hold it
                prefix = self.key.split("_")[0].removeprefix("sk-")
                conn.execute("SELECT 1 FROM tenants_apikey WHERE prefix = %s FOR UPDATE", (prefix,))
            self.ready.set()
            self.release.wait(120)
            conn.rollback()


def test_a_locked_key_row_delays_neither_its_tenant_nor_another(hostile_live: LiveServer):
    # "locked" has never been used: its first request is due a last_used write, which waited on
    # the lock on asgiref's shared thread (Channels consumers have no per-request context), and
    # every other tenant's admission with it.
    with _Lock(hostile_live, "write") as lock:
        with ThreadPoolExecutor(2) as pool:
            locked, calm = pool.map(lambda tenant: _chat(hostile_live, tenant), ["locked", "calm-a"])
        assert not lock.release.is_set()
        held = lock.thread.is_alive()
    assert held
    for status, _, body, seconds in (locked, calm):
        assert status == 200, body[:300]
        assert seconds < 15, "served only after the lock was given up"  # it is held until both answered
    last_used = hostile_live.django(f"""
        import time
        from tenants.models import ApiKey
        deadline = time.monotonic() + 30
        while ApiKey.objects.get(tenant_id={hostile_live.tenant_ids['locked']}).last_used is None and time.monotonic() < deadline:
            time.sleep(0.1)
        result = ApiKey.objects.get(tenant_id={hostile_live.tenant_ids['locked']}).last_used is not None
    """)
    assert last_used, "the key's use is recorded once the lock is gone"


def _get(live: LiveServer, path: str, key: str) -> tuple[int, bytes, float]:
    status, _, body, seconds = _send(urllib.request.Request(live.url + path, headers={"Authorization": f"Bearer {key}"}))
    return status, body, seconds


def test_a_held_write_lock_keeps_no_tenant_from_reading_its_own_files_batches_and_usage(hostile_live: LiveServer):
    """The key-touch of item 7 on the synchronous views: a key's first use wrote `last_used`
    on the request's path, and on SQLite waited out the busy timeout (20 s) behind whoever
    held the file's one write lock (a batch worker's long write, a backup), then answered 503.
    Reads need no lock; the key's use is recorded once the lock is gone."""
    key_id, key = hostile_live.django("""
        from tenants import actions
        from tenants.models import Tenant
        issued = actions.issue_key(Tenant.objects.get(name="calm-c"), name="never used")
        result = [issued.api_key.pk, issued.plaintext]
    """)
    with _Lock(hostile_live, "write", key=key) as lock:
        answers = {path: _get(hostile_live, path, key) for path in ("/v1/models", "/v1/files", "/v1/batches", "/v1/usage?start_time=0")}
        held = lock.thread.is_alive() and not lock.release.is_set()
    assert held
    for path, (status, body, seconds) in answers.items():
        assert status == 200, (path, status, body[:300])
        assert seconds < 15, (path, "answered only after the lock was given up")  # it is held until all answered
    recorded = hostile_live.django(f"""
        import time
        from tenants.models import ApiKey
        deadline = time.monotonic() + 30
        while ApiKey.objects.get(pk={key_id}).last_used is None and time.monotonic() < deadline:
            time.sleep(0.1)
        result = ApiKey.objects.get(pk={key_id}).last_used is not None
    """)
    assert recorded, "the key's use is recorded once the lock is gone"


def _upload(live: LiveServer, key: str) -> str:
    boundary = "isolationboundary"
    line = json.dumps({"custom_id": "1", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "Hi."}]}})
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\n"
            f"Content-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\nContent-Type: application/jsonl"
            f"\r\n\r\n{line}\n\r\n--{boundary}--\r\n").encode()
    request = urllib.request.Request(live.url + "/v1/files", data=body, method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["id"]


def _delete(live: LiveServer, path: str, key: str) -> tuple[int, dict[str, str], bytes, float]:
    return _send(urllib.request.Request(live.url + path, method="DELETE", headers={"Authorization": f"Bearer {key}"}))


def test_a_write_that_meets_a_held_row_is_a_503_after_the_databases_lock_timeout(hostile_live: LiveServer):
    """PostgreSQL had no lock timeout: deleting a file whose row another transaction held (an
    operator's open psql session) waited as long as the lock did, its client and its thread with
    it; SQLite waited its busy timeout, 20 s. Both now wait DATABASE_LOCK_TIMEOUT_S (3 s on this
    server), then answer 503 with Retry-After; the file goes once the lock is gone."""
    key = hostile_live.keys["lock-timeout"]
    file_id = _upload(hostile_live, key)
    with _Lock(hostile_live, "row", row=(File._meta.db_table, file_id)) as lock:
        status, headers, body, seconds = _delete(hostile_live, f"/v1/files/{file_id}", key)
        held = lock.thread.is_alive() and not lock.release.is_set()
    assert held
    _assert_openai_503(status, headers, body)
    assert seconds < 15, "answered only after the lock was given up"  # it is held until answered
    status, _, body, _ = _delete(hostile_live, f"/v1/files/{file_id}", key)
    assert status == 200 and json.loads(body)["deleted"] is True, body[:300]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_database_that_cannot_be_read_is_a_503_in_the_openai_shape(hostile_live: LiveServer, stream: bool):
    with _Lock(hostile_live, "unreadable"):
        status, headers, body, seconds = _chat(hostile_live, "calm-b", stream=stream)
    _assert_openai_503(status, headers, body)
    assert seconds < ADMISSION_TIMEOUT_S + 10
