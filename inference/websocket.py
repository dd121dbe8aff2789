"""WebSocket /ws/v1/chat: several concurrent chat generations over one socket.

Authentication: `Authorization: Bearer sk-...` on the handshake, or (for browsers, which
cannot set headers on a WebSocket) a first message `{"type": "auth", "api_key": "sk-..."}`
within WS_AUTH_TIMEOUT_S.

Client messages (JSON text frames):
    {"type": "start", "id": "<your id>", "messages": [...], ...chat completion fields, "priority": 0|1|2}
    {"type": "cancel", "id": "<your id>"}
Server messages:
    {"type": "token", "id", "seq", "index", "delta"}       seq counts 0, 1, 2... per id
    {"type": "done", "id", "finish_reasons", "usage"}      finish reason "cancelled" after a cancel;
                                                          "errors" where structured output hit a dead end
    {"type": "error", "id", "error": {OpenAI error}}       one generation refused or failed; the socket stays
Close codes, each after an `error` frame saying why: 4401 unauthenticated (also when the
key is revoked or expires, or its tenant is deactivated, while the socket is open), 4429
rate limited (more than WS_MAX_FRAMES_PER_S messages a second, or WS_MAX_SOCKETS_PER_KEY
sockets open on the key), 4503 the limits store is away at authentication (4000 + the
HTTP status, as the key middleware closes), and RFC 6455's 1008 protocol violation (not
JSON, unknown type, no id), 1009 message too large, 1011 server error. (daphne's WebSocket
layer refuses 1008/1009/1011 from an application unless
`config.daphne_hooks.allow_endpoint_close_codes` is installed, which `config.asgi` does.)

The key is read again from the database every WS_AUTH_RECHECK_S while the socket is open,
and before a `start` when the last read is older than that: a revoked key stops at once,
and a `start` runs under the tenant's tier as it is now. A failure of the database or of
Redis while admitting one `start` is an `error` (503) for that id; the socket and its other
generations go on.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import time

from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from inference import grammar_checks, http_metrics, protocol, refusals
from inference.dispatch import NoSharedThreadDispatch
from inference.generation import Caller, Generation
from inference.streaming import engine_failure
from tenants import admission, errors, quota
from tenants.authentication import reload_key
from tenants.errors import ApiError
from tenants.limits import Lease
from tenants.middleware import authenticate_and_admit
from tenants.models import Scope

log = logging.getLogger(__name__)

MAX_ID_LENGTH = 128
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_SERVER_ERROR = 1011


class ProtocolViolation(Exception):
    pass


class FrameRate:
    """A token bucket of `rate` messages a second, `2 * rate` deep: a socket's own, in memory."""

    def __init__(self, rate: float, clock=time.monotonic) -> None:
        self.rate, self.capacity, self.clock = rate, 2 * rate, clock
        self.level, self.at = self.capacity, clock()

    def take(self) -> bool:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level < 1:
            return False
        self.level -= 1
        return True


def _frames_exceeded() -> ApiError:
    rate = settings.WS_MAX_FRAMES_PER_S
    return ApiError(429, f"More than {rate:g} messages a second on this WebSocket (WS_MAX_FRAMES_PER_S).",
                    type="requests", code="rate_limit_exceeded", headers={"Retry-After": "1"})


