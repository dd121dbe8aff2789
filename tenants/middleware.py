"""Channels: the same key authentication and requests/min check for SSE and WebSocket scopes.

On success the scope gains `tenant`, `api_key` and `rate_limit` (the admitting decision).
A WebSocket handshake without an Authorization header passes with `tenant` None: its
consumer authenticates the first message.
A refused HTTP request gets the OpenAI-shaped error response. A refused WebSocket is
accepted, sent the error as one JSON text frame, and closed with code 4000 + HTTP status
(4401, 4429): a plain handshake refusal would reach the client as a bare 403.
"""
import json
import threading
from collections import OrderedDict
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


# Keys seen to authenticate in this process: prefix -> (digest, its tenant's admission caller).
# A tenant's key and generation admissions then share one part of the pool (as two callers, one
# tenant's burst of 400 held all eight threads), and a wrong secret for a known prefix is refused
# on the event loop: a client that forges another tenant's public prefix never queues in that
# tenant's part. Bounded, least recently seen dropped first; a key's digest never changes, and
# revocation is still read from the database on every request.
_KEYS_KEPT = 10_000
_known_keys: OrderedDict[str, tuple[str, str]] = OrderedDict()
_known_lock = threading.Lock()  # written on the pool's threads, read on the event loop


def _authenticate_and_admit(header: str | None) -> tuple[ApiKey, Decision]:
    api_key = authenticate_bearer(header)
    with _known_lock:
        _known_keys[api_key.prefix] = (api_key.digest, admission.tenant_caller(api_key.tenant_id))
        _known_keys.move_to_end(api_key.prefix)
        while len(_known_keys) > _KEYS_KEPT:
            _known_keys.popitem(last=False)
    decision = quota.admit_request(api_key.tenant)
    note_key_use(api_key)
    return api_key, decision


async def authenticate_and_admit(header: str | None) -> tuple[ApiKey, Decision]:
    """Key and requests/min, on the admission pool as the key's tenant when the key is known,
    else as its public prefix; every refusal or failure is an ApiError."""
    parsed = keys.parse(bearer_token(header) or "")
    known = _known_keys.get(parsed.prefix) if parsed else None
    if known is not None and not keys.matches(parsed.plaintext, known[0]):
        raise errors.invalid_api_key()
    caller = known[1] if known else (f"key:{parsed.prefix}" if parsed else "key:?")
    return await admission.run(_authenticate_and_admit, header, caller=caller, what="key admission")


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
