"""A refusal's status line names its status: Twisted has no reason phrase for 429, and the
API's rate-limit refusals went out as "HTTP/1.1 429 Unknown Status" to proxies' logs and to
clients that show the phrase."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

from tests.live import LiveServer


def _status_line(live: LiveServer, key: str) -> tuple[int, str, dict]:
    url = urlsplit(live.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 1})
        conn.request("POST", "/v1/chat/completions", body, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.reason, json.loads(response.read())
    finally:
        conn.close()


def test_a_rate_limited_request_is_a_429_too_many_requests(hostile_live: LiveServer):
    key = hostile_live.keys["rpm-1"]
    first = _status_line(hostile_live, key)
    assert first[:2] == (200, "OK"), first
    status, reason, body = _status_line(hostile_live, key)
    assert (status, reason) == (429, "Too Many Requests"), (status, reason, body)
    assert body["error"]["code"] == "rate_limit_exceeded", body
