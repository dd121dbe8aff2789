"""SSE streams under load: heartbeats while a request waits in its lane, and 200 concurrent
streams from tenants of three tiers that all arrive whole.

The live server sends `: heartbeat` after SSE_HEARTBEAT_S (0.5 s) of silence and runs at
most 64 sequences at once, so 64 long P1 generations keep a P2 request waiting, silent
but for heartbeats, for as long as they run (the scheduler admits strictly by lane).
"""
from __future__ import annotations

import asyncio

import redis

from tenants.limits import Limiter
from tests.live import LiveServer
from tests.serving.rawsse import OPENAI_CHAT, PLATFORM_CHAT, AsyncStream, Comment, Event, chat_body

MAX_NUM_SEQS = 64  # INFERENCE_MAX_NUM_SEQS of the live server
QUEUE_CAP = 8
BLOCKER_TOKENS = 120  # far more decode steps than the test waits for
TIERS = {"stream-p0": 0, "stream-p1": 1, "stream-p2": 2}


def _leases(live: LiveServer, tenant: str) -> int:
    return Limiter(redis.Redis.from_url(live.redis_url)).leases_held(f"tenant:{live.tenant_ids[tenant]}", "streams")


async def _admitted(live: LiveServer, tenant: str, max_tokens: int) -> AsyncStream:
    """Open a platform stream and read up to its `: ok` comment: the request is in the engine."""
    stream = await AsyncStream.open(live.url, PLATFORM_CHAT, live.keys[tenant], chat_body(max_tokens, stream=True))
    first = await stream.next()
    assert stream.wire.status == 200, (stream.wire.headers, stream.wire.body)
    assert first == Comment("ok")
    return stream


async def _fill_every_slot(live: LiveServer) -> list[AsyncStream]:
    """MAX_NUM_SEQS long P1 generations, each running or queued in P1 (ahead of any P2).

    The engine refuses a request whose estimated wait exceeds its lane's queue timeout, and
    estimates generously: blockers go in while fewer than QUEUE_CAP wait, so none is refused."""
    blockers: list[AsyncStream] = []
    while len(blockers) < MAX_NUM_SEQS:
        queued = (await asyncio.to_thread(live.stats))["requests_waiting"]["1"]
        if queued >= QUEUE_CAP:
            await asyncio.sleep(0.05)
            continue
        count = min(QUEUE_CAP - queued, MAX_NUM_SEQS - len(blockers))
        blockers += await asyncio.gather(*(_admitted(live, "stream-p1", BLOCKER_TOKENS) for _ in range(count)))
    return blockers


def test_a_waiting_stream_gets_heartbeats_until_its_first_token(live: LiveServer) -> None:
    async def scenario() -> tuple[list, dict, list]:
        blockers = await _fill_every_slot(live)
        drains = [asyncio.create_task(b.rest()) for b in blockers]
        waiting = await _admitted(live, "stream-p2", 4)
        before_first_token = []
        while sum(item == Comment("heartbeat") for item in before_first_token) < 3:
            item = await waiting.next()
            assert item is not None, before_first_token
            before_first_token.append(item)
        meanwhile = await asyncio.to_thread(live.stats)
        # The clients of the blocking work leave: their slots free up and the P2 request runs.
        for blocker in blockers:
            await blocker.close()
        for drain in drains:
            drain.cancel()
        rest = await waiting.rest()
        await waiting.close()
        return before_first_token, meanwhile, rest

    before_first_token, meanwhile, rest = asyncio.run(scenario())
    assert before_first_token == [Comment("heartbeat")] * 3, "a token or event arrived while every slot was taken"
    assert meanwhile["requests_waiting"]["2"] == 1, meanwhile
    events = [item for item in rest if isinstance(item, Event)]
    assert [e.id for e in events] == list(range(len(events)))
    assert [e.event for e in events] == ["token"] * (len(events) - 1) + ["done"], events
    done = events[-1].json()
    assert done["lane"] == 2 and done["usage"]["completion_tokens"] == 4, done
    assert sum(e.json()["tokens"] for e in events[:-1]) == 4
    stats = live.wait_idle(timeout=60)  # the blockers' clients have left: their aborts land within steps
    assert stats["kv_blocks_used"] == 0 and stats["requests_running"] == 0, stats


