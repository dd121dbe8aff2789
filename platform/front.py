#!/usr/bin/env python
"""The front of `make run` with WEB_WORKERS above 1: it owns the public port and hands each new
connection, whole, to one of the web processes (daphne workers sharing one engine, see
`manage.py engine_server`), which serve it as if they had accepted it themselves.

    client --TCP--> front: accept, read the request's head, choose a worker
                      '--- the socket itself + the head's bytes (SCM_RIGHTS) ---> worker k

Why: one web process is one interpreter, and a tenant's burst of 400 connections keeps it busy
for about a second: every other tenant's request waits among the burst's work (another
tenant's first token 2.3-4.8x its idle time on 2 cores, docs/benchmarks.md). With more than
one worker, the other tenants' connections go where the burst is not:

- a caller is its key (the Authorization header's value), else its address;
- a caller that came within STICKY_S sticks to the worker it went to; one new (or back after a
  quiet minute) goes to the worker that took the fewest connections within HEAVY_WINDOW_S, so a
  burst that starts lands away from the callers already being served;
- a caller that opened HEAVY_CONNECTIONS connections within HEAVY_WINDOW_S is heavy (for
  STICKY_S after) and keeps its worker; the other callers leave a heavy caller's worker for one
  no heavy caller is on, while there is one.

The engine is shared, so where a connection lands changes nothing of its prefix cache; only
which interpreter parses it and writes its stream. Nothing is proxied: the front reads a
request's head (to REQUEST_HEAD_BYTES, within REQUEST_HEAD_TIMEOUT_S, else it routes what it
has by the address) and never touches the connection again. A kept-alive connection stays on
its worker.

Workers connect to the front's Unix socket (FRONT_SOCKET) and say their number, and say when
they take each connection (before reading from it): the front keeps its own descriptor until
then, so a worker that dies loses none it had not taken; they go to the others. One gone (its
socket's end of file) gets no more, nor one stuck (WORKER_BACKLOG connections not taken), and
its share goes to the next worker in the ring until it is back. No worker at all:
connections wait, up to PENDING_MAX, for one to connect. SIGTERM stops accepting (the workers
drain) and the front exits once its workers are gone, or after DRAIN_TIMEOUT_S.
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import resource
import selectors
import signal
import socket
import sys
import time
import zlib
from dataclasses import dataclass, field

log = logging.getLogger("front")

REQUEST_HEAD_BYTES = 16 * 1024  # routing reads no further: Authorization comes early in a head
HEAVY_CONNECTIONS = 32
HEAVY_WINDOW_S = 2.0
# How long a caller keeps its worker after its last connection: a tenant that comes back stays
# where it was, so a burst that starts (a new caller) is what goes elsewhere. At 2 s a tenant
# returning every few seconds chose afresh each time and, tied with a burst's first connection,
# went with it: 1 first token in 10 of 40 then waited among the burst (bench/isolation.py).
STICKY_S = 60.0
PENDING_MAX = 4096  # connections being read at once; past it the oldest is routed by its address
WORKER_BACKLOG = 1024  # connections a worker has not taken before it counts as stuck
ACCEPTS_PER_TURN = 64
_AUTHORIZATION = b"\r\nauthorization:"


def caller_of(head: bytes, peer: str) -> str:
    """The key a head carries, else the peer's address."""
    at = head.lower().find(_AUTHORIZATION)
    if at >= 0:
        start = at + len(_AUTHORIZATION)
        end = head.find(b"\r\n", start)
        value = head[start:end if end >= 0 else len(head)].strip()
        if value:
            return "key:" + value.decode("latin-1")
    return "peer:" + peer


