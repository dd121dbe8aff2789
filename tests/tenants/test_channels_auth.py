"""The Channels middleware: the same keys and requests/min for SSE and WebSocket scopes.

Tests are sync functions driving the ASGI app with async_to_sync, as daphne would, so no
asyncio plugin is needed; the database is reached from other threads, hence transaction=True.
"""
import json

import pytest
from channels.generic.http import AsyncHttpConsumer
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator, WebsocketCommunicator

from tenants import actions
from tenants.middleware import ApiKeyAuthMiddleware

pytestmark = pytest.mark.django_db(transaction=True)


class WhoAmI(AsyncHttpConsumer):
    async def handle(self, body: bytes) -> None:
        payload = {"tenant": self.scope["tenant"].name, "remaining": self.scope["rate_limit"].bucket("requests").remaining}
        await self.send_response(200, json.dumps(payload).encode(), headers=[(b"content-type", b"application/json")])


class WhoAmISocket(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        await self.accept()
        await self.send_json({"tenant": self.scope["tenant"].name})


def auth(plaintext: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {plaintext}".encode())]


def test_sse_scope_gets_the_tenant_and_counts_the_request(make_tier, make_tenant):
    _, issued = make_tenant("acme", make_tier(requests_per_minute=2))
    async_to_sync(_sse_counts)(issued)


async def _sse_counts(issued):
    app = ApiKeyAuthMiddleware(WhoAmI.as_asgi())
    ok = await HttpCommunicator(app, "GET", "/v1/stream", headers=auth(issued.plaintext)).get_response()
    assert ok["status"] == 200
    assert json.loads(ok["body"]) == {"tenant": "acme", "remaining": 1}
    await HttpCommunicator(app, "GET", "/v1/stream", headers=auth(issued.plaintext)).get_response()
    refused = await HttpCommunicator(app, "GET", "/v1/stream", headers=auth(issued.plaintext)).get_response()
    assert refused["status"] == 429
    headers = dict(refused["headers"])
    assert 28 <= int(headers[b"retry-after"]) <= 30
    assert headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert json.loads(refused["body"])["error"]["code"] == "rate_limit_exceeded"


def test_sse_scope_refuses_a_revoked_key(make_tier, make_tenant):
    _, issued = make_tenant("acme")
    actions.revoke_key(issued.api_key)
    async_to_sync(_sse_revoked)(issued)


async def _sse_revoked(issued):
    refused = await HttpCommunicator(
        ApiKeyAuthMiddleware(WhoAmI.as_asgi()), "GET", "/v1/stream", headers=auth(issued.plaintext)
    ).get_response()
    assert refused["status"] == 401
    assert json.loads(refused["body"])["error"]["code"] == "invalid_api_key"


def test_websocket_scope_gets_the_tenant_or_a_closing_error(make_tenant):
    _, issued = make_tenant("acme")
    async_to_sync(_websocket)(issued)


async def _websocket(issued):
    app = ApiKeyAuthMiddleware(WhoAmISocket.as_asgi())
    good = WebsocketCommunicator(app, "/v1/ws", headers=auth(issued.plaintext))
    assert (await good.connect())[0]
    assert await good.receive_json_from() == {"tenant": "acme"}
    await good.disconnect()

    bad = WebsocketCommunicator(app, "/v1/ws", headers=auth(issued.plaintext[:-1] + "!"))
    assert (await bad.connect())[0]
    error = await bad.receive_json_from()
    assert error["error"]["code"] == "invalid_api_key"
    assert (await bad.receive_output())["code"] == 4401

