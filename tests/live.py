"""A live platform for end-to-end tests: daphne with the real engine and model, over a real
socket, with its own Redis and its own database.

The server runs in a child process, so it has its own database: a SQLite file, or a fresh
PostgreSQL database on the server `DATABASE_URL` names (dropped afterwards). Tests create
tenants and read usage through `LiveServer.django(...)`, which runs a snippet in a Django
process pointed at that database and returns what it prints as JSON.
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import free_port, start_redis

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 300  # a first run builds the C++ kernels (~40 s) and converts the tokenizer
WEB_BACKLOG = 2048  # the listen queue `make run` gives daphne (platform/run.py)

# Small pools: enough for 200 concurrent short streams, light on a 2-core CI box.
DEFAULT_ENV = {
    "INFERENCE_KV_CACHE_BYTES": str(128 * 1024**2),
    "INFERENCE_SWAP_BYTES": str(64 * 1024**2),
    "INFERENCE_MAX_NUM_SEQS": "64",
    "SSE_HEARTBEAT_S": "15",
    "MAX_REQUEST_BYTES": str(256 * 1024),
    "LOG_LEVEL": "WARNING",
    # stop() sends SIGTERM and kills after 20 s: a stream a test left open must not hold the
    # drain (inference.drain) that long.
    "DRAIN_TIMEOUT_S": "5",
}


# A Python process with Django set up on a live server's database, running the snippets sent to
# it one line of JSON at a time: starting a process and Django for each took ~1.6 s on 2 cores.
# Each snippet closes its database connections, so the next starts on a fresh one, as a new
# process did; what a snippet prints goes to the shell's log, never into the answers.
SHELL = r"""
import json, os, sys, traceback
import django
django.setup()
from django import db
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for line in sys.stdin:
    scope = {}
    try:
        exec(json.loads(line), scope)
        answer = json.dumps({"result": scope.get("result")})
    except BaseException:
        answer = json.dumps({"error": traceback.format_exc()})
    finally:
        db.connections.close_all()
    answers.write(answer + "\n")
    answers.flush()
"""


class DjangoShell:
    """Runs snippets in one long-lived SHELL process, started on first use, one at a time."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env, self.log_path = env, log_path
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def run(self, code: str, timeout: float = 120) -> Any:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = subprocess.Popen([sys.executable, "-c", SHELL], cwd=ROOT, env=self.env, stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=self.log_path.open("a"))
            proc = self._proc
            proc.stdin.write((json.dumps(textwrap.dedent(code)) + "\n").encode())
            proc.stdin.flush()
            answer = self._read_line(proc, timeout)
        if "error" in answer:
            raise RuntimeError(f"django snippet failed:\n{answer['error']}")
        return answer["result"]

    def _read_line(self, proc: subprocess.Popen, timeout: float) -> dict:
        data, deadline = b"", time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            while not data.endswith(b"\n"):
                left = deadline - time.monotonic()
                chunk = os.read(proc.stdout.fileno(), 65536) if left > 0 and selector.select(left) else None
                if not chunk:  # timed out, or the shell died: the next call starts a new one
                    self.close()
                    raise RuntimeError("django snippet: no answer (see " + str(self.log_path) + ")")
                data += chunk
        return json.loads(data)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


@dataclass
class LiveServer:
    url: str
    ws_url: str
    redis_url: str
    internal_token: str
    env: dict[str, str]
    log_path: Path
    keys: dict[str, str] = field(default_factory=dict)  # tenant name -> API key
    tenant_ids: dict[str, int] = field(default_factory=dict)
    shell: DjangoShell = field(init=False)

    def __post_init__(self) -> None:
        self.shell = DjangoShell(self.env, self.log_path.with_name("django-shell.log"))

    def django(self, code: str) -> Any:
        """Run `code` in a Django process on the server's database; it sets `result`, returned here."""
        return self.shell.run(code)

    def stats(self) -> dict:
        return self.get_json("/api/v1/engine/stats", token=self.internal_token)

    def post_json(self, path: str, body: dict, key: str, timeout: float = 120) -> tuple[int, dict]:
        """(status, JSON body) of a POST with an API key, error statuses included."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def get_json(self, path: str, token: str | None = None) -> dict:
        request = urllib.request.Request(self.url + path)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def wait_idle(self, timeout: float = 1.0) -> dict:
        """Poll the stats until nothing holds a block, runs or waits; returns the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = (stats["kv_blocks_used"] == 0 and stats["requests_running"] == 0
                    and stats["requests_swapped"] == 0 and not any(stats["requests_waiting"].values()))
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def http_status(url: str) -> int:
    """The status of a GET, 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


def _database(tmp: Path, template: str | None = None, sqlite: bool = False) -> tuple[str, Any]:
    """A database URL for the server, and how to drop it afterwards; a copy of `template` (a
    URL this returned before) where given. PostgreSQL where DATABASE_URL names one, unless
    `sqlite`."""
    base = os.environ.get("DATABASE_URL", "")
    if sqlite or not base.startswith(("postgres://", "postgresql://")):
        path = tmp / "live.sqlite3"
        if template:
            shutil.copyfile(template.removeprefix("sqlite:///"), path)
        return f"sqlite:///{path}", lambda: None
    import psycopg

    server, _, _ = base.rpartition("/")
    name = f"live_{os.getpid()}_{secrets.token_hex(4)}"
    copy = f' TEMPLATE "{template.rpartition("/")[2]}"' if template else ""
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{copy}')

    def drop() -> None:
        with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"{server}/{name}", drop


# A database of each kind migrated once per test process, copied for each server: `manage.py
# migrate` took ~2 s of every server's start (a Django process of its own, 2-core Zen 4).
_TEMPLATES: dict[bool, str] = {}


def migrated_database(tmp: Path, env: dict[str, str], sqlite: bool = False) -> tuple[str, Any]:
    """Like `_database`, with the schema and the migrations' rows already in it."""
    if sqlite not in _TEMPLATES:
        template_dir = Path(tempfile.mkdtemp(prefix="live-template-"))
        url, drop = _database(template_dir, sqlite=sqlite)
        atexit.register(shutil.rmtree, template_dir, ignore_errors=True)
        atexit.register(drop)
        subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env={**env, "DATABASE_URL": url},
                       check=True, capture_output=True, timeout=300)
        _TEMPLATES[sqlite] = url
    return _database(tmp, _TEMPLATES[sqlite], sqlite=sqlite)