class Router:
    """Which worker a caller's next connection goes to (no sockets here).

    A caller that came within STICKY_S sticks to the worker it went to; a heavy one always
    (its burst stays on one worker), another while no heavy caller is there. A caller without
    a worker goes to the one that took the fewest connections within the window, among those
    no heavy caller is on (its hash breaks ties): a burst that starts lands away from the
    callers already served, before it counts as heavy."""

    def __init__(self, slots: int, heavy_connections: int = HEAVY_CONNECTIONS,
                 heavy_window_s: float = HEAVY_WINDOW_S) -> None:
        self.slots = slots
        self.heavy_connections, self.heavy_window_s = heavy_connections, heavy_window_s
        self.alive: set[int] = set()
        self.arrivals: dict[str, collections.deque] = {}  # caller -> its connections' times in the window
        # caller -> when it last counted as heavy; remembered as long as where callers went, so
        # a tenant that shared a worker with a burst once leaves it at its next request
        self.heavy: dict[str, float] = {}
        self.last: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()  # caller ->
        # (worker, when) of its last connection, the least recent first
        self.load: dict[int, collections.deque] = {}  # worker -> the times it was handed connections

    def home(self, caller: str) -> int:
        """Where the caller's hash points: the first choice among equals."""
        return zlib.crc32(caller.encode()) % self.slots

    def route(self, caller: str, now: float) -> int | None:
        window = now - self.heavy_window_s
        arrivals = self.arrivals.setdefault(caller, collections.deque())
        arrivals.append(now)
        while arrivals[0] < window:
            arrivals.popleft()
        if len(arrivals) >= self.heavy_connections:
            self.heavy[caller] = now
        stuck = self.last.get(caller)
        sticky = stuck[0] if stuck is not None and stuck[0] in self.alive and stuck[1] >= now - STICKY_S else None
        if caller in self.heavy:
            choice = sticky if sticky is not None else self._least_loaded(self.alive, caller, now)
        else:
            crowded = {self.last[other][0] for other in self.heavy if other in self.last}
            candidates = (self.alive - crowded) or self.alive
            choice = sticky if sticky in candidates else self._least_loaded(candidates, caller, now)
        if choice is not None:
            self.last[caller] = (choice, now)
            self.last.move_to_end(caller)
            self.load.setdefault(choice, collections.deque()).append(now)
        return choice

    def _least_loaded(self, candidates: set[int], caller: str, now: float) -> int | None:
        if not candidates:
            return None
        home = self.home(caller)
        for worker in candidates:
            self._prune(self.load.get(worker), now)
        return min(candidates, key=lambda w: (len(self.load.get(w, ())), (w - home) % self.slots))

    def _prune(self, times: collections.deque | None, now: float) -> None:
        while times and times[0] < now - self.heavy_window_s:
            times.popleft()

    def forget(self, now: float) -> None:
        """Drop what fell out of the window (called a few times a second)."""
        window = now - self.heavy_window_s
        for caller in [c for c, when in self.heavy.items() if when < now - STICKY_S]:
            del self.heavy[caller]
        for caller in [c for c, q in self.arrivals.items() if not q or q[-1] < window]:
            del self.arrivals[caller]
        while self.last and next(iter(self.last.values()))[1] < now - STICKY_S:
            self.last.popitem(last=False)
        for times in self.load.values():
            self._prune(times, now)


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    peer: str
    deadline: float
    head: bytearray = field(default_factory=bytearray)


@dataclass(eq=False)
class _Worker:
    number: int
    sock: socket.socket
    outbox: collections.deque = field(default_factory=collections.deque)  # (connection, head, caller) not yet sent
    # Sent, and not yet taken: the front keeps its descriptor of each until the worker says it
    # took it (before reading a byte of it), so one that dies first loses none of them.
    unacked: collections.deque = field(default_factory=collections.deque)
    stuck: bool = False

    @property
    def held(self) -> int:
        return len(self.outbox) + len(self.unacked)


