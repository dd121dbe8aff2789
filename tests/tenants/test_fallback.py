"""Limits while Redis stalls (tenants.fallback), against a real redis-server paused for writes.

Issue 24 item 7: a Redis stall made every tenant's admission wait for it, then fail. Now a
call that misses the deadline hands the decision to this process, which counts what it
admitted itself, and gives what it admitted back to Redis when Redis answers again.
The bounds on elapsed time are how long a hang may last before the test fails.
"""
import contextlib
import time

import pytest
import redis as redis_lib

from tenants.fallback import FallbackLimiter, LimitsUnavailable
from tenants.limits import Limiter

DEADLINE_S = 0.1
PAUSE_MS = 3000  # far past the deadline: a call that waits for the pause fails the bound


def deadline_client(redis_server: str, deadline_s: float) -> redis_lib.Redis:
    return redis_lib.Redis.from_url(redis_server, socket_timeout=deadline_s, socket_connect_timeout=deadline_s,
                                    retry=redis_lib.retry.Retry(redis_lib.backoff.NoBackoff(), 0))


def fallback_limiter(redis, redis_server: str, share: float, confirm_s: float = 0.0) -> FallbackLimiter:
    confirm = Limiter(deadline_client(redis_server, confirm_s)) if confirm_s else None
    return FallbackLimiter(Limiter(deadline_client(redis_server, DEADLINE_S)), Limiter(redis), share=share,
                           confirm=confirm, confirm_s=confirm_s)


@pytest.fixture
def limiter(redis, redis_server) -> FallbackLimiter:
    return fallback_limiter(redis, redis_server, share=1.0)


@contextlib.contextmanager
def writes_paused(redis):
    redis.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
    try:
        yield
    finally:
        redis.execute_command("CLIENT", "UNPAUSE")


def answered_again(limiter: FallbackLimiter) -> None:
    deadline = time.monotonic() + 10
    while limiter.breaker.open:
        assert time.monotonic() < deadline, "the breaker did not close after Redis answered"
        time.sleep(0.02)


def test_slots_held_before_a_stall_count_against_the_tenant_during_it(limiter, redis):
    first, _ = limiter.acquire_lease("tenant:1", "streams", 3, ttl_s=30, count=2)
    assert first is not None
    with writes_paused(redis):
        started = time.monotonic()
        third, decision = limiter.acquire_lease("tenant:1", "streams", 3, ttl_s=30)
        assert time.monotonic() - started < 1.0
        assert third is not None and decision.local
        fourth, refused = limiter.acquire_lease("tenant:1", "streams", 3, ttl_s=30)
        assert fourth is None and not refused.allowed and refused.local
        assert refused.buckets[0].retry_after_s > 0
        assert limiter.breaker.open
    answered_again(limiter)
    # The slot taken alone is in Redis now, before Redis decides again.
    assert limiter.fast.leases_held("tenant:1", "streams") == 3
    assert limiter.acquire_lease("tenant:1", "streams", 3, ttl_s=30)[0] is None
    limiter.release_lease(third)
    assert limiter.fast.leases_held("tenant:1", "streams") == 2


def test_a_slot_released_during_a_stall_is_released_in_redis_once_it_answers(limiter, redis):
    lease, _ = limiter.acquire_lease("tenant:1", "streams", 2, ttl_s=30)
    with writes_paused(redis):
        limiter.acquire_lease("tenant:1", "streams", 2, ttl_s=30)  # trips the breaker
        limiter.release_lease(lease)
    answered_again(limiter)
    deadline = time.monotonic() + 5
    while limiter.fast.leases_held("tenant:1", "streams") > 1:  # the other one is still held
        assert time.monotonic() < deadline, "the slot released during the stall stayed held in Redis"
        time.sleep(0.02)


def test_requests_per_minute_admitted_before_a_stall_count_during_it(limiter, redis):
    assert limiter.admit("tenant:1", 60, {"requests": (3, 2)}).allowed
    with writes_paused(redis):
        alone = limiter.admit("tenant:1", 60, {"requests": (3, 1)})
        assert alone.allowed and alone.local and alone.bucket("requests").remaining == 0
        refused = limiter.admit("tenant:1", 60, {"requests": (3, 1)})
        assert not refused.allowed and 0 < refused.retry_after_s <= 20
    answered_again(limiter)


def test_what_was_admitted_alone_counts_in_redis_once_it_answers(limiter, redis):
    """A false trip (a deadline missed by a busy process) must not hand a tenant its
    requests/min or tokens/min a second time: what it spent alone is carried into Redis."""
    costs = {"requests": (4, 1), "tokens": (1000, 300)}
    with writes_paused(redis):
        for _ in range(3):
            alone = limiter.admit("tenant:1", 60, costs)
            assert alone.allowed and alone.local
        # A reservation admitted alone and settled alone: its unused 250 tokens are given back
        # before they are ever carried, so Redis hears of the 50 used only.
        limiter.refund("tenant:1", "tokens", 1000, 60, 250, local=True)
    answered_again(limiter)
    read = limiter.fast.admit("tenant:1", 60, {"requests": (4, 0), "tokens": (1000, 0)})
    assert read.bucket("requests").remaining == 1  # 3 of 4 spent alone
    assert read.bucket("tokens").remaining == 1000 - 3 * 300 + 250
    assert limiter.admit("tenant:1", 60, {"requests": (4, 1)}).allowed
    refused = limiter.admit("tenant:1", 60, {"requests": (4, 1)})
    assert not refused.allowed and not refused.local


