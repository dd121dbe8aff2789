"""Clients that leave: at once, after admission, mid-stream and on the last token, each with a
clean close (FIN) and with a reset (RST): 50 connections a batch over raw sockets.

Whatever the moment, within a second of the last socket closing the engine holds no KV
block and runs or queues nothing, the tenant holds no concurrent-stream lease, and every
request the server admitted is billed (aborted ones included, with the tokens made).
Half of each batch uses the platform stream, half the OpenAI chat stream.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

import pytest
import redis

from tenants.limits import Limiter
from tests.live import LiveServer
from tests.serving.rawsse import OPENAI_CHAT, PLATFORM_CHAT, Comment, Event, SocketStream, chat_body

TENANT = "disc"
BATCH = 50
# Clients in flight at once. The engine frees an aborted request's blocks when the step in
# progress ends; a step over fewer sequences ends sooner on a busy 2-core machine.
CONCURRENCY = 10
LONG = 32  # a mid-stream abort must stop well before this many tokens
SHORT = 4  # the last-token case reads all of them
MID_STREAM_TOKENS = 3
# Lane P2: the engine refuses a request whose estimated wait exceeds its lane's queue timeout,
# and on a busy machine it estimates a few dozen P1 requests over P1's 120 s (see the burst
# test in test_streams.py). P2's is a day; leaving clients are handled alike in every lane.
LANE = 2
STREAM_LEASE_TTL_S = 30  # the server's default


@dataclass
class Outcome:
    request_id: str | None = None  # the X-Request-Id header, once the response started
    tokens: int = 0  # tokens received before the client left


def _token_count(path: str, event: Event) -> tuple[int, bool]:
    """(tokens in this event, whether it ends the generation) for a token-carrying event."""
    if path == PLATFORM_CHAT:
        return (event.json()["tokens"], False) if event.event == "token" else (0, False)
    if event.data == "[DONE]":
        return 0, False
    choice = event.json()["choices"][0]
    return (1 if choice["delta"].get("content") else 0), choice["finish_reason"] is not None


def _leave(live: LiveServer, i: int, moment: str, reset: bool) -> Outcome:
    path = PLATFORM_CHAT if i % 2 == 0 else OPENAI_CHAT
    max_tokens = SHORT if moment == "last_token" else LONG
    stream = SocketStream(live.url, path, live.keys[TENANT], chat_body(max_tokens, stream=True, priority=LANE))
    outcome = Outcome()
    try:
        if moment == "at_once":
            return outcome
        # The `: ok` comment comes after admission: the request is in the engine, no token sent yet.
        first = stream.next()
        assert stream.wire.status == 200, (stream.wire.headers, stream.wire.body)
        assert first == Comment("ok")
        outcome.request_id = stream.wire.headers["x-request-id"]
        if moment == "admitted":
            return outcome
        while True:
            event = stream.next_event()
            assert event is not None, "the stream ended before the client meant to leave"
            assert event.event != "error", event.data
            tokens, finished = _token_count(path, event)
            outcome.tokens += tokens
            if moment == "mid_stream" and outcome.tokens >= MID_STREAM_TOKENS:
                return outcome
            if moment == "last_token" and (outcome.tokens == SHORT or finished):
                assert outcome.tokens <= SHORT
                return outcome
    finally:
        stream.close(reset=reset)


def _leases(live: LiveServer) -> int:
    return Limiter(redis.Redis.from_url(live.redis_url)).leases_held(f"tenant:{live.tenant_ids[TENANT]}", "streams")


def _wait_no_leases(live: LiveServer, timeout: float) -> int:
    """The tenant's live stream leases, polled until none is left or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while (held := _leases(live)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return held


def _usage(live: LiveServer, since: datetime, request_ids: set[str]) -> list[dict]:
    """The tenant's usage rows since `since`, once those of `request_ids` are all there and complete
    (or 20 s passed)."""
    return live.django(f"""
        import time
        from datetime import datetime
        from tenants.models import UsageRecord
        deadline = time.monotonic() + 20
        while True:
            rows = list(UsageRecord.objects.filter(
                tenant_id={live.tenant_ids[TENANT]}, created__gte=datetime.fromisoformat({since.isoformat()!r}),
            ).values("request_id", "lane", "prompt_tokens", "completion_tokens", "finish_reason", "closed"))
            if {{r["request_id"] for r in rows if r["closed"]}} >= {request_ids!r} or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        result = rows
    """)


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
@pytest.mark.parametrize("moment", ["at_once", "admitted", "mid_stream", "last_token"])
def test_leaving_clients_free_everything_and_are_billed(live: LiveServer, moment: str, reset: bool) -> None:
    assert live.wait_idle(timeout=30)["kv_blocks_used"] == 0
    # A lease an earlier batch leaked (and failed for) expires after its TTL: start without it.
    assert _wait_no_leases(live, timeout=STREAM_LEASE_TTL_S + 5) == 0, "a stream lease never expired"
    since = datetime.now(timezone.utc)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        outcomes = list(pool.map(lambda i: _leave(live, i, moment, reset), range(BATCH)))

    # Within a second of the last close: no block, nothing running or queued, no lease.
    deadline = time.monotonic() + 1.0
    steps = live.stats()["steps"]
    stats = live.wait_idle(timeout=1.0)
    # An abort takes effect when the engine's step in progress ends: say how many ended.
    context = (f"{stats['steps'] - steps} engine step(s) ended since the clients left", stats)
    assert stats["kv_blocks_used"] == 0, context
    assert stats["requests_running"] == 0 and stats["requests_swapped"] == 0, context
    assert not any(stats["requests_waiting"].values()), context
    held = _wait_no_leases(live, timeout=deadline - time.monotonic())
    assert held == 0, f"{held} stream lease(s) still held a second after the clients left"

    # Requests dropped at once may still be in admission on the server: let them get there.
    if moment == "at_once":
        time.sleep(1.0)
    expected = {o.request_id: o for o in outcomes if o.request_id}
    records = _usage(live, since, set(expected))
    if moment != "at_once":  # rows of an earlier batch may still have been on their way
        records = [r for r in records if r["request_id"] in expected]
    by_id = {r["request_id"]: r for r in records}
    assert set(expected) <= set(by_id), f"{len(set(expected) - set(by_id))} admitted request(s) never billed"
    for record in records:
        assert record["prompt_tokens"] > 0 and record["lane"] == LANE, record
        if moment == "last_token":
            # The server had sent every token: the generation ended by length, billed in full.
            assert record["completion_tokens"] == SHORT, record
        else:
            assert "abort" in record["finish_reason"], record
            assert record["completion_tokens"] < LONG, record
    for request_id, outcome in expected.items():
        assert by_id[request_id]["completion_tokens"] >= outcome.tokens, (by_id[request_id], outcome)
    # Nothing the server took for these clients after they left is still held.
    held = _leases(live)
    assert held == 0, f"{held} stream lease(s) taken for clients that had left are still held"
    stats = live.stats()
    assert stats["kv_blocks_used"] == 0 and stats["requests_running"] == 0, stats
