"""A replica drained with SIGTERM (inference.drain) finishes the streams it is serving, takes
no new generation, leaves the balancer's rotation and the fleet, then exits.

Before, daphne stopped at once on SIGTERM and every stream was cut mid-reply. This test owns
its server (it ends it). The bounds on waiting are hang guards, not speed claims.
"""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest
import redis

from inference import fleet
from tests.isolation_env import BIG
from tests.live import http_status, start_live_server
from tests.serving.rawsse import OPENAI_CHAT, Event, SocketStream, chat_body

TOKENS = 96


@pytest.fixture
def replica(tmp_path):
    server, stop = start_live_server(tmp_path, {"drain": {"lane": 1, **BIG}}, {"drain": "drain"},
                                     {"DRAIN_TIMEOUT_S": "120"})
    try:
        yield server
    finally:
        stop()


def _post_chat(server) -> tuple[int, dict, dict]:
    body = json.dumps({"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}).encode()
    request = urllib.request.Request(server.url + OPENAI_CHAT, data=body, method="POST", headers={
        "Authorization": f"Bearer {server.keys['drain']}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def test_sigterm_drains_the_running_stream_refuses_new_work_and_exits(replica):
    server = replica
    deadline = time.monotonic() + 10
    while not (reports := fleet.replicas(redis.Redis.from_url(server.redis_url))):
        assert time.monotonic() < deadline, "the server never reported to the fleet"
        time.sleep(0.1)
    [replica] = reports
    stream = SocketStream(server.url, OPENAI_CHAT, server.keys["drain"], chat_body(TOKENS, stream=True))
    try:
        first = stream.next_event()
        assert isinstance(first, Event), first
        os.kill(replica["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 10
        while http_status(server.url + "/readyz") != 503:
            assert time.monotonic() < deadline, "/readyz stayed green after SIGTERM"
            time.sleep(0.05)
        status, headers, body = _post_chat(server)
        assert status == 503 and body["error"]["code"] == "service_unavailable", (status, body)
        assert int(headers["Retry-After"]) >= 1

        events = [first]
        while (event := stream.next_event()) is not None:
            events.append(event)
    finally:
        stream.close()
    assert events[-1].data == "[DONE]", events[-3:]
    finishes = [c["finish_reason"] for e in events[:-1] for c in e.json().get("choices", []) if c.get("finish_reason")]
    assert finishes == ["length"], finishes  # it ran to max_tokens, not cut

    deadline = time.monotonic() + 30
    while http_status(server.url + "/healthz") != 0:  # 0: nothing listens any more
        assert time.monotonic() < deadline, "the drained server did not exit"
        time.sleep(0.1)
    assert fleet.replicas(redis.Redis.from_url(server.redis_url)) == []  # it left the fleet on its way out
