"""Channels: the same key authentication and requests/min check for SSE and WebSocket scopes.

On success the scope gains `tenant`, `api_key` and `rate_limit` (the admitting decision).
A WebSocket handshake without an Authorization header passes with `tenant` None: its
consumer authenticates the first message.
A refused HTTP request gets the OpenAI-shaped error response. A refused WebSocket is
accepted, sent the error as one JSON text frame, and closed with code 4000 + HTTP status
(4401, 4429): a plain handshake refusal would reach the client as a bare 403.
"""
import json
from typing import Any

from tenants import admission, errors, keys, quota
from tenants.authentication import authenticate_bearer, bearer_token, note_key_use
from tenants.limits import Decision
from tenants.models import ApiKey

Scope = dict[str, Any]


def scope_header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _authenticate_and_admit(header: str | None) -> tuple[ApiKey, Decision]:
    api_key = authenticate_bearer(header)
    decision = quota.admit_request(api_key.tenant)
    note_key_use(api_key)
    return api_key, decision


def caller_of(header: str | None) -> str:
    """Who an Authorization header claims to be, before anything is checked: its key's
    public prefix, which is all the admission pool needs to keep callers apart."""
    parsed = keys.parse(bearer_token(header) or "")
    return f"key:{parsed.prefix}" if parsed else "key:?"


async def authenticate_and_admit(header: str | None) -> tuple[ApiKey, Decision]:
    """Key and requests/min, on the admission pool; every refusal or failure is an ApiError."""
    return await admission.run(_authenticate_and_admit, header, caller=caller_of(header), what="key admission")


class ApiKeyAuthMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        header = scope_header(scope, b"authorization")
        if header is None and scope["type"] == "websocket":
            # Browsers cannot set headers on a WebSocket: the consumer takes the key from
            # the first message instead (scope["tenant"] is None until it does).
            return await self.app({**scope, "tenant": None, "api_key": None, "rate_limit": None}, receive, send)
        try:
            api_key, decision = await authenticate_and_admit(header)
        except errors.ApiError as error:
            return await refuse(scope, receive, send, error)
        scope = {**scope, "tenant": api_key.tenant, "api_key": api_key, "rate_limit": decision}
        return await self.app(scope, receive, send)


async def refuse(scope: Scope, receive: Any, send: Any, error: errors.ApiError) -> None:
    body = json.dumps(error.body()).encode()
    if scope["type"] == "http":
        headers = [(b"content-type", b"application/json")]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": body.decode()})
    await send({"type": "websocket.close", "code": 4000 + error.status})
