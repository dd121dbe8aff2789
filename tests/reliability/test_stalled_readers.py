"""Issue 24 item 11: clients that stop reading their stream, and clients that read it slowly.

A client that stops reading is invisible to the server until the buffers between them fill.
Before this fix daphne buffered whatever a stream wrote, so a stalled client kept its
generation decoding to max_tokens (its KV blocks, its slot) while the server's buffer grew.
The shared live server (tests/isolation_env.py) now lets a stream leave at most
STREAM_MAX_BUFFERED_BYTES = 8 KiB untaken before its writes wait, and disconnects a client
that takes nothing for STREAM_STALL_S = 3 s; a reader that is merely slow gets the deltas
merged into fewer events, and the whole stream.

Clients set the smallest receive buffer before connecting (bench/isolation.py's stalled
readers set a small one): their kernel then takes 1,152 bytes before it stops acknowledging
(measured on loopback; ~100 KB with the default buffer), so what a stream writes piles up on
the server's side at once. The SSE streams ask for 20 alternatives per token (~1.9 KB an
event, against ~260 bytes of text alone) so that they fill 8 KiB in a few tokens even when
the shared two-core machine decodes one token a second, as it did while other suites ran.
"""
from __future__ import annotations

import base64
import json
import os
import socket
import struct
import time

from tests.live import LiveServer
from tests.serving.rawsse import OPENAI_CHAT, Event, SocketStream, Wire, chat_body, host_port, request_bytes

TENANT = "stall"
CAP = 8 * 1024  # the live server's STREAM_MAX_BUFFERED_BYTES
RCVBUF = 1024  # the kernel raises it to its minimum, 2,304
LOGPROBS = {"logprobs": True, "top_logprobs": 20}
EVENT_MAX = 4096  # the largest event of a stream with 20 alternatives per token (2.7 KB measured)
# A stalled stream asks for this many tokens: over a minute of decoding at the machine's best
# (28 tokens/s), far past the moment it must be cut.
LONG = 2048
# How long a stalled stream may still run before the test fails: its buffers fill within ~6
# tokens (SSE) or ~12 steps (WebSocket), then 3 s pass without progress. Under daphne's own
# WebSocket ping timeout (a ping after 20 s, unanswered for 30 s), which alone cut a stalled
# socket before the fix.
CUT_DEADLINE_S = 40
# Generations on the stalled WebSocket: each token frame echoes its generation's id, so four
# ids of the longest allowed length make ~800 bytes a step.
WS_GENERATIONS = 4
WS_ID_LENGTH = 128
# The slow reader takes 256 bytes every 0.15 s, 1.7 KB/s: slower than its stream writes whenever
# the engine makes more than 0.9 tokens a second (~1.9 KB a token), while freeing 576 bytes
# of its kernel buffer every ~0.35 s, which is what the server sees as progress (the client's
# window update), well inside 3 s. Twelve tokens are ~23 KB of events, read in ~14 s. At 0.05 s
# (5 KB/s) it outran the engine on a box loaded by other suites (2-3 tokens/s) and nothing merged.
SLOW = 12
SLOW_READ = 1024
SLOW_PAUSE_S = 0.15
HANG_GUARD_S = 300  # a broken server fails the test instead of hanging it; never a timing assertion
STALL_LOG = "the client took nothing for"


def client_socket(live: LiveServer) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)  # before connect: it sets the window
    sock.settimeout(HANG_GUARD_S)
    sock.connect(host_port(live.url))
    return sock


def read_head(sock: socket.socket) -> Wire:
    """Read until the response's head has arrived (a first event may come with it)."""
    wire = Wire()
    while wire.status is None:
        data = sock.recv(1024)
        assert data, "the server closed before answering"
        wire.feed(data)
    return wire


def is_idle(stats: dict) -> bool:
    return stats["kv_blocks_used"] == 0 and stats["requests_running"] == 0 and not any(stats["requests_waiting"].values())


