"""Slow requests (config.intake): a request's head must arrive within REQUEST_HEAD_TIMEOUT_S of
its turn and its body without a pause over REQUEST_BODY_IDLE_S, else it is answered 408 and its
connection closed. Twisted waited 12 hours for either, so a client sending a head a byte at a
time, or an upload that stopped, held its connection (and its tenant's bound of unanswered
requests) that long."""
import json
import select
import socket
import time

from tests import isolation_env
from tests.serving.rawsse import host_port

HEAD_S = float(isolation_env.ENV["REQUEST_HEAD_TIMEOUT_S"])
BODY_S = float(isolation_env.ENV["REQUEST_BODY_IDLE_S"])
GUARD_S = 10  # a hang guard past the deadline, not a timing assertion


def _answer(sock: socket.socket, within: float, trickle: bytes = b"") -> bytes:
    """What the server sends until it closes, waiting at most `within` seconds; `trickle` is
    sent a byte every half second meanwhile (a head that never ends)."""
    answer, end = b"", time.monotonic() + within
    while time.monotonic() < end:
        ready, _, _ = select.select([sock], [], [], 0.5)
        if ready:
            data = sock.recv(65536)
            if not data:
                return answer
            answer += data
        elif trickle:
            try:
                sock.sendall(trickle[:1])
            except OSError:
                pass
            trickle = trickle[1:] or b"x"
    return answer


def _timeout_error(answer: bytes) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    return json.loads(body)["error"]


def test_a_head_that_never_ends_and_a_body_that_stops_are_cut_with_a_408(hostile_live):
    address = host_port(hostile_live.url)
    key = hostile_live.keys["intake-other"]
    slow_head = socket.create_connection(address, timeout=30)
    slow_head.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    stopped_body = socket.create_connection(address, timeout=30)
    stopped_body.sendall(f"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                         "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ".encode())
    try:
        body_error = _timeout_error(_answer(stopped_body, BODY_S + GUARD_S))
        head_error = _timeout_error(_answer(slow_head, HEAD_S + GUARD_S, trickle=b"abcdefghijklmnopqrstuvwxyz" * 10))
    finally:
        slow_head.close()
        stopped_body.close()
    assert head_error["code"] == body_error["code"] == "request_timeout"
    assert f"{HEAD_S:g} s" in head_error["message"] and f"{BODY_S:g} s" in body_error["message"]


def test_a_body_that_keeps_coming_slowly_is_served(hostile_live):
    """The body's deadline is a pause, not a total: a slow uploader that keeps sending is served."""
    key = hostile_live.keys["intake-other"]
    body = json.dumps({"prompt": "hello world"}).encode().ljust(64)  # JSON allows the padding
    parts = 4
    sock = socket.create_connection(host_port(hostile_live.url), timeout=30)
    try:
        sock.sendall(f"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        step = len(body) // parts
        for i in range(parts):  # over 1.6 x BODY_S in all, each pause well under it
            sock.sendall(body[i * step:(i + 1) * step if i < parts - 1 else len(body)])
            time.sleep(BODY_S * 0.4)
        answer = _answer(sock, GUARD_S)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_a_kept_alive_connection_left_idle_is_closed_and_one_in_use_is_not(hostile_live):
    """Twisted kept an idle connection 12 hours: a file descriptor each for whoever left them."""
    idle_s = float(isolation_env.ENV["HTTP_KEEPALIVE_TIMEOUT_S"])
    address = host_port(hostile_live.url)
    key = hostile_live.keys["intake-other"]
    ask = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    idle, used = socket.create_connection(address, timeout=30), socket.create_connection(address, timeout=30)
    try:
        for sock in (idle, used):
            sock.sendall(ask)
            assert _answer_head(sock).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        while time.monotonic() - start < idle_s * 1.25:  # a request every third of the timeout
            time.sleep(idle_s / 3)
            used.sendall(ask)
            assert _answer_head(used).startswith(b"HTTP/1.1 200"), "a connection in use was closed"
        assert _answer(idle, GUARD_S) == b"", "the idle connection got something other than its close"
        ready, _, _ = select.select([idle], [], [], 0)
        assert ready and idle.recv(1) == b"", "the idle connection is still open"
    finally:
        idle.close()
        used.close()


def _answer_head(sock: socket.socket) -> bytes:
    """One response of a kept-alive connection, read to the end of its Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head