class Front:
    def __init__(self, listener: socket.socket, control_path: str, slots: int, *, head_timeout_s: float = 30.0,
                 drain_timeout_s: float = 60.0, router: Router | None = None) -> None:
        self.listener = listener
        self.listener.setblocking(False)
        self.control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            os.unlink(control_path)
        except FileNotFoundError:
            pass
        old_umask = os.umask(0o077)  # this user's workers only
        try:
            self.control.bind(control_path)
        finally:
            os.umask(old_umask)
        self.control.listen(16)
        self.control.setblocking(False)
        self.control_path = control_path
        self.router = router or Router(slots)
        self.head_timeout_s, self.drain_timeout_s = head_timeout_s, drain_timeout_s
        self.selector = selectors.DefaultSelector()
        self.pending: collections.OrderedDict[int, _Pending] = collections.OrderedDict()
        self.unrouted: collections.deque = collections.deque()  # (connection, head, caller) while no worker is there
        self.workers: dict[int, _Worker] = {}
        self.hello: dict[int, socket.socket] = {}  # workers connected that have not said their number
        self.stopping = self.stop_asked = False
        self.accept_failed_at = 0.0
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        self.selector.register(self.control, selectors.EVENT_READ, self._worker_connects)

    # -- the loop ------------------------------------------------------------------------------

    def serve(self) -> None:
        last_sweep = 0.0
        stop_by = None
        while True:
            if self.stop_asked and not self.stopping:
                self._stop()
            for key, events in self.selector.select(0.1):
                try:
                    key.data(key.fileobj, events)
                except Exception:  # one connection's trouble must not end every other one's
                    log.exception("front: handling %s failed", key.fileobj)
            now = time.monotonic()
            if now - last_sweep >= 0.1:
                last_sweep = now
                self._sweep(now)
            if self.stopping:
                stop_by = stop_by or now + self.drain_timeout_s
                if not self.workers or now >= stop_by:
                    return

    def stop(self) -> None:
        """Stop accepting; serve() returns once the workers are gone (they drain). Safe in a
        signal handler: the loop acts on it between its turns."""
        self.stop_asked = True

    def _stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.selector.unregister(self.listener)
            self.listener.close()
            log.info("stopping: no new connections; waiting for %d workers to drain", len(self.workers))

    def close(self) -> None:
        for item in list(self.pending.values()):
            item.sock.close()
        for worker in self.workers.values():
            worker.sock.close()
        self.control.close()
        try:
            os.unlink(self.control_path)
        except FileNotFoundError:
            pass

    # -- clients -------------------------------------------------------------------------------

    def _accept(self, listener, events) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: the backlog holds the rest meanwhile
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    now = time.monotonic()
                    if now - self.accept_failed_at >= 1.0:  # the listener stays readable: once a second
                        log.error("accept failed: %s", exc)
                        self.accept_failed_at = now
                    return
                raise
            sock.setblocking(False)
            item = _Pending(sock, address[0], time.monotonic() + self.head_timeout_s)
            if len(self.pending) >= PENDING_MAX:
                _, oldest = self.pending.popitem(last=False)
                self.selector.unregister(oldest.sock)
                self._route(oldest, "peer:" + oldest.peer)
            self.pending[sock.fileno()] = item
            self.selector.register(sock, selectors.EVENT_READ, self._read_head)

    def _read_head(self, sock, events) -> None:
        item = self.pending.get(sock.fileno())
        if item is None or item.sock is not sock:  # routed earlier in this turn (the pending bound)
            return
        try:
            data = sock.recv(REQUEST_HEAD_BYTES - len(item.head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # gone before its head arrived
            self._drop(item)
            return
        item.head += data
        if b"\r\n\r\n" in item.head or len(item.head) >= REQUEST_HEAD_BYTES:
            self._take(item)
            self._route(item, caller_of(bytes(item.head), item.peer))

    def _take(self, item: _Pending) -> None:
        del self.pending[item.sock.fileno()]
        self.selector.unregister(item.sock)

    def _drop(self, item: _Pending) -> None:
        self._take(item)
        item.sock.close()

    def _sweep(self, now: float) -> None:
        self.router.forget(now)
        late = [item for item in self.pending.values() if item.deadline <= now]
        for item in late:  # the worker answers 408 for what did not arrive in time
            self._take(item)
            self._route(item, "peer:" + item.peer)

    def _route(self, item: _Pending, caller: str) -> None:
        number = self.router.route(caller, time.monotonic())
        if number is None:
            if len(self.unrouted) >= PENDING_MAX:
                item.sock.close()
                return
            self.unrouted.append((item.sock, bytes(item.head), caller))
            return
        self._hand(self.workers[number], item.sock, bytes(item.head), caller)

    def _hand(self, worker: _Worker, sock: socket.socket, head: bytes, caller: str) -> None:
        worker.outbox.append((sock, head, caller))
        if len(worker.outbox) == 1:
            self._flush(worker)
        if worker.held >= WORKER_BACKLOG and not worker.stuck:
            # Stuck (its interpreter held, stopped): it gets no more until it takes half of what
            # it holds; what was not sent to it yet goes elsewhere now.
            log.error("worker %d has not taken %d connections: sending it none until it does", worker.number,
                      worker.held)
            worker.stuck = True
            self.router.alive.discard(worker.number)
            unsent, worker.outbox = worker.outbox, collections.deque()
            self._reroute(unsent)

    def _flush(self, worker: _Worker) -> None:
        while worker.outbox:
            sock, head, _ = worker.outbox[0]
            try:
                socket.send_fds(worker.sock, [head], [sock.fileno()], socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                self.selector.modify(worker.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, self._worker_event)
                return
            except OSError:
                self._worker_gone(worker)
                return
            worker.unacked.append(worker.outbox.popleft())
        self.selector.modify(worker.sock, selectors.EVENT_READ, self._worker_event)

    def _reroute(self, items) -> None:
        for conn, head, caller in items:
            self._route(_Pending(conn, "", 0.0, bytearray(head)), caller)

    # -- workers -------------------------------------------------------------------------------

    def _worker_connects(self, control, events) -> None:
        try:
            sock, _ = control.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        self.hello[sock.fileno()] = sock
        self.selector.register(sock, selectors.EVENT_READ, self._worker_says)

    def _worker_says(self, sock, events) -> None:
        """A new worker's number (one message), then nothing until it leaves."""
        self.selector.unregister(sock)
        del self.hello[sock.fileno()]
        try:
            number = int(sock.recv(64))
        except (OSError, ValueError):
            sock.close()
            return
        if not 0 <= number < self.router.slots:
            log.error("a worker said it was number %s of %d: refused", number, self.router.slots)
            sock.close()
            return
        old = self.workers.get(number)
        if old is not None:
            self._worker_gone(old)
        self.workers[number] = _Worker(number, sock)
        self.router.alive.add(number)
        self.selector.register(sock, selectors.EVENT_READ, self._worker_event)
        log.info("worker %d connected (%d of %d)", number, len(self.workers), self.router.slots)
        waiting, self.unrouted = self.unrouted, collections.deque()
        self._reroute(waiting)

    def _worker_event(self, sock, events) -> None:
        worker = next((w for w in self.workers.values() if w.sock is sock), None)
        if worker is None:
            return
        if events & selectors.EVENT_READ:
            while True:  # a byte a connection taken: the front's descriptor of it can go
                try:
                    taken = sock.recv(4096, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    taken = b""
                if not taken:
                    self._worker_gone(worker)
                    return
                for _ in range(min(len(taken), len(worker.unacked))):
                    worker.unacked.popleft()[0].close()
            if worker.stuck and worker.held <= WORKER_BACKLOG // 2:
                log.warning("worker %d takes connections again", worker.number)
                worker.stuck = False
                self.router.alive.add(worker.number)
        if events & selectors.EVENT_WRITE:
            self._flush(worker)

    def _worker_gone(self, worker: _Worker) -> None:
        if self.workers.get(worker.number) is not worker:
            return
        del self.workers[worker.number]
        self.router.alive.discard(worker.number)
        self.selector.unregister(worker.sock)
        worker.sock.close()
        log.warning("worker %d gone; %d connections it had not taken go to the others", worker.number, worker.held)
        self._reroute([*worker.unacked, *worker.outbox])


def listen(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


def main() -> int:
    env = os.environ
    # A connection is a descriptor here until a worker takes it: the hard limit, not a stock 1,024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20), hard))
    except (ValueError, OSError) as exc:
        log.warning("open files stay at %d: %s", soft, exc)
    logging.basicConfig(level=env.get("LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s front %(message)s")
    slots = int(env["WEB_WORKERS"])
    # Loopback, as platform/Procfile's daphne: a host's edge (TLS, nginx) is in front of it.
    listener = listen("127.0.0.1", int(env["WEB_PORT"]), int(env.get("WEB_BACKLOG", "2048")))
    front = Front(listener, env["FRONT_SOCKET"], slots, head_timeout_s=float(env.get("REQUEST_HEAD_TIMEOUT_S", "30")),
                  drain_timeout_s=float(env.get("DRAIN_TIMEOUT_S", "60")))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: front.stop())
    log.info("listening on %s:%s for %d workers", *listener.getsockname()[:2], slots)
    try:
        front.serve()
    finally:
        front.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
