"""One live platform (daphne + the real SmolLM2 engine + Redis + a database) for the
serving tests of a session. Each test module uses its own tenants, so rate limits and
stream leases of one module never leak into another's assertions."""
from collections.abc import Iterator

import openai
import pytest

from tests.live import LiveServer, start_live_server

BIG = {"requests_per_minute": 100_000, "tokens_per_minute": 50_000_000, "concurrent_streams": 1000,
       "max_tokens_per_request": 512, "monthly_token_budget": 10**12}

TIERS = {
    "live-p0": {"lane": 0, **BIG},
    "live-p1": {"lane": 1, **BIG},
    "live-p2": {"lane": 2, **BIG, "allow_batch": True},
    # A tier that runs out: 3 requests/min, 2 concurrent streams, 64 tokens per request.
    "live-tight": {"lane": 1, "requests_per_minute": 3, "tokens_per_minute": 100_000, "concurrent_streams": 2,
                   "max_tokens_per_request": 64, "monthly_token_budget": 10**9},
    # 60 tokens/min drains one token a second, so a test can read what a request left in the bucket.
    "live-metered": {"lane": 1, "requests_per_minute": 100, "tokens_per_minute": 60, "concurrent_streams": 2,
                     "max_tokens_per_request": 50, "monthly_token_budget": 10**6},
    # Fuzzing: many requests, each short.
    "live-fuzz": {"lane": 1, **{**BIG, "max_tokens_per_request": 8}, "allow_batch": True},
    "live-batch": {"lane": 1, **BIG, "allow_batch": True},
}

TENANTS = {
    # test_openai_client.py
    "client": "live-p1",
    "client-tight": "live-tight",
    "client-metered": "live-metered",
    # test_validation.py
    "valid": "live-p1",
    "valid-p2": "live-p2",
    "valid-tight": "live-tight",
    # test_disconnects.py
    "disc": "live-p1",
    # test_streams.py (heartbeats, 200 concurrent streams from three tiers)
    "stream-p0": "live-p0",
    "stream-p1": "live-p1",
    "stream-p2": "live-p2",
    # test_websocket.py
    "ws": "live-p1",
    "ws-tight": "live-tight",
    # test_operator.py, test_schema.py
    "ops": "live-p1",
    "fuzz": "live-fuzz",
    "iso-a": "live-p1",  # isolation is every tier's default
    "iso-b": "live-p1",
    # test_structured_output.py
    "structured": "live-p1",
    # test_tool_calls.py
    "tools": "live-p1",
    # test_request_ids.py
    "ids": "live-p1",
    # test_tokenize.py
    "tokens": "live-p1",
    # test_keys_and_usage.py
    "keys": "live-batch",
    # test_metrics.py
    "metrics": "live-p1",
    "metrics-tight": "live-tight",
    "metrics-batch": "live-p2",
}

# Short heartbeats so a test sees them; short enough auth timeout for the WebSocket test.
LIVE_ENV = {"SSE_HEARTBEAT_S": "0.5", "WS_AUTH_TIMEOUT_S": "2"}


@pytest.fixture(scope="session")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server, stop = start_live_server(tmp_path_factory.mktemp("live"), TIERS, TENANTS, LIVE_ENV)
    try:
        yield server
    finally:
        stop()


@pytest.fixture(scope="module")
def sdk(live: LiveServer, request: pytest.FixtureRequest) -> openai.OpenAI:
    """The official client, with the key of the test module's TENANT; no retries, so every
    refusal reaches the test. (Not `client`: that is pytest-django's test client.)"""
    return openai.OpenAI(base_url=live.url + "/v1", api_key=live.keys[request.module.TENANT], max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def served_model(sdk: openai.OpenAI) -> str:
    return sdk.models.list().data[0].id
