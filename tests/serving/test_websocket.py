"""WebSocket /ws/v1/chat over a real socket, against the live server and the real model.

Tenants: "ws" (near-realtime, generous limits) and "ws-tight" (3 requests/min, 2 concurrent
streams). The handshake with a key counts one request, as every start does.
"""
from __future__ import annotations

import json
import urllib.request

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.live import LiveServer
from tests.wsclient import HANG_GUARD_S, bearer, recv_json, run, ws_url

MAX_REQUEST_BYTES = 256 * 1024  # the live server's (tests.live.DEFAULT_ENV)
GREEDY_PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]
LONG_PROMPT = [{"role": "user", "content": "Count from one to one thousand in words."}]


async def close_code(ws: ClientConnection) -> tuple[list[dict], int]:
    """Every message until the server closes the socket, and the close code it sent."""
    messages = []
    try:
        while True:
            messages.append(await recv_json(ws))
    except ConnectionClosed as closed:
        assert closed.rcvd is not None, "the connection dropped without a close frame"
        return messages, closed.rcvd.code


async def until_done(ws: ClientConnection, gen_id: str) -> tuple[list[dict], dict]:
    """The token messages of `gen_id` and its closing done (or error) message."""
    tokens = []
    while True:
        message = await recv_json(ws)
        if message.get("id") != gen_id:
            continue
        if message["type"] == "token":
            tokens.append(message)
        else:
            return tokens, message


