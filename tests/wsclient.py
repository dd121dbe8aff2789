"""A few steps of the WebSocket protocol (/ws/v1/chat), for the security and reliability tests."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from websockets.asyncio.client import ClientConnection, connect  # noqa: F401  (re-exported)
from websockets.exceptions import ConnectionClosed

from tests.live import LiveServer

HANG_GUARD_S = 120  # a broken server fails the test instead of hanging it; never a timing assertion


def run(coro) -> Any:
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


def ws_url(live: LiveServer) -> str:
    return live.ws_url + "/ws/v1/chat"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def start(gen_id: str, max_tokens: int, content: str = "Count from one to one thousand in words.", **extra) -> str:
    return json.dumps({"type": "start", "id": gen_id, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, **extra})


async def recv_json(ws: ClientConnection) -> dict:
    return json.loads(await ws.recv())


async def first_token(ws: ClientConnection, gen_id: str) -> None:
    while True:
        message = await recv_json(ws)
        if message.get("id") == gen_id:
            assert message["type"] == "token", message
            return


async def until_end(ws: ClientConnection, gen_id: str) -> dict:
    """The `done` or `error` message that ends `gen_id` (messages of other ids are skipped)."""
    while True:
        message = await recv_json(ws)
        if message.get("id") == gen_id and message["type"] in ("done", "error"):
            return message


async def until_closed(ws: ClientConnection, within_s: float) -> tuple[list[dict], int]:
    """Every message until the server closes the socket, and its close code; fails if the
    socket is still open after `within_s` (the bound a test promises, not a speed claim)."""
    messages: list[dict] = []

    async def read() -> int:
        try:
            while True:
                messages.append(await recv_json(ws))
        except ConnectionClosed as closed:
            assert closed.rcvd is not None, "the connection dropped without a close frame"
            return closed.rcvd.code

    try:
        return messages, await asyncio.wait_for(read(), within_s)
    except TimeoutError:
        raise AssertionError(f"the socket was still open {within_s} s later; it sent {messages[-3:]}") from None
