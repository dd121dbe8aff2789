"""Admission work (key lookups, limit and budget checks) off the event loop, on a pool of
its own, under a deadline, and fair between callers.

asgiref's `database_sync_to_async` defaults to one thread shared by every connection of
the process: one tenant's call waiting on a locked row or a stalled Redis then delays
every other tenant's first byte (issue 24 measured 0.06 -> 14.6 s). Here:

- calls run on `ADMISSION_WORKERS` threads (Django opens a connection per thread);
- one caller (an API key's prefix, or a tenant) has at most `ADMISSION_PER_CALLER` calls
  on the pool at once, so a caller whose calls hang cannot take every thread;
- a call that takes longer than `ADMISSION_TIMEOUT_S` once on the pool is answered 503 with
  Retry-After (the thread finishes on its own; its result is dropped), and a database or
  Redis failure is a 503 in the OpenAI shape too, never a 500 or daphne's HTML page. A
  caller's own burst only queues behind itself, without a deadline.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import redis
from django import db
from django.conf import settings

from tenants import errors

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class _Gate:
    """A caller's share of the pool, dropped once nobody holds or waits for it."""

    def __init__(self) -> None:
        self.semaphore = asyncio.Semaphore(settings.ADMISSION_PER_CALLER)
        self.users = 0


_gates: dict[str, _Gate] = {}


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(settings.ADMISSION_WORKERS, thread_name_prefix="admission")
        return _pool


def close_connections(wait_s: float = 5.0) -> None:
    """Close every pool thread's database connection and retire the pool (the next call starts
    a new one). A thread stuck in a call past `wait_s` keeps its connection until it returns."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is None:
        return
    # One task per worker, each held at the barrier until all workers hold one: the pool spawns
    # threads up to its maximum for them, so every thread that exists runs exactly one.
    barrier = threading.Barrier(pool._max_workers)

    def close() -> None:
        try:
            barrier.wait(wait_s)
        except threading.BrokenBarrierError:
            pass
        db.connections.close_all()

    closing = [pool.submit(close) for _ in range(pool._max_workers)]
    concurrent.futures.wait(closing, timeout=wait_s + 1)
    pool.shutdown(wait=False)


def _call(fn: Callable[..., T], *args) -> T:
    # Each pool thread keeps its database connection from call to call. Django's own rule
    # (close_old_connections with CONN_MAX_AGE 0: a new connection per call) spent 10x the
    # time of the key lookup itself opening SQLite connections (py-spy, 80 refused requests a
    # second); these threads live as long as the process, so nothing leaks.
    connection = db.connection
    if connection.connection is not None and connection.errors_occurred and not connection.is_usable():
        connection.close()
    try:
        return fn(*args)
    except redis.RedisError as exc:
        raise errors.limits_unavailable(exc) from None
    except db.Error as exc:
        connection.close()  # the next call reconnects (the server may have restarted)
        raise errors.database_unavailable(exc) from None


def tenant_caller(tenant_id: int) -> str:
    """The caller every admission call of a tenant's requests runs as, once its key is known."""
    return f"tenant:{tenant_id}"


async def run(fn: Callable[..., T], *args, caller: str, what: str, keep: Callable[[T], None] | None = None) -> T:
    """`fn(*args)` on the admission pool, as `caller`; `what` names it in the 503's log line.

    The caller's slot is given back when the thread finishes, not when we stop waiting for
    it, so calls that hang keep counting against their own caller only. With `keep`, a waiter
    cancelled meanwhile (the client left) waits for the thread anyway and hands `keep` what
    the call took, so that the request's cleanup gives it back, then lets the cancellation
    through; a deadline passed drops the result.

    The thread hands its outcome to the loop once, straight onto the future its waiter awaits:
    two turns of the loop from the thread's end to the waiter running again. Through
    run_in_executor, shield and a task of its own it took five, and under another tenant's
    400-request burst a turn takes 1.5-3 ms: 8-10 ms a call, three calls a generation."""
    gate = _gates.get(caller)
    if gate is None:
        gate = _gates[caller] = _Gate()
    gate.users += 1
    loop = asyncio.get_running_loop()
    result = loop.create_future()
    finished: list = []  # (value, error) once the thread is done
    waiter: asyncio.Future | None = None  # set by a cancelled waiter that still wants the outcome

    def finish(value, error) -> None:  # on the loop
        gate.semaphore.release()
        leave()
        finished.append((value, error))
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        elif not result.done():
            if error is None:
                result.set_result(value)
            else:
                result.set_exception(error)

    def job() -> None:  # on the pool
        try:
            value, error = _call(fn, *args), None
        except BaseException as exc:  # noqa: BLE001 (handed to the waiter, whatever it is)
            value, error = None, exc
        try:
            loop.call_soon_threadsafe(finish, value, error)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def leave() -> None:
        gate.users -= 1
        if gate.users == 0 and _gates.get(caller) is gate:
            del _gates[caller]

    try:
        # Waiting for one's own turn is not a dependency's stall: only the call has a deadline.
        await gate.semaphore.acquire()
    except BaseException:
        leave()
        raise
    try:
        _executor().submit(job)
    except BaseException:
        gate.semaphore.release()
        leave()
        raise
    try:
        async with asyncio.timeout(settings.ADMISSION_TIMEOUT_S):
            return await result
    except TimeoutError:
        raise errors.dependency_timeout(what, settings.ADMISSION_TIMEOUT_S) from None
    except asyncio.CancelledError:
        if keep is not None:
            if not finished:
                waiter = loop.create_future()
                await waiter
            value, error = finished[0]
            if error is None:
                keep(value)
        raise
