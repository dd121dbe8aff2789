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

Every request is held, a kept-alive connection's next one too (behind nginx, which keeps 64
connections to daphne alive, a burst's requests reused them and skipped the queue); a
WebSocket's frames, once upgraded, go straight to their protocol.

A tenant also has at most INTAKE_PENDING_PER_CALLER requests parsed and not yet answered; its
next ones stay held until one is. Django runs each request of a sync view (models, files,
batches, usage, the console) on a thread of its own, as many at once as arrive: 400 parallel
GETs of /v1/models from one tenant peaked at 136-144 threads taking the interpreter in turns,
and another tenant's GET meanwhile took 0.48-0.53 s; with a bound of 16, 24-27 threads and
0.13 s, and the 400 were all answered sooner (1.7-1.9 s, not 2.4-2.8; 2-core AMX Xeon).
Another tenant's first token under that burst, p50 / p99: 0.191 / 0.231 s without the bound,
0.118 / 0.147 with it (bench/isolation.py, "400 GETs"; idle 0.032 / 0.055).

A request must also arrive: its head within REQUEST_HEAD_TIMEOUT_S of its turn, and its body
with no gap longer than REQUEST_BODY_IDLE_S (nginx's client_header_timeout and
client_body_timeout), else it is answered 408 and its connection closed. Twisted waits 12 hours
for either: a client sending its head a byte at a time held its connection, and a tenant's
stalled uploads held its bound of unanswered requests, as long as that.

