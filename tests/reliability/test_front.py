"""The front of `make run` with WEB_WORKERS (platform/front.py): where it sends each caller, and
how it hands connections over. The front runs here on real sockets, with stand-in workers that
take the handed-over connections and answer them as a web process would; the whole platform
behind it is tests/integration/test_web_workers.py.
"""
from __future__ import annotations

import importlib.util
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("front", ROOT / "platform" / "front.py")
front = sys.modules["front"] = importlib.util.module_from_spec(_spec)  # a script, not a package's module
_spec.loader.exec_module(front)

TIMEOUT_S = 30


def key_with_home(router, home: int, prefix: str) -> str:
    """A caller whose home is worker `home`."""
    return next(c for i in range(1000) if router.home(c := f"key:Bearer {prefix}-{i}") == home)


# -- where callers go --------------------------------------------------------------------------

def test_a_caller_sticks_to_its_worker_and_new_ones_go_to_the_least_loaded():
    router = front.Router(3, heavy_window_s=2.0)
    router.alive = {0, 1, 2}
    callers = [f"key:Bearer sk-{i}" for i in range(60)]
    first = {c: router.route(c, 0.001 * i) for i, c in enumerate(callers)}
    assert sorted(list(first.values()).count(w) for w in (0, 1, 2)) == [20, 20, 20]  # spread evenly
    assert all(router.route(c, 0.5) == first[c] for c in callers)  # and each stays
    router.alive = {0, 2}
    moved = {c: router.route(c, 1.0) for c in callers if first[c] == 1}
    assert set(moved.values()) == {0, 2}  # a dead worker's callers spread over the others
    router.forget(3.1)
    assert not router.arrivals and len(router.last) == 60  # where each went is kept a minute
    router.forget(61.1)
    assert not router.last
    router.alive = set()
    assert router.route(callers[0], 61.2) is None


def test_a_caller_back_after_a_pause_stays_apart_from_a_burst_starting_as_it_comes():
    """A tenant asking every few seconds, and a burst whose first connection comes just before
    its request: with 2 s of memory the tenant chose afresh each time and tied with the burst
    (4 of 40 first tokens 0.07-0.14 s in one run of bench/isolation.py's GETs row). Now where
    callers went and who was heavy are kept a minute: after one shared burst, never again."""
    router = front.Router(2, heavy_connections=8, heavy_window_s=2.0)
    router.alive = {0, 1}
    tenant, poller = key_with_home(router, 0, "tenant"), key_with_home(router, 1, "poller")
    burst = key_with_home(router, 0, "burst")
    assert router.route(tenant, 0.0) == 0
    placed = []
    for start in (5.0, 10.0, 15.0):
        router.forget(start)
        router.route(poller, start)  # a probe puts one connection on the worker the tenant is not on
        first = router.route(burst, start + 0.001)
        placed.append((router.route(tenant, start + 0.002), first))
        assert all(router.route(burst, start + 0.003 + i * 0.001) == first for i in range(20))
    # The first burst lands with the tenant (the probe's connection made the tenant's worker the
    # least loaded); it is heavy from then on, and the tenant leaves its worker for good.
    assert placed == [(0, 0), (1, 0), (1, 0)]


def test_a_burst_starts_away_from_the_callers_being_served_and_keeps_its_worker():
    router = front.Router(2, heavy_connections=8, heavy_window_s=2.0)
    router.alive = {0, 1}
    light = key_with_home(router, 0, "light")
    heavy = key_with_home(router, 0, "heavy")  # the same hash: ties would put them together
    assert router.route(light, 0.0) == 0
    burst = [router.route(heavy, 0.1 + i * 0.001) for i in range(20)]
    assert burst == [1] * 20  # the least loaded when it began, and kept once heavy
    assert router.route(light, 0.2) == 0
    newcomer = key_with_home(router, 1, "new")
    assert router.route(newcomer, 0.3) == 0  # not onto the burst's worker


def test_a_caller_leaves_a_heavy_callers_worker_while_another_is_free():
    router = front.Router(2, heavy_connections=8, heavy_window_s=2.0)
    router.alive = {0, 1}
    light, heavy = key_with_home(router, 0, "light"), key_with_home(router, 1, "heavy")
    router.route(heavy, 0.0)  # worker 1, the least loaded, on its hash
    assert router.route(light, 0.01) == 0
    router.alive = {1}  # worker 0 restarting: everyone on 1
    assert router.route(light, 0.02) == 1
    for i in range(8):  # the burst on 1 turns heavy
        assert router.route(heavy, 0.1 + i * 0.001) == 1
    router.alive = {0, 1}
    assert router.route(light, 0.2) == 0  # off the heavy caller's worker
    router.forget(2.3)  # the burst over for the window; remembered as heavy for a minute
    assert heavy in router.heavy and heavy not in router.arrivals
    router.forget(60.2)
    assert heavy not in router.heavy


