"""Issue 24 item 13, the order a burst is served in: another caller's request that arrives just
after a burst of 300 connections is answered among the burst's first answers, not after all
of them (config.intake). Twisted parsed each connection as it was read, in the order the kernel
queued them, so a tenant's burst that landed first was parsed, gated and answered before anyone
else's request was looked at."""
import selectors
import socket

from tests.serving.rawsse import OPENAI_CHAT, chat_body, host_port, request_bytes

BURST = 300


def _send(sock: socket.socket, wire: bytes) -> socket.socket:
    sock.sendall(wire)
    sock.setblocking(False)
    return sock


def test_another_callers_request_is_answered_among_the_first_of_a_burst_that_arrived_before_it(hostile_live):
    address = host_port(hostile_live.url)
    body = chat_body(2, content="Hi.")
    # Every request is refused by the flood gate with a 401 (no key, or made-up ones), so the
    # server's answers come in the order it parses them. Keys the process has not seen
    # authenticate queue by their peer: the burst from 127.0.0.1, the other from 127.0.0.2.
    # Connected first, then written within a few milliseconds: the burst's requests arrive
    # together however fast the server accepts.
    connected = [socket.create_connection(address, timeout=30) for _ in range(BURST)]
    keys = [f"made-up-{i}" for i in range(BURST)]
    burst = [_send(sock, request_bytes(hostile_live.url, OPENAI_CHAT, key, body)) for sock, key in zip(connected, keys)]
    other = _send(socket.create_connection(address, timeout=30, source_address=("127.0.0.2", 0)),
                  request_bytes(hostile_live.url, OPENAI_CHAT, "", body))
    order, heads = [], {}
    with selectors.DefaultSelector() as selector:
        for sock in [*burst, other]:
            selector.register(sock, selectors.EVENT_READ)
        while len(order) < BURST + 1:
            ready = selector.select(timeout=60)
            assert ready, f"{BURST + 1 - len(order)} requests got no answer in 60 s"
            for event, _ in ready:
                sock = event.fileobj
                heads[sock] = sock.recv(65536)
                selector.unregister(sock)
                order.append(sock)
    for sock in order:
        sock.close()
    assert {heads[sock].split(b" ", 2)[1] for sock in order} == {b"401"}
    answered_before = order.index(other)
    assert answered_before < BURST // 4, f"{answered_before} of the burst's {BURST} requests were answered first"
