"""One admission call's life (tenants.admission.run): what a waiter gets when it leaves, when its
deadline passes, and when the call fails; and how long the caller's share of the pool stays
taken in each case (until the thread is done, never before)."""
import asyncio
import threading

import pytest
import redis
from asgiref.sync import async_to_sync

from tenants import admission
from tenants.errors import ApiError


def _blocking(release: threading.Event, started: threading.Event, value):
    def call():
        started.set()
        release.wait(10)
        return value
    return call


async def _started(event: threading.Event) -> None:
    await asyncio.to_thread(event.wait, 5)


def test_a_waiter_that_leaves_mid_call_hands_what_the_call_took_to_keep_before_it_is_cancelled(settings):
    settings.ADMISSION_PER_CALLER = 1
    async_to_sync(_leave_mid_call)()


async def _leave_mid_call() -> None:
    release, started, kept = threading.Event(), threading.Event(), []
    waiter = asyncio.ensure_future(admission.run(_blocking(release, started, "lease"), caller="tenant:leaves",
                                                 what="slots", keep=kept.append))
    await _started(started)
    waiter.cancel()
    await asyncio.sleep(0.05)
    assert not waiter.done() and kept == []  # still waiting for the thread: its lease must not be lost
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert kept == ["lease"]
    # The caller's share is free again: its next call runs at once.
    assert await asyncio.wait_for(admission.run(lambda: "next", caller="tenant:leaves", what="slots"), 5) == "next"


def test_a_call_past_its_deadline_is_a_503_and_keeps_its_callers_share_until_its_thread_ends(settings):
    settings.ADMISSION_PER_CALLER = 1
    settings.ADMISSION_TIMEOUT_S = 0.2
    async_to_sync(_past_deadline)()


async def _past_deadline() -> None:
    release, started, kept = threading.Event(), threading.Event(), []
    with pytest.raises(ApiError) as late:
        await admission.run(_blocking(release, started, "lease"), caller="tenant:slow", what="token admission",
                            keep=kept.append)
    assert late.value.status == 503 and "Retry-After" in late.value.headers
    assert kept == []  # a deadline drops the result: nobody waits to give it back
    queued = asyncio.ensure_future(admission.run(lambda: "next", caller="tenant:slow", what="token admission"))
    await asyncio.sleep(0.1)
    assert not queued.done()  # the hung call still holds the caller's one place on the pool
    release.set()
    assert await asyncio.wait_for(queued, 5) == "next"


def test_a_failing_dependency_reaches_the_waiter_as_a_503_in_the_openai_shape():
    async_to_sync(_failing)()


async def _failing() -> None:
    def call():
        raise redis.ConnectionError("Redis went away")
    with pytest.raises(ApiError) as failed:
        await admission.run(call, caller="tenant:failing", what="slots")
    assert failed.value.status == 503 and failed.value.body()["error"]["type"]
    assert await admission.run(lambda: 7, caller="tenant:failing", what="slots") == 7


def test_by_default_a_callers_calls_run_on_the_pool_one_at_a_time():
    """Issue 24's 400 burst: the attacker's 32 admitted requests ran four admission calls at once,
    four threads taking the GIL in turns with the event loop and another tenant's one call. With
    one at a time, that tenant's first token under the burst came 20-25% sooner (p50 0.107 ->
    0.078-0.089 s on a 2-core AMX Xeon) and a lone tenant's 200 concurrent chats took as long
    (2.6 s either way): its calls are short, and its own burst queues behind itself."""
    async_to_sync(_concurrency)()


async def _concurrency() -> None:
    running, most, lock = [0], [0], threading.Lock()

    def call():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        threading.Event().wait(0.05)
        with lock:
            running[0] -= 1

    await asyncio.gather(*(admission.run(call, caller="tenant:burst", what="key admission") for _ in range(6)))
    assert most[0] == 1
    # Another caller's calls still run beside them.
    release, started = threading.Event(), threading.Event()
    hung = asyncio.ensure_future(admission.run(_blocking(release, started, "held"), caller="tenant:burst", what="slots"))
    await _started(started)
    assert await asyncio.wait_for(admission.run(lambda: "other", caller="tenant:other", what="slots"), 5) == "other"
    release.set()
    assert await hung == "held"