class ChatSocketConsumer(NoSharedThreadDispatch, AsyncWebsocketConsumer):
    channel_layer_alias = "streams-use-no-channel-layer"

    async def connect(self) -> None:
        self.caller: Caller | None = None
        self.generations: dict[str, asyncio.Task] = {}
        self._auth_timer: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._socket_lease: Lease | None = None
        self._checked_at = 0.0
        self._frames = FrameRate(settings.WS_MAX_FRAMES_PER_S)
        await self.accept()
        tenant = self.scope.get("tenant")
        if tenant is not None:
            await self._authenticated(Caller(tenant=tenant, api_key=self.scope.get("api_key"),
                                             rate_limit=self.scope.get("rate_limit")))
        else:
            self._auth_timer = asyncio.create_task(self._auth_deadline())

    async def _auth_deadline(self) -> None:
        await asyncio.sleep(settings.WS_AUTH_TIMEOUT_S)
        if self.caller is None:
            await self._close_with(errors.missing_api_key())

    async def disconnect(self, code: int) -> None:
        for task in (self._auth_timer, self._watcher):
            if task is not None:
                task.cancel()
        for task in list(self.generations.values()):
            task.cancel()
        if self._socket_lease is not None:
            lease, self._socket_lease = self._socket_lease, None
            try:
                await asyncio.to_thread(quota.close_socket, lease)
            except Exception as exc:  # it expires by itself after its TTL
                log.warning("websocket: could not release its socket slot: %s", exc)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            if not self._frames.take():
                await self._close_with(_frames_exceeded())
                return
            if text_data is None:
                raise ProtocolViolation("send JSON text frames, not binary ones")
            if len(text_data.encode("utf-8", errors="surrogatepass")) > settings.MAX_REQUEST_BYTES:
                await self._close_with(ApiError(413, f"Messages are limited to {settings.MAX_REQUEST_BYTES} bytes.",
                                                code="message_too_large"), CLOSE_TOO_BIG)
                return
            try:
                message = protocol.parse_body(text_data.encode("utf-8", errors="surrogatepass"))
            except ApiError as exc:
                raise ProtocolViolation(exc.message) from None
            await self._handle(message)
        except ProtocolViolation as exc:
            await self._close_with(ApiError(400, f"Protocol violation: {exc}", code="protocol_violation"), CLOSE_POLICY)
        except Exception:
            log.exception("websocket: unexpected error")
            await self._close_with(ApiError(500, "The server had an error.", type="server_error"), CLOSE_SERVER_ERROR)

    async def _handle(self, message: dict) -> None:
        kind = message.get("type")
        if kind == "auth":
            return await self._authenticate(message)
        if self.caller is None:
            return await self._close_with(errors.missing_api_key())
        if kind == "start":
            return await self._start(message)
        if kind == "cancel":
            gen_id = self._id(message)
            task = self.generations.get(gen_id)
            if task is not None:
                task.cancel()
            return
        raise ProtocolViolation(f"unknown message type {kind!r}; expected auth, start or cancel")

    async def _authenticate(self, message: dict) -> None:
        if self.caller is not None:
            raise ProtocolViolation("already authenticated")
        key = message.get("api_key")
        if not isinstance(key, str):
            return await self._close_with(errors.missing_api_key())
        try:
            api_key, decision = await authenticate_and_admit(f"Bearer {key}")
        except ApiError as error:
            return await self._close_with(error)
        if self._auth_timer is not None:
            self._auth_timer.cancel()
        if await self._authenticated(Caller(tenant=api_key.tenant, api_key=api_key, rate_limit=decision)):
            await self._send({"type": "authenticated", "tenant": self.caller.tenant.name})

    async def _authenticated(self, caller: Caller) -> bool:
        """Take one of the key's socket slots and start watching the key; False (closed) if refused."""
        try:
            self._socket_lease = await admission.run(quota.open_socket, caller.api_key, what="socket slot",
                                                     caller=admission.tenant_caller(caller.api_key.tenant_id))
        except ApiError as error:
            await self._close_with(error)
            return False
        self.caller = caller
        self._checked_at = time.monotonic()
        self._watcher = asyncio.create_task(self._watch_key())
        return True

    async def _watch_key(self) -> None:
        """Re-read the key while the socket is open; close with 4401 once it is no longer live."""
        period = min(settings.WS_AUTH_RECHECK_S, settings.STREAM_LEASE_TTL_S / 3)
        while True:
            # Due a period after the last good read (a start may have read it since); a read that
            # failed (the database away) is tried again a period later, not at once.
            await asyncio.sleep(max(period / 4, self._checked_at + period - time.monotonic()))
            if time.monotonic() - self._checked_at >= period and not await self._recheck():
                return
            if self._socket_lease is not None:
                try:
                    await asyncio.to_thread(quota.renew_socket, self._socket_lease)
                except Exception as exc:  # Redis blipped: the slot is put back on the next renewal
                    log.warning("websocket: could not renew its socket slot: %s", exc)

    async def _recheck(self) -> bool:
        """Read the key again; False (and the socket closed) when it is revoked, expired or its
        tenant inactive. A database that does not answer keeps the last answer: the next
        check tries again."""
        api_key = self.caller.api_key
        try:
            fresh = await admission.run(reload_key, api_key.pk, what="key re-check",
                                        caller=admission.tenant_caller(api_key.tenant_id))
        except ApiError as error:
            if error.status != 401:
                log.warning("websocket: could not re-check its key (%s); keeping the last answer", error.code)
                return True
            for task in list(self.generations.values()):
                task.cancel()
            await self._close_with(error)
            return False
        self.caller = Caller(tenant=fresh.tenant, api_key=fresh, rate_limit=self.caller.rate_limit)
        self._checked_at = time.monotonic()
        return True

    def _id(self, message: dict) -> str:
        gen_id = message.get("id")
        if not isinstance(gen_id, str) or not gen_id or len(gen_id) > MAX_ID_LENGTH:
            raise ProtocolViolation(f"'id' must be a non-empty string of at most {MAX_ID_LENGTH} characters")
        return gen_id

    async def _start(self, message: dict) -> None:
        gen_id = self._id(message)
        if gen_id in self.generations:
            return await self._error(gen_id, ApiError(400, f"A generation with id {gen_id!r} is already running on this socket.",
                                                      code="duplicate_id", param="id"))
        body = {k: v for k, v in message.items() if k not in ("type", "id")}
        if time.monotonic() - self._checked_at >= settings.WS_AUTH_RECHECK_S and not await self._recheck():
            return
        tenant = self.caller.tenant
        try:
            request = await grammar_checks.parse(protocol.parse_chat, body, tenant.pk)
            if request.n != 1:
                raise protocol.bad_request("WebSocket generations take n = 1; start several instead.", "n", "invalid_value")
            if not self.caller.api_key.allows(Scope.INFERENCE):  # its scopes may have changed since
                raise errors.missing_scope(Scope.INFERENCE)
            decision = await admission.run(quota.admit_request, tenant, self.caller.api_key, what="start admission",
                                           caller=admission.tenant_caller(tenant.pk))
        except ApiError as error:
            return await self._error(gen_id, error)
        caller = Caller(self.caller.tenant, self.caller.api_key, decision)
        task = asyncio.create_task(self._generate(gen_id, Generation(request, caller, hold_lease=True, endpoint=self.scope["path"])))
        self.generations[gen_id] = task
        task.add_done_callback(lambda _t, g=gen_id: self.generations.pop(g, None))

    async def _generate(self, gen_id: str, gen: Generation) -> None:
        seq = 0
        cancelled = False
        try:
            try:
                await gen.start()
            except ApiError as error:
                return await self._error(gen_id, error, billed=bool(gen.choices))
            async for batch in gen.events():
                for choice, out in batch:
                    if out.new_text or out.new_token_ids:
                        await self._send({"type": "token", "id": gen_id, "seq": seq, "index": choice.index, "delta": out.new_text})
                        seq += 1
                    if out.error:
                        await gen.close()
                        return await self._error(gen_id, engine_failure(out.error), billed=True)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:
            log.exception("websocket generation %s failed", gen_id)
            await gen.close()
            return await self._error(gen_id, ApiError(500, "The server had an error.", type="server_error"),
                                     billed=bool(gen.choices))
        finally:
            await gen.close()
        # A cancel that came while the generation was being admitted leaves no choices behind.
        reasons = ["cancelled" if cancelled else (c.finish_reason or "stop") for c in gen.choices] or ["cancelled"]
        done = {"type": "done", "id": gen_id, "finish_reasons": reasons, "usage": gen.usage.as_dict()}
        if any(c.grammar_error for c in gen.choices):  # structured output at a dead end (finish reason "error")
            done["errors"] = [{"message": c.grammar_error, "code": "grammar_dead_end"} if c.grammar_error else None
                              for c in gen.choices]
        try:
            await self._send(done)
        except Exception:  # the socket is gone: nothing to tell
            pass

    async def _error(self, gen_id: str | None, error: ApiError, billed: bool = False) -> None:
        """Refuse or end one generation; `billed`: it ran, and its usage row tells how it ended."""
        http_metrics.count_refusal(error)
        if not billed:
            self._note_refusal(error)
        payload = {"type": "error", "id": gen_id, **error.body()}
        retry = error.headers.get("Retry-After")
        if retry:
            payload["retry_after"] = int(retry)
        await self._send(payload)

    def _note_refusal(self, error: ApiError) -> None:
        api_key = self.caller.api_key if self.caller is not None else None
        header = next((v.decode("latin-1") for k, v in self.scope.get("headers", ()) if k.lower() == b"authorization"), None)
        refusals.note(tenant_id=api_key.tenant_id if api_key is not None else None,
                      key=api_key.prefix if api_key is not None else refusals.key_prefix(header),
                      endpoint=self.scope["path"], status=error.status, error=error.body()["error"])

    async def _send(self, payload: dict[str, Any]) -> None:
        await self.send(text_data=json.dumps(payload, ensure_ascii=False))

    async def _close_with(self, error: ApiError, code: int | None = None) -> None:
        """Send the error, then close: with `code`, else 4000 + its HTTP status (4401, 4429)."""
        http_metrics.count_refusal(error)
        self._note_refusal(error)
        try:
            await self._send({"type": "error", "id": None, **error.body()})
        finally:
            await self.close(code=code or 4000 + error.status)