def test_a_budget_during_a_stall_spends_only_the_room_redis_last_reported(limiter, redis):
    limiter.steady.counter_seed("tenant:1", "2030-01", 600, ttl_s=3600)
    held = limiter.reserve_budget("tenant:1", "2030-01", 1000, 100, ttl_s=30, keys_ttl_s=3600)
    assert held.status == "reserved"  # room: 1000 - 600 used - 100 held = 300 more
    with writes_paused(redis):
        during = limiter.reserve_budget("tenant:1", "2030-01", 1000, 250, ttl_s=30, keys_ttl_s=3600)
        assert during.status == "reserved" and during.reservation is not None
        # As in Redis, a hold is taken while anything is left (the last one may overrun it).
        last = limiter.reserve_budget("tenant:1", "2030-01", 1000, 100, ttl_s=30, keys_ttl_s=3600)
        assert last.status == "reserved"
        over = limiter.reserve_budget("tenant:1", "2030-01", 1000, 1, ttl_s=30, keys_ttl_s=3600)
        assert over.status == "held"
        with pytest.raises(LimitsUnavailable):  # a tenant this process has not reserved for
            limiter.reserve_budget("tenant:2", "2030-01", 1000, 1, ttl_s=30, keys_ttl_s=3600)
        # ... unless the caller can say what the month used (the usage records): its room then.
        learned = limiter.reserve_budget("tenant:2", "2030-01", 1000, 900, ttl_s=30, keys_ttl_s=3600,
                                         used_so_far=lambda: 950)
        assert learned.status == "reserved"  # 50 left: taken, overrun by at most this request
        assert limiter.reserve_budget("tenant:2", "2030-01", 1000, 1, ttl_s=30, keys_ttl_s=3600,
                                      used_so_far=lambda: 0).status == "held"  # learned once, not reset
    answered_again(limiter)
    # The holds taken alone are in Redis: what is left is held by the generations in flight.
    assert limiter.reserve_budget("tenant:1", "2030-01", 1000, 100, ttl_s=30, keys_ttl_s=3600).status == "held"
    assert limiter.settle_budget(during.reservation, 40) == 640
    assert limiter.settle_budget(held.reservation, 10) == 650
    assert limiter.reserve_budget("tenant:1", "2030-01", 1000, 350, ttl_s=30, keys_ttl_s=3600).status == "reserved"


def test_with_no_share_a_stall_refuses_instead(redis, redis_server):
    closed = fallback_limiter(redis, redis_server, share=0)
    with writes_paused(redis):
        with pytest.raises(LimitsUnavailable):
            closed.admit("tenant:1", 60, {"requests": (3, 1)})
        with pytest.raises(LimitsUnavailable):  # the breaker is open: refused at once
            closed.acquire_lease("tenant:1", "streams", 3, ttl_s=30)
    answered_again(closed)
    assert closed.admit("tenant:1", 60, {"requests": (3, 1)}).allowed


def test_a_share_of_one_half_grants_half_of_each_limit_alone(redis, redis_server):
    half = fallback_limiter(redis, redis_server, share=0.5)
    with writes_paused(redis):
        taken = [half.acquire_lease("tenant:1", "streams", 4, ttl_s=30)[0] for _ in range(3)]
        assert [lease is not None for lease in taken] == [True, True, False]
    answered_again(half)


def test_a_part_share_refuses_alone_only_once_redis_misses_the_longer_deadline_too(redis, redis_server):
    """A missed deadline is either Redis away or this box too busy to hear it in time (a false
    trip). With a part of each limit to grant alone, a false trip refused tenants that fit their
    whole limit; now a refusal waits for the first probe (LIMITS_REDIS_CONFIRM_S) and, Redis
    answering, asks it again. Those that fit the share are admitted at the short deadline."""
    half = fallback_limiter(redis, redis_server, share=0.5, confirm_s=2.0)
    held = [half.acquire_lease("tenant:1", "streams", 4, ttl_s=30)[0] for _ in range(2)]
    assert all(held)
    # A pause shorter than the confirming deadline, longer than admission's: a false trip.
    redis.execute_command("CLIENT", "PAUSE", 500, "WRITE")
    lease, decision = half.acquire_lease("tenant:1", "streams", 4, ttl_s=30)
    assert lease is not None and decision.allowed  # Redis's answer: 3 of 4, not the half share's 2
    assert half.breaker.trips == 1 and not half.breaker.open
    assert half.leases_held("tenant:1", "streams") == 3
    assert half.admit("tenant:2", 60, {"requests": (3, 1)}).allowed

    # Redis away for longer: the first refusal waits for the confirming probe, the next do not.
    with writes_paused(redis):
        admitted = half.admit("tenant:3", 60, {"requests": (2, 1)})  # fits half of 2: at once
        assert admitted.allowed and half.breaker.open
        assert not half.admit("tenant:3", 60, {"requests": (2, 1)}).allowed
        assert half.breaker.confirmed
        started = time.monotonic()
        assert not half.acquire_lease("tenant:1", "streams", 4, ttl_s=30)[0]  # 3 held here: over 2
        assert time.monotonic() - started < 1.0  # no second wait for the same outage
    answered_again(half)