def test_a_burst_the_engine_can_run_at_once_is_admitted(live: LiveServer) -> None:
    """MAX_NUM_SEQS long P0 requests at once, on an idle engine with a slot for each: none may
    be refused as "lane full" (429), whatever the engine's throughput estimate."""
    async def scenario() -> list[AsyncStream]:
        streams = await asyncio.gather(*(AsyncStream.open(live.url, PLATFORM_CHAT, live.keys["stream-p0"],
                                                          chat_body(150, stream=True)) for _ in range(MAX_NUM_SEQS)))
        firsts = await asyncio.gather(*(s.next() for s in streams))
        for stream in streams:
            await stream.close()
        return list(zip(streams, firsts))

    generated_before = live.stats()["generated_tokens"]
    answers = asyncio.run(scenario())
    refused = [(s.wire.status, s.wire.body) for s, first in answers if s.wire.status != 200]
    assert not refused, f"{len(refused)} of {MAX_NUM_SEQS} refused, e.g. {refused[0]}"
    assert all(first == Comment("ok") for _, first in answers)
    # Not a deadline (a step of 64 prefills takes what the machine gives it): the clients left,
    # so the engine must end up idle having generated far fewer than their 150 tokens each.
    stats = live.wait_idle(timeout=60)
    assert stats["kv_blocks_used"] == 0 and stats["requests_running"] == 0, stats
    assert not any(stats["requests_waiting"].values()), stats
    assert stats["generated_tokens"] - generated_before < MAX_NUM_SEQS * 150 // 2, "streams ran on after their clients left"


async def _one_stream(live: LiveServer, i: int) -> tuple[str, str, AsyncStream, list]:
    tenant = list(TIERS)[i % 3]
    path = PLATFORM_CHAT if i % 2 == 0 else OPENAI_CHAT
    stream = await AsyncStream.open(live.url, path, live.keys[tenant], chat_body(8, stream=True))
    items = await stream.rest()
    await stream.close()
    return tenant, path, stream, items


def _check_platform(events: list[Event], lane: int) -> None:
    assert [e.event for e in events] == ["token"] * (len(events) - 1) + ["done"], events
    assert sum(e.json()["tokens"] for e in events[:-1]) == 8
    done = events[-1].json()
    assert done["status"] == "[DONE]" and done["lane"] == lane and done["finish_reasons"] == ["length"], done
    assert done["usage"]["completion_tokens"] == 8, done


def _check_openai(events: list[Event]) -> None:
    assert events[-1].data == "[DONE]", events
    chunks = [e.json() for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons == [None] * (len(chunks) - 1) + ["length"], reasons


def test_200_concurrent_streams_from_three_tiers_arrive_whole(live: LiveServer) -> None:
    async def scenario():
        return await asyncio.gather(*(_one_stream(live, i) for i in range(200)))

    results = asyncio.run(scenario())
    for tenant, path, stream, items in results:
        assert stream.wire.status == 200, (tenant, path, stream.wire.headers, stream.wire.body)
        assert stream.wire.ended, (tenant, path, items)
        assert stream.wire.headers["x-lane"] == f"P{TIERS[tenant]}"
        events = [item for item in items if isinstance(item, Event)]
        assert [e.id for e in events] == list(range(len(events))), (tenant, path, events)
        assert all(e.event != "error" for e in events), (tenant, path, events)
        if path == PLATFORM_CHAT:
            _check_platform(events, TIERS[tenant])
        else:
            _check_openai(events)
    stats = live.wait_idle(timeout=1.0)
    assert stats["kv_blocks_used"] == 0 and stats["requests_running"] == 0, stats
    assert stats["requests_swapped"] == 0 and not any(stats["requests_waiting"].values()), stats
    assert {tenant: _leases(live, tenant) for tenant in TIERS} == dict.fromkeys(TIERS, 0)
