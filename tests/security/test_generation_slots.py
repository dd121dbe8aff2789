"""Every generation holds its tenant's concurrent-generation slots, streamed or not, one per
choice (issue 24 item 4: "12 parallel non-streamed requests under a limit of 8 all ran;
`n` counts as one slot (8 streams with n=16 filled the engine's 64 sequences from one
tenant)").

The tenant "slots" has 8 slots (tests/isolation_env.py). Streams that are admitted and still
generating hold slots the test can see (their `: ok` comment has arrived); every further
request is then refused with 429 `streams`, whatever its transport.
"""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from tenants.limits import Limiter
from tests.live import LiveServer
from tests.serving.rawsse import OPENAI_CHAT, Comment, SocketStream, chat_body

TENANT = "slots"
SLOTS = 8
WAITERS = 2  # SLOT_WAITERS_PER_TENANT in tests/isolation_env.py
LONG = 500  # tokens (the tier's most): the held streams outlive the test's short requests


def _post(live: LiveServer, body: dict) -> tuple[int, dict]:
    return live.post_json("/v1/chat/completions", body, live.keys[TENANT])


def _hold(live: LiveServer, n: int = 1) -> SocketStream:
    """A streamed chat of `n` choices, admitted and generating (its slots are held)."""
    stream = SocketStream(live.url, OPENAI_CHAT, live.keys[TENANT], chat_body(LONG, stream=True, n=n))
    assert stream.next() == Comment("ok"), (stream.wire.status, stream.wire.body)
    return stream


def _slots_held(live: LiveServer) -> int:
    return Limiter(redis.Redis.from_url(live.redis_url)).leases_held(f"tenant:{live.tenant_ids[TENANT]}", "streams")


@pytest.fixture
def no_slots_held(hostile_live: LiveServer) -> LiveServer:
    """Start with every slot free (the last test's streams are released as their sockets close)."""
    deadline = time.monotonic() + 30
    while _slots_held(hostile_live) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _slots_held(hostile_live) == 0
    return hostile_live


def test_plain_json_requests_take_slots_like_streams(no_slots_held: LiveServer):
    live = no_slots_held
    held = [_hold(live) for _ in range(SLOTS)]
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: _post(live, chat_body(4)), range(4)))
        assert [status for status, _ in answers] == [429] * 4, answers
        assert all(body["error"]["type"] == "streams" for _, body in answers)
    finally:
        for stream in held:
            stream.close()


def test_each_choice_takes_a_slot(no_slots_held: LiveServer):
    live = no_slots_held
    held = [_hold(live, n=3), _hold(live, n=3)]
    try:
        assert _slots_held(live) == 6
        status, body = _post(live, chat_body(4, n=3))  # 6 + 3 > 8
        assert status == 429 and body["error"]["type"] == "streams", body
        status, body = _post(live, chat_body(4, n=2))  # 6 + 2 fits
        assert status == 200 and len(body["choices"]) == 2, body
        status, body = _post(live, chat_body(4, n=SLOTS + 1))  # can never fit: say so
        assert status == 400 and (body["error"]["code"], body["error"]["param"]) == ("too_many_choices", "n"), body
    finally:
        for stream in held:
            stream.close()


def test_a_request_at_the_limit_waits_briefly_for_a_slot_and_is_served_when_one_frees(no_slots_held: LiveServer):
    """SLOT_WAIT_S (1 s): a client looping on refusals makes one request a second per connection,
    not one every few milliseconds, and a request whose slot frees meanwhile needs no retry."""
    live = no_slots_held
    held = [_hold(live) for _ in range(SLOTS)]
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_post, live, chat_body(4))
            time.sleep(0.3)  # it is waiting for a slot now
            held.pop().close()  # one generation ends: its slot goes to the waiting request
            status, body = waiting.result(timeout=60)
        assert status == 200, body
        held.append(_hold(live))  # all eight held again
        started = time.monotonic()
        status, body = _post(live, chat_body(4))  # nothing frees now: refused after the wait
        assert status == 429 and body["error"]["type"] == "streams"
        assert time.monotonic() - started >= 1.0
    finally:
        for stream in held:
            stream.close()


def test_past_its_waiting_share_a_tenants_requests_are_refused_without_waiting(no_slots_held: LiveServer):
    """A burst of one tenant's requests at its limit: SLOT_WAITERS_PER_TENANT (2 here) of them wait
    for a slot, the rest are refused at once. Before, all of a 400 burst waited SLOT_WAIT_S and
    retried together, and another tenant's first token waited behind them (0.17 -> 4.4 s)."""
    live = no_slots_held
    held = [_hold(live) for _ in range(SLOTS)]
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _post(live, chat_body(4)), range(8)))
    finally:
        for stream in held:
            stream.close()
    assert [status for status, _ in answers] == [429] * 8, answers
    assert all(body["error"]["type"] == "streams" for _, body in answers), answers
    at_once = [body for _, body in answers if "already wait" in body["error"]["message"]]
    assert len(at_once) == 8 - WAITERS, answers