def chat_reference(live: LiveServer, key: str, messages: list[dict], max_tokens: int) -> str:
    """The greedy completion of `messages` from the plain JSON endpoint."""
    body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    request = urllib.request.Request(live.url + "/v1/chat/completions", data=body, method="POST",
                                     headers={**bearer(key), "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def test_two_interleaved_generations_one_cancelled_the_other_intact(live: LiveServer):
    key = live.keys["ws"]
    max_tokens = 32
    reference = chat_reference(live, key, GREEDY_PROMPT, max_tokens)

    async def scenario():
        async with connect(ws_url(live), additional_headers=bearer(key)) as ws:
            await ws.send(json.dumps({"type": "start", "id": "keep", "messages": GREEDY_PROMPT,
                                      "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}))
            await ws.send(json.dumps({"type": "start", "id": "drop", "messages": LONG_PROMPT,
                                      "max_tokens": 400, "ignore_eos": True}))
            arrivals, done = [], {}
            while len(done) < 2:
                message = await recv_json(ws)
                assert message["type"] in ("token", "done"), message
                if message["type"] == "done":
                    done[message["id"]] = message
                    continue
                arrivals.append(message)
                if message["id"] == "drop" and sum(m["id"] == "drop" for m in arrivals) == 2:
                    await ws.send(json.dumps({"type": "cancel", "id": "drop"}))
            return arrivals, done

    arrivals, done = run(scenario())
    kept = [m for m in arrivals if m["id"] == "keep"]
    dropped = [m for m in arrivals if m["id"] == "drop"]
    assert done["drop"]["finish_reasons"] == ["cancelled"]
    assert 2 <= done["drop"]["usage"]["completion_tokens"] < 400
    assert [m["seq"] for m in dropped] == list(range(len(dropped)))
    # Both streams were live at once: the cancelled one spoke before the kept one finished.
    ids = [m["id"] for m in arrivals]
    assert ids.index("drop") < len(ids) - 1 - ids[::-1].index("keep")
    assert done["keep"]["finish_reasons"] == ["length"]
    assert done["keep"]["usage"]["completion_tokens"] == max_tokens
    assert [m["seq"] for m in kept] == list(range(len(kept)))
    assert all(m["index"] == 0 for m in kept)
    assert "".join(m["delta"] for m in kept) == reference


def test_authenticates_by_header(live: LiveServer):
    async def scenario():
        async with connect(ws_url(live), additional_headers=bearer(live.keys["ws"])) as ws:
            await ws.send(json.dumps({"type": "start", "id": "a", "messages": GREEDY_PROMPT, "max_tokens": 4}))
            return await until_done(ws, "a")

    tokens, done = run(scenario())
    assert done["type"] == "done" and done["finish_reasons"] == ["length"]
    assert len(tokens) >= 1 and done["usage"]["completion_tokens"] == 4


def test_authenticates_by_first_message(live: LiveServer):
    async def scenario():
        async with connect(ws_url(live)) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": live.keys["ws"]}))
            authenticated = await recv_json(ws)
            await ws.send(json.dumps({"type": "start", "id": "a", "messages": GREEDY_PROMPT, "max_tokens": 4}))
            tokens, done = await until_done(ws, "a")
            return authenticated, tokens, done

    authenticated, tokens, done = run(scenario())
    assert authenticated == {"type": "authenticated", "tenant": "ws"}
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 4
    assert "".join(t["delta"] for t in tokens)


def test_no_auth_within_the_timeout_closes_4401(live: LiveServer):
    async def scenario():
        async with connect(ws_url(live)) as ws:
            return await close_code(ws)  # the server waits WS_AUTH_TIMEOUT_S (2 s), then closes

    messages, code = run(scenario())
    assert code == 4401
    assert messages[-1]["error"]["code"] == "missing_api_key"


def test_start_before_auth_closes_4401(live: LiveServer):
    async def scenario():
        async with connect(ws_url(live)) as ws:
            await ws.send(json.dumps({"type": "start", "id": "a", "messages": GREEDY_PROMPT}))
            return await close_code(ws)

    _, code = run(scenario())
    assert code == 4401


@pytest.mark.parametrize("how", ["header", "first message"])
def test_bad_key_closes_4401(live: LiveServer, how: str):
    wrong = "sk-000000000000_not-a-real-secret"

    async def scenario():
        if how == "header":
            async with connect(ws_url(live), additional_headers=bearer(wrong)) as ws:
                return await close_code(ws)
        async with connect(ws_url(live)) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": wrong}))
            return await close_code(ws)

    messages, code = run(scenario())
    assert code == 4401
    assert messages[-1]["error"]["code"] == "invalid_api_key"


# Close codes are 4000 + the HTTP status of the error frame sent before the close.
@pytest.mark.parametrize("frame, code, error_code", [
    ("this is not json", 1008, "protocol_violation"),
    ('["an", "array"]', 1008, "protocol_violation"),
    (json.dumps({"type": "subscribe", "id": "a"}), 1008, "protocol_violation"),
    (json.dumps({"id": "a", "messages": GREEDY_PROMPT}), 1008, "protocol_violation"),
    (json.dumps({"type": "start", "messages": GREEDY_PROMPT}), 1008, "protocol_violation"),
    (json.dumps({"type": "auth", "api_key": "sk-whatever"}), 1008, "protocol_violation"),  # already authenticated
    (b'{"type": "start"}', 1008, "protocol_violation"),  # a binary frame
], ids=["not-json", "not-an-object", "unknown-type", "no-type", "no-id", "auth-twice", "binary"])
def test_protocol_violations_close_the_socket(live: LiveServer, frame: str | bytes, code: int, error_code: str):
    async def scenario():
        async with connect(ws_url(live), additional_headers=bearer(live.keys["ws"]), max_size=None) as ws:
            await ws.send(frame)
            return await close_code(ws)

    messages, closed_with = run(scenario())
    assert closed_with == code
    assert messages[-1]["type"] == "error" and messages[-1]["error"]["code"] == error_code


@pytest.mark.parametrize("size", [MAX_REQUEST_BYTES, MAX_REQUEST_BYTES + 1], ids=["at-the-limit", "over-the-limit"])
def test_message_size_limit(live: LiveServer, size: int):
    start = {"type": "start", "id": "big", "messages": GREEDY_PROMPT, "max_tokens": 1, "user": ""}
    start["user"] = "u" * (size - len(json.dumps(start)))  # padding that the prompt does not see
    frame = json.dumps(start)
    assert len(frame.encode()) == size

    async def scenario():
        async with connect(ws_url(live), additional_headers=bearer(live.keys["ws"]), max_size=None) as ws:
            await ws.send(frame)
            if size <= MAX_REQUEST_BYTES:
                return await until_done(ws, "big")
            return await close_code(ws)

    if size <= MAX_REQUEST_BYTES:
        _, done = run(scenario())
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == 1
    else:
        messages, code = run(scenario())
        assert code == 1009
        assert messages[-1]["error"]["code"] == "message_too_large"


def test_bad_start_is_an_error_for_that_id_and_the_socket_stays_usable(live: LiveServer):
    async def scenario():
        async with connect(ws_url(live), additional_headers=bearer(live.keys["ws"])) as ws:
            await ws.send(json.dumps({"type": "start", "id": "empty", "messages": []}))
            empty = await recv_json(ws)
            await ws.send(json.dumps({"type": "start", "id": "too-hot", "messages": GREEDY_PROMPT, "temperature": 9}))
            hot = await recv_json(ws)
            await ws.send(json.dumps({"type": "start", "id": "two", "messages": GREEDY_PROMPT, "n": 2}))
            two = await recv_json(ws)
            await ws.send(json.dumps({"type": "start", "id": "good", "messages": GREEDY_PROMPT, "max_tokens": 3}))
            _, done = await until_done(ws, "good")
            return empty, hot, two, done

    empty, hot, two, done = run(scenario())
    assert empty["type"] == "error" and empty["id"] == "empty"
    assert empty["error"]["param"] == "messages" and empty["error"]["code"] == "empty_array"
    assert hot["type"] == "error" and hot["id"] == "too-hot" and hot["error"]["param"] == "temperature"
    assert two["type"] == "error" and two["id"] == "two" and two["error"]["param"] == "n"
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 3


def test_duplicate_running_id_is_refused_for_that_id(live: LiveServer):
    async def scenario():
        async with connect(ws_url(live), additional_headers=bearer(live.keys["ws"])) as ws:
            start = {"type": "start", "id": "same", "messages": LONG_PROMPT, "max_tokens": 200, "ignore_eos": True}
            await ws.send(json.dumps(start))
            while (await recv_json(ws))["type"] != "token":
                pass
            await ws.send(json.dumps(start))
            while (refused := await recv_json(ws))["type"] != "error":
                pass
            await ws.send(json.dumps({"type": "cancel", "id": "same"}))
            _, done = await until_done(ws, "same")
            return refused, done

    refused, done = run(scenario())
    assert refused["id"] == "same" and refused["error"]["code"] == "duplicate_id"
    assert done["type"] == "done" and done["finish_reasons"] == ["cancelled"]


def test_rate_limit_refuses_a_start_then_the_connection(live: LiveServer):
    key = live.keys["ws-tight"]  # 3 requests/min; the handshake is one of them

    async def starts():
        async with connect(ws_url(live), additional_headers=bearer(key)) as ws:
            # Back to back, so all four fall in the same minute however slow the box is.
            for gen_id in ("a", "b", "c"):
                await ws.send(json.dumps({"type": "start", "id": gen_id, "messages": GREEDY_PROMPT, "max_tokens": 2}))
            ends = {}
            while len(ends) < 4:
                message = await recv_json(ws)
                if message["type"] in ("done", "error"):
                    ends[message["id"]] = message
                if message["id"] == "c":
                    # The refusal ended that generation only: the socket still answers (with another refusal).
                    await ws.send(json.dumps({"type": "start", "id": "d", "messages": GREEDY_PROMPT, "max_tokens": 2}))
            return ends

    async def reconnect(by_header: bool):
        if by_header:
            async with connect(ws_url(live), additional_headers=bearer(key)) as ws:
                return await close_code(ws)
        async with connect(ws_url(live)) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            return await close_code(ws)

    ends = run(starts())
    assert ends["a"]["type"] == "done" and ends["b"]["type"] == "done"
    for refused in (ends["c"], ends["d"]):
        assert refused["type"] == "error" and refused["error"]["code"] == "rate_limit_exceeded"
        assert refused["error"]["type"] == "requests" and refused["retry_after"] >= 1
    for by_header in (True, False):
        messages, code = run(reconnect(by_header))
        assert code == 4429
        assert messages[-1]["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize("how", ["close", "drop"])
def test_closing_mid_generation_frees_the_engine(live: LiveServer, how: str):
    async def scenario():
        ws = await connect(ws_url(live), additional_headers=bearer(live.keys["ws"]))
        for gen_id in ("x", "y"):
            await ws.send(json.dumps({"type": "start", "id": gen_id, "messages": LONG_PROMPT,
                                      "max_tokens": 400, "ignore_eos": True}))
        while (await recv_json(ws))["type"] != "token":
            pass
        running = live.stats()
        if how == "close":
            await ws.close()
        else:  # the client vanishes without a close frame
            ws.transport.abort()
        return running

    running = run(scenario())
    assert running["requests_running"] + sum(running["requests_waiting"].values()) >= 1
    stats = live.wait_idle(timeout=60)
    assert stats["kv_blocks_used"] == 0
    assert stats["requests_running"] == 0 and not any(stats["requests_waiting"].values())
