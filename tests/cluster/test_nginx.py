"""deploy/nginx.conf in front of a live replica, with real nginx: what production relies on.

The replica is the live server tests/security/ and tests/reliability/ share (`hostile_live`,
its tenant "proxied"): a server of its own cost this module ~20 s of start-up on 2 cores.

Streams are not buffered (the first token reaches the client while the replica still
generates), WebSockets upgrade, the client's address arrives as X-Forwarded-For, and a
replica that refuses connections is skipped: the upstream list holds the live replica and a
port where nothing listens, so about half of the routing keys hash to the dead one first.
"""
from __future__ import annotations

import os
import time

import pytest
import requests

from tests.conftest import free_port
from tests.live import LiveServer
from tests.nginx_front import MISSING, NGINX, start_nginx
from tests.serving.rawsse import OPENAI_CHAT, Event, SocketStream, chat_body
from tests.wsclient import bearer, connect, run, start, until_end

TIMEOUT_S = 120  # hang guards, never timing assertions


class Proxy:
    def __init__(self, url: str, server: LiveServer) -> None:
        self.url, self.server = url, server


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory, hostile_live: LiveServer):
    if not os.path.exists(NGINX):
        pytest.fail("tests/cluster " + MISSING)
    port, dead = free_port(), free_port()
    stop = start_nginx(tmp_path_factory.mktemp("nginx") / "run", port,
                       [hostile_live.url.removeprefix("http://"), f"127.0.0.1:{dead}"])
    try:
        yield Proxy(f"http://127.0.0.1:{port}", hostile_live)
    finally:
        stop()


def test_a_stream_through_nginx_arrives_token_by_token(proxy: Proxy):
    stream = SocketStream(proxy.url, OPENAI_CHAT, proxy.server.keys["proxied"], chat_body(64, stream=True))
    try:
        first = stream.next_event()
        assert isinstance(first, Event)
        # The replica is still generating: nginx passed the first events on as they came.
        assert not stream.wire.ended
        assert proxy.server.stats()["requests_running"] == 1
        events = [first]
        while (event := stream.next_event()) is not None:
            events.append(event)
    finally:
        stream.close()
    assert events[-1].data == "[DONE]"
    assert sum(1 for e in events[:-1] if e.json()["choices"] and e.json()["choices"][0]["delta"].get("content")) > 8


def test_a_websocket_upgrades_through_nginx(proxy: Proxy):
    async def scenario():
        url = proxy.url.replace("http://", "ws://") + "/ws/v1/chat"
        async with connect(url, additional_headers=bearer(proxy.server.keys["proxied"])) as ws:
            await ws.send(start("via-nginx", 8))
            return await until_end(ws, "via-nginx")

    done = run(scenario())
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 8, done


def test_every_routing_key_is_served_although_one_replica_refuses_connections(proxy: Proxy):
    headers = {"Authorization": f"Bearer {proxy.server.keys['proxied']}"}
    statuses = [requests.get(proxy.url + "/v1/models", headers={**headers, "X-Prompt-Cache-Key": f"key-{i}"},
                             timeout=TIMEOUT_S).status_code for i in range(20)]
    assert statuses == [200] * 20
    body = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    chats = [requests.post(proxy.url + OPENAI_CHAT, json=body, headers={**headers, "X-Prompt-Cache-Key": f"chat-{i}"},
                           timeout=TIMEOUT_S).status_code for i in range(6)]
    assert chats == [200] * 6


def test_the_replica_sees_a_proxied_client_as_remote(proxy: Proxy):
    # nginx adds X-Forwarded-For, so loopback's free pass to /metrics does not apply through it.
    assert requests.get(proxy.server.url + "/metrics", timeout=TIMEOUT_S).status_code == 200
    assert requests.get(proxy.url + "/metrics", timeout=TIMEOUT_S).status_code == 401


def _first_token_s(url: str, key: str) -> float:
    started = time.monotonic()
    stream = SocketStream(url, OPENAI_CHAT, key, chat_body(4, content="Say hi.", stream=True))
    try:
        while (event := stream.next_event()) is not None:
            choices = event.json()["choices"] if event.data != "[DONE]" else []
            if choices and choices[0]["delta"].get("content"):
                return time.monotonic() - started
    finally:
        stream.close()
    raise AssertionError("the stream ended without a token")


def test_first_token_through_nginx_beside_straight_to_the_replica(proxy: Proxy, capsys):
    """Every stream through nginx brings its first token; nginx's cost to it is printed, a
    benchmark and not a timed assertion (docs/benchmarks.md keeps the numbers). Alternated,
    so both paths see the same box."""
    key = proxy.server.keys["proxied"]
    _first_token_s(proxy.server.url, key)  # the prompt in the prefix cache for both
    through, direct = [], []
    for _ in range(10):
        through.append(_first_token_s(proxy.url, key))
        direct.append(_first_token_s(proxy.server.url, key))
    through_ms, direct_ms = sorted(through)[5] * 1000, sorted(direct)[5] * 1000
    with capsys.disabled():
        print(f"\n  TTFT median of 10: through nginx {through_ms:.1f} ms, straight to the replica {direct_ms:.1f} ms, "
              f"nginx adds {through_ms - direct_ms:+.1f} ms")