TENANTS_SCRIPT = """
from tenants import actions
result = {"keys": {}, "ids": {}}
for tier_name, fields in TIERS.items():
    actions.save_tier(tier_name, **fields)
from tenants.models import QuotaTier
for name, tier_name in TENANTS.items():
    tenant = actions.create_tenant(name, QuotaTier.objects.get(name=tier_name))
    result["keys"][name] = actions.issue_key(tenant, name="live").plaintext
    result["ids"][name] = tenant.pk
"""


def start_live_server(tmp: Path, tiers: dict[str, dict], tenants: dict[str, str], env: dict[str, str] | None = None,
                      redis_url: str | None = None, open_files: int | None = None):
    """Start everything; returns (server, stop). `tiers`: name -> save_tier fields;
    `tenants`: tenant name -> tier name (each gets one key). With `redis_url`, the caller
    owns that Redis (to stop and restart it); otherwise the server gets its own. `open_files`:
    daphne starts with that soft limit on open files (as a stock Linux's 1,024 would)."""
    redis_proc = None
    if redis_url is None:
        redis_proc, redis_url = start_redis(tmp)
    port = free_port()
    token = secrets.token_urlsafe(32)
    child_env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_ENV",)}
    child_env.update(DEFAULT_ENV)
    child_env.update(env or {})
    db_url, drop_db = migrated_database(tmp, child_env)
    child_env.update(DATABASE_URL=db_url, REDIS_URL=redis_url, INTERNAL_API_TOKEN=token,
                     DJANGO_SETTINGS_MODULE="config.settings", PYTHONUNBUFFERED="1")
    # Each server journals its usage entries in its own folder (tenants.ledger), unless told.
    child_env.setdefault("USAGE_OUTBOX_DIR", str(tmp / "usage-outbox"))
    child_env.setdefault("REPLICA_URL", f"http://127.0.0.1:{port}")
    child_env.setdefault("STATIC_ROOT", str(tmp / "static"))
    log_path = tmp / "daphne.log"
    server = LiveServer(url=f"http://127.0.0.1:{port}", ws_url=f"ws://127.0.0.1:{port}", redis_url=redis_url,
                        internal_token=token, env=child_env, log_path=log_path)
    daphne = None

    def stop() -> None:
        server.shell.close()
        if daphne is not None and daphne.poll() is None:
            daphne.send_signal(signal.SIGTERM)
            try:
                daphne.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daphne.kill()
                daphne.wait()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
        drop_db()

    try:
        if child_env.get("DEBUG", "").lower() in ("0", "false", "off", "no"):  # as production serves them
            subprocess.run([sys.executable, "manage.py", "collectstatic", "--noinput", "-v0"], cwd=ROOT, env=child_env,
                           check=True, capture_output=True, timeout=300)
        created = server.django(f"TIERS = {tiers!r}\nTENANTS = {tenants!r}\n" + TENANTS_SCRIPT)
        server.keys, server.tenant_ids = created["keys"], created["ids"]
        command = [sys.executable, "-m", "daphne", "-e", f"tcp:port={port}:interface=127.0.0.1:backlog={WEB_BACKLOG}",
                   "config.asgi:application"]
        if open_files is not None:  # through a shell's ulimit: no preexec_fn in a process with threads
            command = ["/bin/sh", "-c", f'ulimit -Sn {int(open_files)} && exec "$0" "$@"', *command]
        daphne = subprocess.Popen(command, cwd=ROOT, env=child_env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while http_status(server.url + "/readyz") != 200:
            if daphne.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the live server never became ready:\n" + server.log())
            time.sleep(0.25)
    except BaseException:
        stop()
        raise
    return server, stop
