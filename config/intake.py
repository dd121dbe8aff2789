"""New connections' first requests handed to daphne's HTTP parser in turns per caller, not in
the order they arrived.

Twisted accepts connections in the kernel's order and parses each request as its bytes are
read. A tenant's burst of connections that landed just before another tenant's request was
parsed, gated and answered before that request was looked at: of 300 refused requests sent
just before another caller's, all 300 were answered first (tests/reliability/test_intake.py).
Here a new connection's first bytes are held under the caller they name (the tenant of a key
that authenticated in this process before, else the peer's address), and each turn
of the event loop hands held connections to the parser, one caller after another, for up to
INTAKE_TURN_MS: the other caller's request was answered after 2 of the 300.

Accepting is then cheap (no parsing in the accepting turn), so daphne accepts more a turn
(ACCEPTS_PER_TURN 64, not 8) and reaches a request queued behind a burst sooner. Another
tenant's first token under a 400-connection burst sent in ~12 ms, 2-core Zen 4, 25 bursts:
p50 0.18-0.19 s, p99 0.24-0.33 s before (8 accepts a turn, no intake); with both, 0.12 s and
0.15-0.16 s at 0.2 ms a turn, 0.13-0.15 s and 0.16-0.23 s at 0.5, 0.13 and 0.17 at 0.05 (one
request a turn), 0.19 and 0.23-0.24 at 2 (docs/benchmarks.md). What is left is the burst's
work itself (~0.2 s of the event loop), which every hop of the request waits among.

Only a connection's first bytes are held: a kept-alive connection's next request and a
WebSocket's frames go straight to their protocol.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict, deque

from tenants import middleware

log = logging.getLogger(__name__)

_AUTHORIZATION = re.compile(rb"\r\nauthorization:[ \t]*([^\r\n]*)", re.IGNORECASE)
_RELEASED, _LOST = object(), object()
# Past this many bytes held for one connection, its socket is not read until its turn: what a
# client sends meanwhile waits in the kernel's buffers, not in this process.
HELD_BYTES = 64 * 1024


def caller_of(head: bytes, peer: str) -> str:
    """Whom a request's first bytes speak for: its key's tenant where the key authenticated in
    this process before, else its peer's address (no key, one not seen yet, a made-up one: a
    queue per key would let a flood of made-up keys take a turn each)."""
    found = _AUTHORIZATION.search(head)
    caller = middleware.known_caller(found.group(1).decode("latin-1")) if found else None
    return caller or "peer:" + peer


class Intake:
    def __init__(self, turn_s: float, parse) -> None:
        self.turn_s = turn_s
        self.parse = parse  # HTTPChannel.dataReceived as Twisted defines it
        self.waiting: OrderedDict[str, deque] = OrderedDict()
        self.scheduled = False

    def hold(self, channel, data: bytes) -> None:
        channel._intake = bytearray(data)
        peer = getattr(channel.transport.getPeer(), "host", "")
        self.waiting.setdefault(caller_of(data, peer), deque()).append(channel)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.turn)

    def turn(self) -> None:
        self.scheduled = False
        until = time.monotonic() + self.turn_s
        while self.waiting:
            caller, queue = next(iter(self.waiting.items()))
            channel = queue.popleft()
            if queue:
                self.waiting.move_to_end(caller)
            else:
                del self.waiting[caller]
            data, channel._intake = channel._intake, _RELEASED
            if data is _LOST:
                continue
            if len(data) > HELD_BYTES:
                channel.transport.resumeProducing()
            try:
                self.parse(channel, bytes(data))
            except Exception:  # as Twisted treats a protocol's error: that connection is dropped
                log.exception("parsing a request failed")
                channel.transport.abortConnection()
            if time.monotonic() >= until:
                break
        if self.waiting:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.turn)


def install(turn_ms: float) -> None:
    """Hook Twisted's HTTP channel (once per process); turn_ms 0 leaves it as it is."""
    from twisted.web.http import HTTPChannel

    if turn_ms <= 0 or getattr(HTTPChannel, "_intake_installed", False):
        return
    intake = Intake(turn_ms / 1000, HTTPChannel.dataReceived)
    parse, lost = HTTPChannel.dataReceived, HTTPChannel.connectionLost

    def data_received(self, data):
        held = self.__dict__.get("_intake")
        if held is _RELEASED:
            return parse(self, data)
        if held is None:
            return intake.hold(self, data)
        held.extend(data)  # more of a request still waiting for its turn
        if len(held) > HELD_BYTES:
            self.transport.pauseProducing()

    def connection_lost(self, reason):
        if self.__dict__.get("_intake") is not _RELEASED:
            self._intake = _LOST
        return lost(self, reason)

    HTTPChannel.dataReceived = data_received
    HTTPChannel.connectionLost = connection_lost
    HTTPChannel._intake_installed = True