def _remaining_requests(live: LiveServer, key: str) -> int:
    """x-ratelimit-remaining-requests of a one-token chat (which also makes the key known to the process)."""
    request = urllib.request.Request(live.url + OPENAI_CHAT, data=json.dumps(chat_body(1)).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
        return int(response.headers["x-ratelimit-remaining-requests"])


def test_past_what_could_run_or_wait_a_tenants_requests_are_refused_before_admission_spends_anything(hostile_live: LiveServer):
    """Issue 24's 400 burst: a tenant whose generations all ran and whose waiting share was full
    still had each further request looked up in the database and written to its requests/min in
    Redis on the admission pool (~2 ms of the GIL apiece) before the slot gate refused it, while
    another tenant's first token waited among them. Now the process counts each tenant's requests
    in flight and refuses past its concurrent generations + SLOT_WAITERS_PER_TENANT on the event
    loop: those refusals spend nothing, not even requests/min."""
    live, tenant = hostile_live, "inflight"
    key = live.keys[tenant]
    before = _remaining_requests(live, key)
    held = []
    try:
        for _ in range(4):  # the tier's four generations
            stream = SocketStream(live.url, OPENAI_CHAT, key, chat_body(LONG, stream=True))
            held.append(stream)
            assert stream.next() == Comment("ok"), (stream.wire.status, stream.wire.body)
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda _: live.post_json(OPENAI_CHAT, chat_body(4), key), range(60)))
    finally:
        for stream in held:
            stream.close()
    assert [status for status, _ in answers] == [429] * 60, answers
    assert all(body["error"]["type"] == "streams" for _, body in answers), answers
    waited = [body for _, body in answers if "already wait" not in body["error"]["message"]]
    assert len(waited) < 60 // 2, answers  # most were refused at once
    scope = f"tenant:{live.tenant_ids[tenant]}"
    deadline = time.monotonic() + 30
    while Limiter(redis.Redis.from_url(live.redis_url)).leases_held(scope, "streams") and time.monotonic() < deadline:
        time.sleep(0.05)
    after = _remaining_requests(live, key)
    # Spent since `before`: the four held streams, the requests that waited for a slot, and this one.
    # The bucket only refills meanwhile; before, the 60 refusals spent 60 more.
    assert after >= before - (4 + len(waited) + 1), (before, after, len(waited))


def test_a_refusal_at_the_in_flight_bound_is_the_apis_429_counted_named_and_listed(hostile_live: LiveServer):
    """Past the in-flight bound a request is answered from its headers before the application
    (tenants.flood_gate): the same 429 as the middleware's, with the caller's X-Request-Id,
    counted in /metrics under its route and tenant, and kept for the console's requests tail."""
    from inference import refusals
    from tests.serving.test_metrics import scrape, value

    live, tenant = hostile_live, "inflight"
    key, tenant_id = live.keys[tenant], str(live.tenant_ids[tenant])
    labels = {"endpoint": "v1/chat/completions", "status": "429", "tenant": tenant_id}
    counted_before = value(scrape(live), "llm_http_responses_total", **labels)

    def post(i: int) -> tuple[int, dict, dict]:
        request = urllib.request.Request(live.url + OPENAI_CHAT, data=json.dumps(chat_body(4)).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                                                  "X-Request-Id": f"flood-{i}"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, dict(response.headers), json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), json.loads(err.read())

    held = []
    try:
        for _ in range(4):  # the tier's four generations
            held.append(SocketStream(live.url, OPENAI_CHAT, key, chat_body(LONG, stream=True)))
            assert held[-1].next() == Comment("ok")
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(post, range(12)))
    finally:
        for stream in held:
            stream.close()
    at_once = [(i, headers, body) for i, (status, headers, body) in enumerate(answers)
               if status == 429 and "already wait" in body["error"]["message"]]
    assert len(at_once) >= 12 - WAITERS, answers
    for i, headers, body in at_once:
        assert headers["X-Request-Id"] == f"flood-{i}" and headers["Retry-After"] == "1", headers
        assert headers["Content-Type"] == "application/json"
        assert (body["error"]["type"], body["error"]["code"]) == ("streams", "rate_limit_exceeded"), body
    assert value(scrape(live), "llm_http_responses_total", **labels) >= counted_before + len(at_once)
    deadline = time.monotonic() + 10  # each process moves its refusals to Redis every 0.5 s
    prefix = key.removeprefix("sk-").split("_")[0]
    while True:
        kept = [r for r in map(refusals.Refusal.from_json, redis.Redis.from_url(live.redis_url).lrange(refusals.REDIS_KEY, 0, -1))
                if r and r.key_prefix == prefix and r.status == 429]
        if len(kept) >= len(at_once) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(kept) >= len(at_once) and all(r.tenant_id == int(tenant_id) and r.endpoint == OPENAI_CHAT for r in kept)


