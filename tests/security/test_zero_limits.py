"""A limit an operator set to 0 refuses clearly (issue 24 item 10: "a limit set to 0 gives a
500"): 403 `limit_is_zero` in the OpenAI shape, naming the limit, on the REST path and on the
WebSocket, instead of a server error (or a 429 whose Retry-After would never come true)."""
from __future__ import annotations

import pytest

from tests.live import LiveServer
from tests.wsclient import bearer, connect, run, until_closed, ws_url


def _chat(live: LiveServer, tenant: str) -> tuple[int, dict]:
    return live.post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2},
                          live.keys[tenant], timeout=60)


@pytest.mark.parametrize("tenant, field", [("zero-rpm", "requests_per_minute"), ("zero-tpm", "tokens_per_minute"),
                                           ("zero-streams", "concurrent_streams")])
def test_a_zero_limit_is_a_403_naming_it(hostile_live: LiveServer, tenant: str, field: str):
    status, body = _chat(hostile_live, tenant)
    assert status == 403, body
    assert body["error"]["code"] == "limit_is_zero" and field in body["error"]["message"]


def test_a_zero_request_limit_closes_the_websocket_with_4403(hostile_live: LiveServer):
    async def scenario():
        async with connect(ws_url(hostile_live), additional_headers=bearer(hostile_live.keys["zero-rpm"])) as ws:
            return await until_closed(ws, 10)

    messages, code = run(scenario())
    assert code == 4403
    assert messages[-1]["error"]["code"] == "limit_is_zero"
