"""daphne raises its soft limit on open files to the hard one (config.daphne_hooks): a
connection is a file descriptor, and under a stock Linux's soft limit of 1,024 daphne stopped
accepting at about a thousand concurrent connections, the rest waiting in the listen queue
until one closed. Here daphne starts with a soft limit of 128 and 300 connections stay open
at once: each is answered."""
import selectors
import socket
import time

import pytest

from tests.live import start_live_server
from tests.serving.rawsse import host_port

OPEN_FILES = 128
CONNECTIONS = 300
TIER = {"lane": 1, "requests_per_minute": 100_000, "tokens_per_minute": 10**8, "concurrent_streams": 100,
        "max_tokens_per_request": 64, "monthly_token_budget": 10**12}


@pytest.fixture
def low_limit(tmp_path):
    server, stop = start_live_server(tmp_path, {"t": TIER}, {"t": "t"}, open_files=OPEN_FILES)
    try:
        yield server
    finally:
        stop()


def test_more_connections_than_the_soft_open_files_limit_are_all_answered(low_limit):
    address = host_port(low_limit.url)
    # Kept alive after their answers: each holds its descriptor in daphne to the end.
    connections = [socket.create_connection(address, timeout=30) for _ in range(CONNECTIONS)]
    answered = 0
    try:
        with selectors.DefaultSelector() as selector:
            for sock in connections:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)
            deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
            while answered < CONNECTIONS and time.monotonic() < deadline:
                for key, _ in selector.select(timeout=1):
                    head = key.fileobj.recv(65536)
                    selector.unregister(key.fileobj)
                    assert head.startswith(b"HTTP/1.1 200"), head[:200]
                    answered += 1
    finally:
        for sock in connections:
            sock.close()
    assert answered == CONNECTIONS, f"{CONNECTIONS - answered} of {CONNECTIONS} connections got no answer"
