"""What clients and proxies rely on around each call: an X-Request-Id on every response (the
caller's when sane), openai-processing-ms, the id in the server's log lines, and OpenAI's
`service_tier` as a lane preference never better than the key's tier."""
from __future__ import annotations

import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.live import LiveServer

TENANT = "ids"
QUESTION = [{"role": "user", "content": "Say hi."}]


def headers_of(live: LiveServer, path: str, key: str | None, request_id: str | None, body: bytes | None = None,
               method: str = "GET") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    request = urllib.request.Request(live.url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return response.status, {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as err:
        err.read()
        return err.code, {k.lower(): v for k, v in err.headers.items()}


CHAT = b'{"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}'


@pytest.mark.parametrize("path, method, body, authed, status", [
    ("/v1/chat/completions", "POST", CHAT, True, 200),  # a generation (Channels consumer)
    ("/v1/chat/completions", "POST", CHAT, False, 401),  # refused by the key middleware
    ("/v1/chat/completions", "POST", b"{", True, 400),  # refused by the consumer
    ("/v1/models", "GET", None, True, 200),  # a DRF view
    ("/v1/no-such-thing", "GET", None, True, 404),  # the JSON 404
    ("/healthz", "GET", None, False, 200),
], ids=["generation", "401", "400", "drf", "404", "probe"])
def test_every_response_carries_the_callers_request_id_and_the_processing_time(live: LiveServer, path, method, body,
                                                                              authed, status):
    key = live.keys[TENANT] if authed else None
    got, headers = headers_of(live, path, key, "trace-7f3a:42", body, method)
    assert got == status
    assert headers["x-request-id"] == "trace-7f3a:42"
    assert int(headers["openai-processing-ms"]) >= 0


def test_a_generation_without_a_callers_id_is_known_by_its_own(sdk: openai.OpenAI, served_model: str):
    raw = sdk.chat.completions.with_raw_response.create(model=served_model, messages=QUESTION, max_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id  # the key of its usage record


@pytest.mark.parametrize("given", [None, "", "has space", "x" * 129, "ünï"], ids=["none", "empty", "space", "long", "non-ascii"])
def test_a_missing_or_insane_request_id_is_replaced_by_ours(live: LiveServer, given):
    _, headers = headers_of(live, "/v1/models", live.keys[TENANT], given)
    assert headers["x-request-id"].startswith("req_") and len(headers["x-request-id"]) == 36


def test_the_server_logs_a_request_under_its_request_id(live: LiveServer):
    """The live server logs at WARNING: a request for a path that does not exist is one such line
    (Django's own, written on a worker thread of the request)."""
    rid = f"log-check-{time.monotonic_ns()}"
    status, _ = headers_of(live, "/v1/no-such-path", live.keys[TENANT], rid)
    assert status == 404
    deadline = time.monotonic() + 10
    while not any(f"[{rid}]" in line and "/v1/no-such-path" in line for line in live.log().splitlines()):
        assert time.monotonic() < deadline, "no log line of the request names its request id"
        time.sleep(0.1)


@pytest.mark.parametrize("service_tier, lane, echoed", [
    ("flex", "P2", "flex"), ("default", "P1", "default"), ("auto", "P1", "default"),
    ("priority", "P1", "default"),  # a P1 tier asking for priority runs at P1: capped, not refused
])
def test_service_tier_is_a_lane_preference_capped_at_the_keys_tier(sdk: openai.OpenAI, served_model: str, service_tier,
                                                                  lane, echoed):
    raw = sdk.chat.completions.with_raw_response.create(model=served_model, messages=QUESTION, max_tokens=2,
                                                             service_tier=service_tier)
    assert raw.headers["x-lane"] == lane
    assert raw.parse().service_tier == echoed


def test_a_streamed_chunk_names_its_service_tier_and_an_unknown_one_is_refused(sdk: openai.OpenAI, served_model: str):
    chunks = list(sdk.chat.completions.create(model=served_model, messages=QUESTION, max_tokens=2, stream=True,
                                                 service_tier="flex"))
    assert {c.service_tier for c in chunks} == {"flex"}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=served_model, messages=QUESTION, max_tokens=2, extra_body={"service_tier": "gold"})
    assert caught.value.body["param"] == "service_tier"
