"""Channels: the same key authentication and requests/min check for SSE and WebSocket scopes.

On success the scope gains `tenant`, `api_key` and `rate_limit` (the admitting decision).
A WebSocket handshake without an Authorization header passes with `tenant` None: its
consumer authenticates the first message.
A refused HTTP request gets the OpenAI-shaped error response. A refused WebSocket is
accepted, sent the error as one JSON text frame, and closed with code 4000 + HTTP status
(4401, 4429): a plain handshake refusal would reach the client as a bare 403.
An HTTP request of a tenant that already has as many generation requests in flight in this
process as could run or wait for a slot is refused with that 429 first, on the event loop.
"""
import contextvars
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from inference import http_metrics, refusals
from tenants import admission, errors, keys, quota
from tenants.authentication import authenticate_bearer, bearer_token, note_key_use
from tenants.limits import Decision
from tenants.models import ApiKey, Scope

AsgiScope = dict[str, Any]


def scope_header(scope: AsgiScope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


# Keys seen to authenticate in this process: prefix -> what the event loop may decide without
# a thread. A tenant's key and generation admissions then share one part of the pool (as two
# callers, one tenant's burst of 400 held all eight threads), and a wrong secret for a known
# prefix is refused on the event loop: a client that forges another tenant's public prefix never
# queues in that tenant's part. Bounded, least recently seen dropped first; a key's digest never
# changes, revocation is still read from the database on every admitted request, and the tier's
# figures are those of the key's last authentication.
_KEYS_KEPT = 10_000


@dataclass(frozen=True)
class _Known:
    digest: str
    caller: str  # its tenant's admission caller
    concurrent_streams: int  # the tier's limit, for the in-flight bound
    tenant_id: str  # the tenant's engine id, which /metrics labels its refusals with


_known_keys: OrderedDict[str, _Known] = OrderedDict()
_known_lock = threading.Lock()  # written on the pool's threads, read on the event loop

# Generation requests of each tenant in flight in this process, from the middleware to the
# response's end. Past its tier's concurrent generations plus SLOT_WAITERS_PER_TENANT, a request
# could only be refused by the slot gate (each running one holds a slot, each other one waits):
# it is refused here, on the event loop, before a thread, a database row or a Redis call. A burst
# of 400 requests from one tenant otherwise paid a key lookup and a requests/min write each
# (~2 ms of the GIL apiece, py-spy) while another tenant's first token waited among them.
_in_flight: dict[str, int] = {}


def remember(api_key: ApiKey) -> None:
    """`api_key` authenticated (here or in a DRF view): known to this process from now on."""
    known = _Known(api_key.digest, admission.tenant_caller(api_key.tenant_id), api_key.tenant.tier.concurrent_streams,
                   api_key.tenant.engine_id)
    with _known_lock:
        _known_keys[api_key.prefix] = known
        _known_keys.move_to_end(api_key.prefix)
        while len(_known_keys) > _KEYS_KEPT:
            _known_keys.popitem(last=False)


def _authenticate_and_admit(header: str | None) -> tuple[ApiKey, Decision]:
    api_key = authenticate_bearer(header)
    remember(api_key)
    # Every route behind this middleware generates (chat, completions, the WebSocket).
    if not api_key.allows(Scope.INFERENCE):
        raise errors.missing_scope(Scope.INFERENCE)
    decision = quota.admit_request(api_key.tenant, api_key)
    note_key_use(api_key)
    return api_key, decision


def _known(header: str | None) -> tuple[keys.ParsedKey | None, _Known | None]:
    parsed = keys.parse(bearer_token(header) or "")
    return parsed, (_known_keys.get(parsed.prefix) if parsed else None)


def known_caller(header: str) -> str | None:
    """The caller of the tenant whose key the Authorization header carries, where the key
    authenticated in this process before and the secret matches; else None (config.intake then
    queues it by its peer: a flood of made-up keys must not get a queue per key)."""
    known = _verified(header)
    return known.caller if known is not None else None


async def authenticate_and_admit(header: str | None) -> tuple[ApiKey, Decision]:
    """Key and requests/min, on the admission pool as the key's tenant when the key is known,
    else as its public prefix; every refusal or failure is an ApiError."""
    parsed, known = _known(header)
    if known is not None and not keys.matches(parsed.plaintext, known.digest):
        raise errors.invalid_api_key()
    caller = known.caller if known else (f"key:{parsed.prefix}" if parsed else "key:?")
    return await admission.run(_authenticate_and_admit, header, caller=caller, what="key admission")


def _verified(header: str | None) -> _Known | None:
    """The known key the header carries, if its secret is right."""
    parsed, known = _known(header)
    return known if known is not None and keys.matches(parsed.plaintext, known.digest) else None


def _unusable(header: str | None, parsed: keys.ParsedKey | None, known: _Known | None) -> errors.ApiError | None:
    """The 401 authentication would give whatever the database holds: no key, a token without a
    key's shape, or a wrong secret for a prefix seen to authenticate (a key's digest never
    changes). Answered from the headers, a burst of them costs no thread and no application:
    400 requests with a malformed key were all answered in 0.13 s (median of 8) where each
    through an application and the admission pool took 0.30 s (2-core AMX Xeon)."""
    if parsed is None:
        return errors.missing_api_key() if bearer_token(header) is None else errors.invalid_api_key()
    if known is not None and not keys.matches(parsed.plaintext, known.digest):
        return errors.invalid_api_key()
    return None


def _in_flight_caller(known: _Known | None) -> tuple[str | None, errors.ApiError | None]:
    """For a known key: its tenant's caller, counted in flight from here on, or the 429 when the
    tenant has as many generation requests in flight here as could run or wait for a slot.
    (None, None) for a key not known yet (counted once it authenticates) or a wrong secret."""
    if known is None:
        return None, None
    # A zero limit is the gate's to answer (its message names the field).
    if known.concurrent_streams and _in_flight.get(known.caller, 0) >= known.concurrent_streams + settings.SLOT_WAITERS_PER_TENANT:
        return None, errors.slot_queue_full(known.concurrent_streams, settings.SLOT_WAITERS_PER_TENANT)
    return known.caller, None


# Set by tenants.flood_gate while daphne creates the application of a request it has already
# counted in flight: the application's task inherits it, and the middleware counts it no more.
counted_at_gate: contextvars.ContextVar[bool] = contextvars.ContextVar("counted_at_gate", default=False)


def gate(header: str | None) -> tuple[str | None, tuple[errors.ApiError, str | None] | None]:
    """As a request's headers arrive (tenants.flood_gate, else the middleware): the 401 for a
    key no database row can admit (`_unusable`), the 429 for a known key whose tenant is at its
    in-flight bound in this process (with the tenant's engine id), or else the caller now
    counted in flight (None for a key not known yet: the middleware counts it once it
    authenticates). The count is taken here, not when the application first runs: a burst's
    requests are all read in one pass of the reactor before any application runs, and all of
    them passed a bound that nobody had been counted against yet."""
    parsed, known = _known(header)
    unusable = _unusable(header, parsed, known)
    if unusable is not None:
        return None, (unusable, None)
    caller, refusal = _in_flight_caller(known)
    if refusal is not None:
        return None, (refusal, known.tenant_id)
    if caller is not None:
        _enter(caller)
    return caller, None


def _enter(caller: str) -> None:
    _in_flight[caller] = _in_flight.get(caller, 0) + 1


def leave(caller: str) -> None:
    """The end of a request counted in flight (by `gate`, or the middleware)."""
    if _in_flight[caller] == 1:
        del _in_flight[caller]
    else:
        _in_flight[caller] -= 1


class ApiKeyAuthMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: AsgiScope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        header = scope_header(scope, b"authorization")
        if scope["type"] == "websocket":
            return await self._socket(scope, receive, send, header)
        # Counted by the flood gate, which lets go when this request's task ends, however it ends.
        counted = counted_at_gate.get()
        caller = None
        if not counted:
            caller, refused = gate(header)  # before the first await: a burst arrives all at once
            if refused is not None:
                error, tenant_id = refused
                http_metrics.note_tenant(scope, tenant_id)
                return await refuse(scope, receive, send, error)
        try:
            try:
                api_key, decision = await _authenticate(scope, header)
            except errors.ApiError as error:
                return await refuse(scope, receive, send, error)
            if caller is None and not counted:
                caller = admission.tenant_caller(api_key.tenant_id)
                _enter(caller)
            return await self.app({**scope, "tenant": api_key.tenant, "api_key": api_key, "rate_limit": decision},
                                  receive, send)
        finally:
            if caller is not None:
                leave(caller)

    async def _socket(self, scope: AsgiScope, receive: Any, send: Any, header: str | None) -> None:
        """A WebSocket handshake: its generations are bounded per `start` message, not here."""
        if header is None:
            # Browsers cannot set headers on a WebSocket: the consumer takes the key from
            # the first message instead (scope["tenant"] is None until it does).
            return await self.app({**scope, "tenant": None, "api_key": None, "rate_limit": None}, receive, send)
        try:
            api_key, decision = await _authenticate(scope, header)
        except errors.ApiError as error:
            return await refuse(scope, receive, send, error)
        return await self.app({**scope, "tenant": api_key.tenant, "api_key": api_key, "rate_limit": decision},
                              receive, send)


async def _authenticate(scope: AsgiScope, header: str | None) -> tuple[ApiKey, Decision]:
    """`authenticate_and_admit`, the key's tenant noted for /metrics even when a limit refuses:
    a limit refuses only a key that authenticated, which `remember` has made known."""
    try:
        api_key, decision = await authenticate_and_admit(header)
    except errors.ApiError:
        known = _verified(header)
        if known is not None:
            http_metrics.note_tenant(scope, known.tenant_id)
        raise
    http_metrics.note_tenant(scope, api_key.tenant.engine_id)
    return api_key, decision


async def refuse(scope: AsgiScope, receive: Any, send: Any, error: errors.ApiError) -> None:
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
    http_metrics.count_refusal(error)  # a frame, not an HTTP status: ResponseMetrics cannot see it
    seen = scope.get(http_metrics.SCOPE_KEY)
    refusals.note(tenant_id=seen.tenant if seen is not None else None,
                  key=refusals.key_prefix(scope_header(scope, b"authorization")), endpoint=scope["path"],
                  status=error.status, error=error.body()["error"])
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": body.decode()})
    await send({"type": "websocket.close", "code": 4000 + error.status})