def test_with_every_worker_crowded_a_caller_stays_where_it_is():
    router = front.Router(2, heavy_connections=4)
    router.alive = {0, 1}
    first, second = key_with_home(router, 0, "a"), key_with_home(router, 1, "b")
    light = key_with_home(router, 1, "light")
    assert router.route(light, 0.0) == 1
    for i in range(4):
        router.route(first, 0.01 + 0.01 * i)
        router.route(second, 0.01 + 0.01 * i)
    assert {router.last[first][0], router.last[second][0]} == {0, 1}
    assert router.route(light, 0.1) == 1


def test_the_caller_is_the_key_else_the_address():
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAUTHORIZATION:  Bearer sk-abc \r\n\r\n"
    assert front.caller_of(head, "10.0.0.1") == "key:Bearer sk-abc"
    assert front.caller_of(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n", "10.0.0.1") == "peer:10.0.0.1"
    assert front.caller_of(b"GET / HTTP/1.1\r\nAuthorization:\r\n\r\n", "10.0.0.2") == "peer:10.0.0.2"


# -- handing connections over ------------------------------------------------------------------

class StandIn:
    """A worker: takes connections from the front and answers each with its number and the
    head it was handed plus what the socket still held."""

    def __init__(self, path: str, number: int, take: bool = True) -> None:
        self.number = number
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(path)
        self.sock.sendall(str(number).encode())
        self.served = 0
        if take:
            threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                head, fds, _, _ = socket.recv_fds(self.sock, 64 * 1024, 1)
                self.sock.send(b"t")  # taken, as config.front_worker says it
            except OSError:
                return
            if not fds:
                return
            with socket.socket(fileno=fds[0]) as conn:
                conn.setblocking(True)
                conn.settimeout(TIMEOUT_S)
                data = bytes(head)
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                self.served += 1
                conn.sendall(b"worker %d: %s" % (self.number, data.split(b"\r\n", 1)[0]))

    def leave(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@pytest.fixture
def running_front(tmp_path):
    listener = front.listen("127.0.0.1", 0, 128)
    fr = front.Front(listener, str(tmp_path / "front.sock"), 2, head_timeout_s=1.0, drain_timeout_s=0.5)
    thread = threading.Thread(target=fr.serve, daemon=True)
    thread.start()
    yield fr, listener.getsockname()[1], str(tmp_path / "front.sock")
    fr.stop()
    thread.join(TIMEOUT_S)
    fr.close()


def ask(port: int, key: str | None, path: str = "/v1/models", split: bool = False) -> bytes:
    head = f"GET {path} HTTP/1.1\r\nHost: x\r\n" + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        if split:  # the head in two pieces, the second after the front has read the first
            sock.sendall(head[:20].encode())
            time.sleep(0.2)
            sock.sendall(head[20:].encode())
        else:
            sock.sendall(head.encode())
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        return answer


def ask_at_once(port: int, key: str, count: int) -> tuple[list[bytes], list[threading.Thread]]:
    """`count` requests of `key`, each on a thread; the answers as they come, and the threads."""
    answers: list[bytes] = []
    asking = [threading.Thread(target=lambda: answers.append(ask(port, key))) for _ in range(count)]
    for thread in asking:
        thread.start()
    return answers, asking


def wait_for_workers(fr, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while len(fr.workers) < count:
        assert time.monotonic() < deadline, "the workers never connected"
        time.sleep(0.01)


def test_a_connection_is_handed_whole_to_its_callers_worker(running_front):
    fr, port, path = running_front
    workers = [StandIn(path, 0), StandIn(path, 1)]
    wait_for_workers(fr, 2)
    keys = {home: key_with_home(fr.router, home, "sk").removeprefix("key:Bearer ") for home in (0, 1)}
    for home, key in keys.items():
        assert ask(port, key, "/v1/models?a=1") == b"worker %d: GET /v1/models?a=1 HTTP/1.1" % home
        assert ask(port, key, "/v1/files", split=True) == b"worker %d: GET /v1/files HTTP/1.1" % home
    assert [w.served for w in workers] == [2, 2]


def test_a_worker_gone_gets_no_more_and_one_back_gets_its_share_again(running_front):
    fr, port, path = running_front
    first, second = StandIn(path, 0), StandIn(path, 1)
    wait_for_workers(fr, 2)
    key = key_with_home(fr.router, 1, "sk").removeprefix("key:Bearer ")
    assert ask(port, key).startswith(b"worker 1:")
    second.leave()
    deadline = time.monotonic() + TIMEOUT_S
    while 1 in fr.workers:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ask(port, key).startswith(b"worker 0:")
    StandIn(path, 1)
    wait_for_workers(fr, 2)
    assert ask(port, key).startswith(b"worker 0:")  # it stays where it went
    newcomer = key_with_home(fr.router, 0, "new").removeprefix("key:Bearer ")
    assert ask(port, newcomer).startswith(b"worker 1:")  # the one back is the least loaded
    assert first.served == 2


def test_connections_wait_for_a_worker_and_a_silent_one_is_routed_by_address(running_front):
    fr, port, path = running_front
    answers = []
    asking = threading.Thread(target=lambda: answers.append(ask(port, "sk-early")))
    asking.start()
    time.sleep(0.3)
    assert not answers  # no worker yet: held, not refused
    StandIn(path, 0)
    asking.join(TIMEOUT_S)
    assert answers == [b"worker 0: GET /v1/models HTTP/1.1"]
    # A client that sends nothing is handed over after the head's deadline (the worker answers it).
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as silent:
        started = time.monotonic()
        silent.sendall(b"GET /slow")
        while not fr.pending:
            time.sleep(0.01)
        while fr.pending:
            assert time.monotonic() - started < TIMEOUT_S
            time.sleep(0.01)
        assert time.monotonic() - started >= 0.9


def test_connections_handed_to_a_worker_that_dies_before_taking_them_go_to_another(running_front):
    """A web process killed (the OOM killer) with connections the front sent it still queued:
    the front kept its own descriptor of each until taken, so they are served elsewhere."""
    fr, port, path = running_front
    StandIn(path, 0)
    dying = StandIn(path, 1, take=False)
    wait_for_workers(fr, 2)
    answers, asking = ask_at_once(port, key_with_home(fr.router, 1, "sk").removeprefix("key:Bearer "), 3)
    deadline = time.monotonic() + TIMEOUT_S
    while len(fr.workers[1].unacked) < 3:
        assert time.monotonic() < deadline, "the front never handed them over"
        time.sleep(0.01)
    dying.leave()
    for thread in asking:
        thread.join(TIMEOUT_S)
    assert answers == [b"worker 0: GET /v1/models HTTP/1.1"] * 3


def test_a_stuck_worker_gets_no_more_until_it_takes_what_it_holds(running_front, monkeypatch):
    fr, port, path = running_front
    monkeypatch.setattr(front, "WORKER_BACKLOG", 4)
    StandIn(path, 0)
    stuck = StandIn(path, 1, take=False)
    wait_for_workers(fr, 2)
    answers, asking = ask_at_once(port, key_with_home(fr.router, 1, "sk").removeprefix("key:Bearer "), 6)
    deadline = time.monotonic() + TIMEOUT_S
    while len(answers) < 2:  # the four it holds wait; the next two go to the other worker
        assert time.monotonic() < deadline, answers
        time.sleep(0.01)
    assert fr.workers[1].stuck and 1 not in fr.router.alive
    assert answers == [b"worker 0: GET /v1/models HTTP/1.1"] * 2
    stuck.leave()  # gone now: what it held goes to the other worker too
    for thread in asking:
        thread.join(TIMEOUT_S)
    assert answers == [b"worker 0: GET /v1/models HTTP/1.1"] * 6


def test_past_the_pending_bound_the_oldest_head_still_coming_is_handed_over(running_front, monkeypatch):
    """Connections whose heads have not all arrived are bounded (PENDING_MAX): past it the
    oldest goes to a worker with what it sent so far, by its address, and the worker reads the
    rest; the front holds no more than the bound."""
    fr, port, path = running_front
    monkeypatch.setattr(front, "PENDING_MAX", 2)
    fr.head_timeout_s = TIMEOUT_S  # not the fixture's 1 s: the bound, not the deadline, hands it over
    StandIn(path, 0)
    StandIn(path, 1)
    wait_for_workers(fr, 2)
    slow = []
    try:
        for i in range(3):
            slow.append(sock := socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S))
            sock.sendall(b"GET /part-%d" % i)
            deadline = time.monotonic() + TIMEOUT_S
            while sock.getsockname()[1] not in pending_ports(fr):
                assert time.monotonic() < deadline, i
                time.sleep(0.01)
        assert pending_ports(fr) == {sock.getsockname()[1] for sock in slow[1:]}
        slow[0].sendall(b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert slow[0].recv(4096).endswith(b": GET /part-0 HTTP/1.1")
    finally:
        for sock in slow:
            sock.close()


def pending_ports(fr) -> set[int]:
    """The client ports of the connections whose heads the front is reading (from its thread)."""
    while True:
        try:
            return {item.sock.getpeername()[1] for item in list(fr.pending.values())}
        except (RuntimeError, OSError):  # changed while copied, or closed meanwhile: again
            time.sleep(0.001)