def _head(sock: socket.socket) -> bytes:
    """A response's status line and headers, lowercased."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\r\n\r\n", 1)[0].lower()


def test_a_burst_read_in_one_pass_is_counted_at_the_gate_and_refused_there(hostile_live: LiveServer):
    """The flood gate counted a request in flight only once its application first ran, and
    daphne reads every request that has arrived in one pass of the reactor before any
    application runs: a burst's requests all passed a bound no one was counted against yet,
    and two in three refusals of a 400-request burst went through an application each while
    another tenant's first token waited among them. Now the gate counts what it lets through
    as it does: of a burst sent at once past a tenant's four generations, only its waiting
    share (SLOT_WAITERS_PER_TENANT) gets past the gate, and the gate answers the rest (its
    answer closes the connection; the application's keeps it alive)."""
    live, tenant = hostile_live, "inflight"
    key = live.keys[tenant]
    host, port = live.url.removeprefix("http://").split(":")
    payload = json.dumps(chat_body(4)).encode()
    wire = (f"POST {OPENAI_CHAT} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
    burst = 40
    held: list[SocketStream] = []
    sockets: list[socket.socket] = []
    try:
        for _ in range(4):  # the tier's four generations (and the key is known to the process)
            held.append(SocketStream(live.url, OPENAI_CHAT, key, chat_body(LONG, stream=True)))
            assert held[-1].next() == Comment("ok")
        sockets = [socket.create_connection((host, int(port)), timeout=60) for _ in range(burst)]
        for sock in sockets:  # connected first, so the requests arrive together
            sock.sendall(wire)
        with ThreadPoolExecutor(burst) as pool:
            futures = [pool.submit(_head, sock) for sock in sockets]
            # What got past the gate waits for a slot until the held streams end.
            deadline = time.monotonic() + 60
            while sum(f.done() for f in futures) < burst - WAITERS and time.monotonic() < deadline:
                time.sleep(0.05)
            for stream in held:
                stream.close()
            heads = [f.result(timeout=60) for f in futures]
    finally:
        for sock in sockets:
            sock.close()
        for stream in held:
            stream.close()
    refused = [h for h in heads if h.startswith(b"http/1.1 429")]
    at_gate = [h for h in refused if b"\r\nconnection: close" in h]
    assert len(refused) >= burst - WAITERS, heads
    assert len(at_gate) >= burst - WAITERS, [h.split(b"\r\n")[0] for h in heads]
    # Every count taken at the gate was let go: the whole bound (4 running, 2 waiting) is free again.
    with ThreadPoolExecutor(4 + WAITERS) as pool:
        statuses = list(pool.map(lambda _: live.post_json(OPENAI_CHAT, chat_body(1), key)[0], range(4 + WAITERS)))
    assert statuses == [200] * (4 + WAITERS), statuses


def _answer(sock: socket.socket) -> tuple[bytes, dict]:
    """A response's status line and headers (lowercased) and its JSON body."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := sock.recv(4096)):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    head = head.lower()
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.startswith(b"content-length:")))
    while len(body) < length and (chunk := sock.recv(4096)):
        body += chunk
    return head, json.loads(body)


def test_a_burst_without_a_usable_key_is_refused_at_the_gate(hostile_live: LiveServer):
    """No key, a token without a key's shape, and a wrong secret for a prefix the process has
    seen authenticate cannot be admitted whatever the database holds: the gate answers them
    from the headers with the API's 401 (its answer closes the connection), where each went
    through an application and the middleware's thread pool (400 of them took 0.30 s of the
    server, 0.13 s now)."""
    live, tenant = hostile_live, "inflight"
    key = live.keys[tenant]
    assert live.post_json(OPENAI_CHAT, chat_body(1), key)[0] == 200  # the process knows the key now
    host, port = live.url.removeprefix("http://").split(":")
    payload = json.dumps(chat_body(4)).encode()
    wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    kinds = {"missing_api_key": "", "invalid_api_key": "Authorization: Bearer not-a-key\r\n",
             "wrong secret": f"Authorization: Bearer {wrong}\r\n"}
    sent = [kind for kind in kinds for _ in range(10)]
    sockets = [socket.create_connection((host, int(port)), timeout=60) for _ in sent]
    try:
        for kind, sock in zip(sent, sockets):
            sock.sendall((f"POST {OPENAI_CHAT} HTTP/1.1\r\nHost: {host}:{port}\r\n{kinds[kind]}"
                          f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload)
        with ThreadPoolExecutor(len(sockets)) as pool:
            answers = list(pool.map(_answer, sockets))
    finally:
        for sock in sockets:
            sock.close()
    for kind, (head, body) in zip(sent, answers):
        assert head.startswith(b"http/1.1 401 unauthorized\r\n"), (kind, head)
        assert b"\r\nconnection: close" in head and b"\r\nwww-authenticate: bearer" in head, (kind, head)
        assert body["error"]["code"] == ("invalid_api_key" if kind == "wrong secret" else kind), (kind, body)
        assert body["error"]["type"] == "invalid_request_error", body