Generation requests and WebSocket upgrades leave this count as they reach the flood gate
(tenants.flood_gate: the tenant's generations in flight are bounded there) and their consumer.
Callers known by address only (no key, or one not yet seen to authenticate here) are not
bounded: behind nginx they are all one address, and a tenant's first requests after a restart
would wait behind a stranger's slow ones; their keys are checked on the admission pool,
ADMISSION_PER_CALLER calls at a time a key. Probes (/healthz, /readyz, /metrics) queue as a
caller of their own, so a flood of one address never delays a load balancer's checks.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import time
from collections import OrderedDict, deque

from config.raw_errors import error_bytes
from tenants import middleware

log = logging.getLogger(__name__)

_AUTHORIZATION = re.compile(rb"\r\nauthorization:[ \t]*([^\r\n]*)", re.IGNORECASE)
_RELEASED, _LOST = object(), object()
# Past this many bytes held for one connection, its socket is not read until its turn: what a
# client sends meanwhile waits in the kernel's buffers, not in this process.
HELD_BYTES = 64 * 1024
_PROBES = re.compile(rb"GET /(?:healthz|readyz|metrics)[ ?]")
_UNBOUNDED = ("peer:", "probes")  # callers INTAKE_PENDING_PER_CALLER does not apply to


# When the request being served had arrived whole (its last byte read), for the application's
# task: daphne creates it in WebRequest.process, which copies this context (set around it below).
_arrived: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_arrived", default=None)


def arrival() -> float | None:
    """time.monotonic() when the HTTP request this task serves had arrived whole, before it
    waited for its caller's turn, its parsing and its admission; None outside one."""
    return _arrived.get()


def caller_of(head: bytes, peer: str) -> str:
    """Whom a request's first bytes speak for: the probes, its key's tenant where the key
    authenticated in this process before, else its peer's address (no key, one not seen yet, a
    made-up one: a queue per key would let a flood of made-up keys take a turn each)."""
    if _PROBES.match(head):
        return "probes"
    found = _AUTHORIZATION.search(head)
    caller = middleware.known_caller(found.group(1).decode("latin-1")) if found else None
    return caller or "peer:" + peer


def _late(head_s: float, body_s: float, phase: str) -> bytes:
    limit = f"its head within {head_s:g} s" if phase == "head" else f"no pause in its body over {body_s:g} s"
    return error_bytes(408, f"The request did not arrive in time: this server waits for {limit}.", "request_timeout")


class Intake:
    def __init__(self, turn_s: float, parse, pending_per_caller: int = 0, head_s: float = 0.0,
                 body_s: float = 0.0) -> None:
        self.turn_s = turn_s
        self.parse = parse  # HTTPChannel.dataReceived as Twisted defines it
        self.bound = pending_per_caller  # 0: no bound
        self.head_s, self.body_s = head_s, body_s  # 0: no deadline
        self.reading: dict = {}  # channel -> [phase, deadline] of the request it is reading
        self.sweeping = False
        self.waiting: OrderedDict[str, deque] = OrderedDict()  # callers whose turn may come
        self.parked: dict[str, deque] = {}  # callers at their bound of unanswered requests
        self.pending: dict[str, int] = {}  # caller -> its requests parsed and not yet answered
        self.scheduled = False

    def hold(self, channel, data: bytes) -> None:
        channel._intake = bytearray(data)
        channel.resetTimeout()  # Twisted's idle clock: a request waiting its turn is not idle
        peer = getattr(channel.transport.getPeer(), "host", "")
        caller = caller_of(data, peer)
        parked = self.parked.get(caller)
        if parked is not None:
            parked.append(channel)
            return
        self.waiting.setdefault(caller, deque()).append(channel)
        self._schedule()

    def settle(self, channel) -> None:
        """`channel`'s request is answered, or handed to a bound of its own: its caller's next
        held request may be parsed."""
        caller = channel.__dict__.pop("_intake_caller", None) if channel is not None else None
        if caller is None:
            return
        left = self.pending[caller] - 1
        if left:
            self.pending[caller] = left
        else:
            del self.pending[caller]
        queue = self.parked.pop(caller, None)
        if queue is not None:
            self.waiting[caller] = queue
            self._schedule()

    def _full(self, caller: str) -> bool:
        # Only a tenant's requests: one address behind nginx is every client's, and a key's
        # first requests, queued by address, must not wait for a stranger's slow ones there.
        return 0 < self.bound <= self.pending.get(caller, 0) and not caller.startswith(_UNBOUNDED)

    def _schedule(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.turn)

    def turn(self) -> None:
        self.scheduled = False
        until = time.monotonic() + self.turn_s
        while self.waiting:
            caller, queue = next(iter(self.waiting.items()))
            if self._full(caller):  # held until one of its requests is answered (settle)
                self.parked[caller] = self.waiting.pop(caller)
                continue
            channel = queue.popleft()
            if queue:
                self.waiting.move_to_end(caller)
            else:
                del self.waiting[caller]
            data, channel._intake = channel._intake, _RELEASED
            if data is _LOST:
                continue
            channel._intake_caller = caller
            self.pending[caller] = self.pending.get(caller, 0) + 1
            self.reading_head(channel)
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
            self._schedule()


    # -- read deadlines ------------------------------------------------------------------

    def reading_head(self, channel) -> None:
        if self.head_s > 0:
            self.reading[channel] = ["head", time.monotonic() + self.head_s]
            self._sweep_soon()

    def reading_body(self, channel) -> None:
        """The head is in (or more of the body came): the body may pause REQUEST_BODY_IDLE_S."""
        entry = self.reading.get(channel)
        if entry is not None:
            if self.body_s > 0:
                entry[0], entry[1] = "body", time.monotonic() + self.body_s
            else:
                del self.reading[channel]

    def read(self, channel) -> None:
        """The request has arrived whole (or its connection is gone)."""
        self.reading.pop(channel, None)

    def _sweep_soon(self) -> None:
        if not self.sweeping:
            self.sweeping = True
            asyncio.get_running_loop().call_later(1.0, self._sweep)

    def _sweep(self) -> None:
        self.sweeping = False
        now = time.monotonic()
        for channel, (phase, deadline) in list(self.reading.items()):
            if deadline <= now:
                del self.reading[channel]
                log.info("a request from %s did not arrive in time (%s): 408", channel.transport.getPeer(), phase)
                channel.transport.write(_late(self.head_s, self.body_s, phase))
                channel.transport.loseConnection()
        if self.reading:
            self._sweep_soon()


_installed: list[Intake] = []


def settle(channel) -> None:
    """`channel`'s request no longer counts against its caller's bound (see Intake.settle)."""
    if _installed:
        _installed[0].settle(channel)


def install(turn_ms: float, pending_per_caller: int = 0, head_timeout_s: float = 0.0,
            body_idle_s: float = 0.0) -> None:
    """Hook Twisted's HTTP channel and daphne's request (once per process); turn_ms 0 leaves
    them as they are."""
    from daphne.http_protocol import WebRequest
    from twisted.web.http import HTTPChannel

    if turn_ms <= 0 or getattr(HTTPChannel, "_intake_installed", False):
        return
    intake = Intake(turn_ms / 1000, HTTPChannel.dataReceived, pending_per_caller, head_timeout_s, body_idle_s)
    _installed.append(intake)
    parse, lost, done = HTTPChannel.dataReceived, HTTPChannel.connectionLost, HTTPChannel.requestDone
    headers_in = HTTPChannel.allHeadersReceived
    process, reply = WebRequest.process, WebRequest.handle_reply

    def data_received(self, data):
        self._bytes_at = time.monotonic()  # a request's last byte, once it is whole: its arrival
        held = self.__dict__.get("_intake")
        if held is _RELEASED:
            entry = intake.reading.get(self)
            if entry is not None and entry[0] == "body":
                intake.reading_body(self)
            return parse(self, data)
        if held is None:
            return intake.hold(self, data)
        held.extend(data)  # more of a request still waiting for its turn
        if len(held) > HELD_BYTES:
            self.transport.pauseProducing()

    def connection_lost(self, reason):
        if self.__dict__.get("_intake") is not _RELEASED:
            self._intake = _LOST
        intake.settle(self)
        intake.read(self)
        return lost(self, reason)

    def all_headers_received(self):
        intake.reading_body(self)
        return headers_in(self)

    def request_done(self, request):
        intake.settle(self)
        if self.persistent:
            # The next request (Twisted hands on what it buffered meanwhile) waits for its turn.
            self._intake = None
        return done(self, request)

    def process_request(self):
        intake.read(self.channel)
        upgrade = self.requestHeaders.getRawHeaders(b"upgrade") or [b""]
        if upgrade[0].lower() == b"websocket":
            intake.settle(self.channel)  # sockets per key are bounded by the consumer
        token = _arrived.set(getattr(self.channel, "_bytes_at", None))
        try:
            return process(self)
        finally:
            _arrived.reset(token)

    def handle_reply(self, message):
        if message.get("type") == "http.response.start":
            intake.settle(self.channel)
        return reply(self, message)

    HTTPChannel.dataReceived = data_received
    HTTPChannel.connectionLost = connection_lost
    HTTPChannel.requestDone = request_done
    HTTPChannel.allHeadersReceived = all_headers_received
    WebRequest.process = process_request
    WebRequest.handle_reply = handle_reply
    HTTPChannel._intake_installed = True
