"""Draining a replica on SIGTERM: it takes no new generation, finishes the ones running,
then stops the server.

Twisted (under daphne) stops at once on SIGTERM, cutting every stream mid-reply. Here SIGTERM
starts a drain instead: new generations get 503 with Retry-After (a balancer retries them on
another replica), /readyz answers 503 `draining` so the balancer stops sending, the fleet
lists the replica as `draining`, and once nothing is in flight, or after DRAIN_TIMEOUT_S,
the reactor stops as it would have. SIGINT (Ctrl-C) still stops at once.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

from django.conf import settings

from config.daphne_hooks import open_sse_responses
from inference.host import EngineUnavailable, host
from tenants.errors import ApiError

log = logging.getLogger(__name__)

POLL_S = 0.2

_installed = False
_draining = threading.Event()


def draining() -> bool:
    return _draining.is_set()


def refuse_if_draining() -> None:
    if _draining.is_set():
        raise ApiError(503, "This replica is shutting down; retry the request.", type="server_error",
                       code="service_unavailable", headers={"Retry-After": "1"})


def install() -> None:
    """Take SIGTERM from Twisted (once; called when the server starts serving, on its loop)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed = True
    loop = asyncio.get_running_loop()

    def on_sigterm(signum, frame) -> None:
        loop.call_soon_threadsafe(_begin)

    signal.signal(signal.SIGTERM, on_sigterm)


def _in_flight() -> int:
    """Generations in the engine, and SSE responses still being written (their last events
    follow the generation's end)."""
    try:
        running = host.engine().stats().in_flight
    except EngineUnavailable:
        running = 0
    return running + open_sse_responses()


def _begin() -> None:
    if _draining.is_set():
        return
    _draining.set()
    log.warning("SIGTERM: draining (%d generations in flight, at most %.0f s)", _in_flight(), settings.DRAIN_TIMEOUT_S)
    asyncio.ensure_future(_drain())


async def _drain() -> None:
    started, idle_polls = time.monotonic(), 0
    # Idle twice in a row: a non-streamed reply is sent just after its generation ends.
    while idle_polls < 2 and time.monotonic() - started < settings.DRAIN_TIMEOUT_S:
        idle_polls = idle_polls + 1 if not _in_flight() else 0
        await asyncio.sleep(POLL_S)
    left = _in_flight()
    if left:
        log.warning("drain timed out after %.0f s with %d generations in flight; stopping", settings.DRAIN_TIMEOUT_S, left)
    else:
        log.warning("drained in %.1f s; stopping", time.monotonic() - started)
    # Out of the fleet first: atexit would remove the entry only after the socket had closed
    # (a clean-clone run on a busy 2-core box read it listed after nothing listened). The
    # reactor is daphne's: only a process serving under it drains.
    from twisted.internet import reactor

    from inference import fleet  # which imports this module

    await asyncio.to_thread(fleet.leave)
    reactor.stop()