def wait_until(live: LiveServer, done, timeout: float) -> dict:
    """Poll the engine's stats until `done(stats)` or `timeout`; returns the last stats."""
    deadline = time.monotonic() + timeout
    while not done(stats := live.stats()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return stats


def closed_by_server(sock: socket.socket) -> bool:
    """Read what is left until the server's FIN or reset; False if it keeps the connection open."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    finally:
        sock.close()
    return True


def usage_rows(live: LiveServer) -> list[dict]:
    return live.django(f"""
from tenants.models import UsageRecord
result = [{{"request_id": r.request_id, "completion_tokens": r.completion_tokens, "finish_reason": r.finish_reason,
           "closed": r.closed}}
          for r in UsageRecord.objects.filter(tenant_id={live.tenant_ids[TENANT]}).order_by("created")]
""")


def new_usage_rows(live: LiveServer, before: list[dict], count: int) -> list[dict]:
    """The `count` usage rows written and completed since `before` (billing follows the abort by a moment)."""
    seen = {row["request_id"] for row in before}
    deadline = time.monotonic() + HANG_GUARD_S
    while len(rows := [r for r in usage_rows(live) if r["request_id"] not in seen and r["closed"]]) < count:
        assert time.monotonic() < deadline, f"{count - len(rows)} stalled requests were never billed"
        time.sleep(0.5)
    assert len(rows) == count, rows
    return rows


def stall_warnings(live: LiveServer) -> list[str]:
    return [line for line in live.log().splitlines() if STALL_LOG in line]


def assert_cut_and_billed(live: LiveServer, sock: socket.socket, before: list[dict], requests: int = 1) -> list[dict]:
    stats = wait_until(live, is_idle, CUT_DEADLINE_S)
    assert is_idle(stats), f"the stalled stream still holds the engine after {CUT_DEADLINE_S} s: {stats}"
    assert closed_by_server(sock), "the server kept the stalled client's connection open"
    rows = new_usage_rows(live, before, requests)
    for row in rows:  # billed for what was generated before the cut, not for max_tokens
        assert row["finish_reason"] == "abort", row
        assert 0 < row["completion_tokens"] < LONG, row
    return rows


def test_a_stalled_sse_client_is_disconnected_its_generation_aborted_and_billed(hostile_live: LiveServer):
    live, before, warnings = hostile_live, usage_rows(hostile_live), len(stall_warnings(hostile_live))
    sock = client_socket(live)
    sock.sendall(request_bytes(live.url, OPENAI_CHAT, live.keys[TENANT], chat_body(LONG, stream=True, **LOGPROBS)))
    wire = read_head(sock)  # admitted: the engine runs it; the client reads nothing more
    assert wire.status == 200, wire.body

    [row] = assert_cut_and_billed(live, sock, before)
    assert row["request_id"] == wire.headers["x-request-id"]
    # One warning for the operator, naming the path and what was left unsent (no tenant).
    [warning] = stall_warnings(live)[warnings:]
    assert "stream /v1/chat/completions:" in warning and "bytes unsent" in warning


# What a stalled stream can generate before it pauses: the tokens whose events fill the cap and
# the client's kernel buffer (~1.9 KB each), STREAM_PAUSE_AFTER_TOKENS = 8 more waiting behind
# them, and the few steps the pause takes to reach the engine thread.
PAUSED_WITHIN = (CAP + 2 * 2304) // 1900 + 1 + 8 + 4


def test_a_stalled_stream_pauses_in_the_engine_and_takes_no_more_steps(hostile_live: LiveServer):
    live, before = hostile_live, usage_rows(hostile_live)
    sock = client_socket(live)
    sock.sendall(request_bytes(live.url, OPENAI_CHAT, live.keys[TENANT], chat_body(LONG, stream=True, **LOGPROBS)))
    assert read_head(sock).status == 200
    paused = wait_until(live, lambda s: s["requests_paused"] == 1, CUT_DEADLINE_S)
    assert paused["requests_paused"] == 1, f"the stalled stream never paused: {paused}"
    # Paused, it holds its blocks but the engine makes no token for it: nothing else runs here.
    assert paused["requests_running"] == 1 and paused["kv_blocks_used"] > 0
    time.sleep(1.0)
    assert live.stats()["generated_tokens"] == paused["generated_tokens"], "a paused stream kept decoding"

    [row] = assert_cut_and_billed(live, sock, before)
    # Billed for what it generated, which stopped at the pause: not STREAM_STALL_S of decoding.
    assert row["completion_tokens"] <= PAUSED_WITHIN, row
    assert live.stats()["requests_paused"] == 0


def ws_handshake(live: LiveServer) -> bytes:
    host, port = host_port(live.url)
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET /ws/v1/chat HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            f"Authorization: Bearer {live.keys[TENANT]}\r\n\r\n").encode()


def ws_text_frame(text: str) -> bytes:
    """One masked text frame, as RFC 6455 has a client send it."""
    payload = text.encode()
    size = len(payload)
    head = bytes([0x81]) + (bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + struct.pack("!H", size))
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_a_stalled_websocket_client_is_disconnected_its_generations_aborted_and_billed(hostile_live: LiveServer):
    live, before, warnings = hostile_live, usage_rows(hostile_live), len(stall_warnings(hostile_live))
    sock = client_socket(live)
    sock.sendall(ws_handshake(live))
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(1)
        assert data, "the server closed during the handshake"
        head += data
    assert head.startswith(b"HTTP/1.1 101"), head
    for i in range(WS_GENERATIONS):
        gen_id = str(i).rjust(WS_ID_LENGTH, "g")
        sock.sendall(ws_text_frame(json.dumps({"type": "start", "id": gen_id, **chat_body(LONG)})))
    # The client reads nothing from here on.
    running = wait_until(live, lambda s: s["requests_running"] > 0, HANG_GUARD_S)
    assert running["requests_running"] > 0, running

    assert_cut_and_billed(live, sock, before, WS_GENERATIONS)
    [warning] = stall_warnings(live)[warnings:]  # one connection, one warning
    assert "stream /ws/v1/chat:" in warning


def test_a_slow_reader_gets_the_whole_stream_with_the_deltas_merged(hostile_live: LiveServer):
    live = hostile_live
    body = chat_body(SLOW, stream=True, **LOGPROBS)
    fast = SocketStream(live.url, OPENAI_CHAT, live.keys[TENANT], body, timeout=HANG_GUARD_S)
    fast_events = []
    while (event := fast.next_event()) is not None:
        fast_events.append(event)
    fast.close()

    sock = client_socket(live)
    sock.sendall(request_bytes(live.url, OPENAI_CHAT, live.keys[TENANT], body))
    wire, slow_events = Wire(), []
    while not wire.ended:
        time.sleep(SLOW_PAUSE_S)  # slower than the stream writes, never still for STREAM_STALL_S
        data = sock.recv(SLOW_READ)
        if not data:
            break
        slow_events += [item for item in wire.feed(data) if isinstance(item, Event)]
    sock.close()
    assert wire.ended and slow_events[-1].data == "[DONE]", "the slow reader's stream did not complete"
    assert [e.id for e in slow_events] == list(range(len(slow_events))), "an event is missing"

    def tokens(events: list[Event]) -> list[list[str]]:
        """Per event, the tokens it carries (its logprobs list one entry per token)."""
        choices = [e.json()["choices"][0] for e in events if e.data != "[DONE]"]
        return [[t["token"] for t in (c["logprobs"] or {}).get("content", [])] for c in choices]

    def text(events: list[Event]) -> str:
        return "".join(e.json()["choices"][0]["delta"].get("content") or "" for e in events if e.data != "[DONE]")

    fast_tokens, slow_tokens = tokens(fast_events), tokens(slow_events)
    # Merging lost nothing: the same text and the same tokens, in order.
    assert text(slow_events) == text(fast_events)
    assert sum(slow_tokens, []) == sum(fast_tokens, []) and len(sum(fast_tokens, [])) == SLOW
    # The fast reader gets one token an event; the slow one gets the deltas that piled up while
    # it read merged into one event, instead of a backlog that grows while it reads.
    assert max(map(len, slow_tokens)) >= 3, f"no event merged deltas: {list(map(len, slow_tokens))}"


def test_what_the_server_holds_for_a_stalled_client_stays_under_the_cap(hostile_live: LiveServer):
    live = hostile_live
    disconnected = live.stats()["streams"]["stalled_disconnected"]
    sock = client_socket(live)
    sock.sendall(request_bytes(live.url, OPENAI_CHAT, live.keys[TENANT], chat_body(LONG, stream=True, **LOGPROBS)))
    assert read_head(sock).status == 200
    held = []

    def sample(stats: dict) -> bool:
        held.append(stats["streams"]["buffered_bytes_max"])
        return is_idle(stats)

    stats = wait_until(live, sample, CUT_DEADLINE_S)
    # The operators' stats saw it reach the cap, and go no further than the one event that
    # crossed it, for as long as it stood stalled; then counted one client disconnected.
    assert CAP / 2 < max(held) <= CAP + EVENT_MAX, held
    assert is_idle(stats), f"the stalled stream still holds the engine after {CUT_DEADLINE_S} s: {stats}"
    assert stats["streams"]["stalled_disconnected"] == disconnected + 1
    assert closed_by_server(sock)
