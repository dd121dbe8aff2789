"""HTTP endpoints that talk to the engine, as Channels consumers (SSE and plain JSON).

    POST /v1/chat/completions       OpenAI chat completions (JSON, or SSE with stream: true)
    POST /v1/completions            OpenAI text completions (same)
    POST /api/v1/inference/chat     the platform's own stream: event: token | done | error

A Channels `AsyncHttpConsumer` handles one message at a time, so a response produced
inside `handle()` would never see `http.disconnect`. Here `http_request` only gathers
the body (refusing it past MAX_REQUEST_BYTES as it arrives) and starts the response as
a task; `http_disconnect` cancels that task, whose `finally` aborts the engine requests,
bills the tokens generated and releases the stream lease (`Generation.close`).

Every event of a stream carries an `id:` counting up from 0, so a client (or a test)
sees a gap at once. Deltas that pile up while the client reads slowly are merged into
one event (`Generation.events`), so a slow reader never builds a queue of events.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import redis
from channels.exceptions import StopConsumer
from channels.generic.http import AsyncHttpConsumer
from django import db
from django.conf import settings

from config import intake, request_ids
from inference import formatting, grammar_checks, http_metrics, protocol
from inference.dispatch import NoSharedThreadDispatch
from inference.generation import Caller, Generation
from inference.host import host
from inference.streaming import engine_failure
from tenants.errors import ApiError, database_unavailable, limits_unavailable

log = logging.getLogger(__name__)

# Response tasks outlive their consumer when the client leaves (they still have to bill);
# holding them here keeps them from being garbage-collected mid-way.
_responses: set[asyncio.Task] = set()


def _json(data: Any) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def _headers(pairs: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in pairs.items()]


def too_large() -> ApiError:
    limit = settings.MAX_REQUEST_BYTES
    return ApiError(413, f"The request body is larger than this server's limit of {limit} bytes.",
                    code="request_too_large")


def server_error() -> ApiError:
    return ApiError(500, "The server had an error while processing your request.", type="server_error",
                    code="internal_error")


class EngineHttpConsumer(NoSharedThreadDispatch, AsyncHttpConsumer):
    """Body gathering, size limit, the response task, and SSE writing."""

    # Streams never use the channel layer: tokens travel from the engine thread straight here.
    channel_layer_alias = "streams-use-no-channel-layer"
    methods = ("POST",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._size = 0
        self._refused = False
        self._task: asyncio.Task | None = None
        self._started = False  # response headers sent
        self._event_id = 0

    # -- ASGI messages --------------------------------------------------------------------

    async def http_request(self, message: dict) -> None:
        if self._refused:
            return
        if self._size == 0 and not self.body:
            error = self._precheck()
            if error is not None:
                return await self._refuse(error)
        chunk = message.get("body", b"")
        self._size += len(chunk)
        if self._size > settings.MAX_REQUEST_BYTES:
            return await self._refuse(too_large())
        self.body.append(chunk)
        if not message.get("more_body"):
            task = asyncio.create_task(self._respond(b"".join(self.body)))
            self.body = []
            _responses.add(task)
            task.add_done_callback(_responses.discard)
            self._task = task

    async def http_disconnect(self, message: dict) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        raise StopConsumer()

    def _precheck(self) -> ApiError | None:
        if self.scope["method"] not in self.methods:
            return ApiError(405, f"Method {self.scope['method']} not allowed; use {', '.join(self.methods)}.",
                            code="method_not_allowed")
        declared = dict(self.scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.MAX_REQUEST_BYTES:
            return too_large()
        return None

    async def _refuse(self, error: ApiError) -> None:
        self._refused = True
        await self.send_error_response(error)

    # -- responding -----------------------------------------------------------------------

    async def _respond(self, body: bytes) -> None:
        try:
            await self.respond(body)
        except ApiError as error:
            await self._fail(error)
        except asyncio.CancelledError:
            raise
        except redis.RedisError as exc:  # limits or leases cannot be checked: 503, retry shortly
            await self._fail(limits_unavailable(exc))
        except db.Error as exc:  # the database is locked or away: 503 too, never a bare 500
            await self._fail(database_unavailable(exc))
        except Exception:
            log.exception("%s: unexpected error", self.scope["path"])
            await self._fail(server_error())

    async def _fail(self, error: ApiError) -> None:
        if self._started:
            await self.send_stream_error(error)
        else:
            await self.send_error_response(error)

    async def respond(self, body: bytes) -> None:
        raise NotImplementedError

    async def send_error_response(self, error: ApiError) -> None:
        headers = {"Content-Type": "application/json", **error.headers}
        await self.send_response(error.status, _json(error.body()), headers=_headers(headers))

    async def send_json_response(self, data: dict, headers: dict[str, str]) -> None:
        await self.send_response(200, _json(data), headers=_headers({"Content-Type": "application/json", **headers}))

    async def start_stream(self, headers: dict[str, str]) -> None:
        base = {
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # nginx: pass events through as they come
        }
        await self.send_headers(status=200, headers=_headers({**base, **headers}))
        self._started = True
        # Headers reach the client with the first body bytes: send a comment so the client
        # knows the request was admitted even while it waits in its lane.
        await self.send_body(b": ok\n", more_body=True)

    async def send_event(self, data: str, event: str | None = None) -> None:
        lines = [f"id: {self._event_id}"]
        if event:
            lines.append(f"event: {event}")
        lines.append(f"data: {data}")
        self._event_id += 1
        await self.send_body(("\n".join(lines) + "\n\n").encode(), more_body=True)

    async def send_heartbeat(self) -> None:
        # One line, no blank line after it: a comment line alone dispatches nothing, while a
        # blank line would make the openai client (which keeps the last `id:`) dispatch an
        # empty event and fail to parse it.
        await self.send_body(b": heartbeat\n", more_body=True)

    async def end_stream(self) -> None:
        await self.send_body(b"", more_body=False)

    async def send_stream_error(self, error: ApiError) -> None:
        raise NotImplementedError

    # -- shared pieces --------------------------------------------------------------------

    async def start_generation(self, gen: Generation) -> None:
        """Admit `gen`. Once a choice of it reached the engine its usage row tells how it ended,
        so an error answered after that is not also listed as a refusal (inference.refusals)."""
        try:
            await gen.start()
        finally:
            if gen.choices:
                http_metrics.note_billed(self.scope)

    def caller(self) -> Caller:
        return Caller(tenant=self.scope["tenant"], api_key=self.scope.get("api_key"),
                      rate_limit=self.scope.get("rate_limit"))

    def header(self, name: bytes) -> str | None:
        for key, value in self.scope.get("headers", ()):
            if key.lower() == name:
                return value.decode("latin-1")
        return None

    async def stream_generation(self, gen: Generation, on_batch, heartbeat_s: float) -> None:
        """Forward a started generation's deltas, with heartbeats while it is silent."""
        async for batch in gen.events(idle_s=heartbeat_s):
            if not batch:
                await self.send_heartbeat()
                continue
            await on_batch(batch)


class OpenAIConsumer(EngineHttpConsumer):
    """POST /v1/chat/completions and /v1/completions (the `kind` keyword of the route)."""

    kind = "chat"
    lane: int | None = None  # None: the tier's lane or the one the request asks for
    metered = True  # counted against the tenant's tokens/min and concurrent streams

    def request_id(self) -> str | None:
        return None  # a fresh id per request

    def billing(self) -> dict:
        return {}  # one usage row per request, keyed by its id

    def endpoint(self) -> str:
        return self.scope["path"]

    async def respond(self, body: bytes) -> None:
        data = protocol.parse_body(body)
        request = await grammar_checks.parse(protocol.parse_chat if self.kind == "chat" else protocol.parse_completion,
                                             data, self.scope["tenant"].pk)
        # Every metered generation holds its slots, streamed or not: 12 plain requests under a
        # limit of 8 all ran when only streams counted.
        gen = Generation(request, self.caller(), hold_lease=self.metered,
                         id_prefix="chatcmpl" if self.kind == "chat" else "cmpl", lane_override=self.lane,
                         metered=self.metered, request_id=self.request_id(), endpoint=self.endpoint(),
                         arrived_at=intake.arrival(), **self.billing())
        try:
            await self.start_generation(gen)
            headers = {"X-Request-Id": request_ids.adopt(self.scope, gen.id), "X-Lane": f"P{gen.lane}",
                       **gen.rate_limit_headers()}
            if request.stream:
                await self._stream(gen, headers)
            else:
                await gen.collect()
                await gen.close()
                error = next((c.error for c in gen.choices if c.error), None)
                if error:
                    raise engine_failure(error)
                await self.send_json_response(formatting.completion_response(gen, formatting.token_text(host.tokenizer)), headers)
        finally:
            await gen.close()

    async def _stream(self, gen: Generation, headers: dict[str, str]) -> None:
        texts = formatting.token_text(host.tokenizer)
        await self.start_stream(headers)
        for chunk in formatting.opening_chunks(gen):
            await self.send_event(_json(chunk).decode())

        async def on_batch(batch):
            for choice, out in batch:
                if out.error:
                    raise engine_failure(out.error)
            await self.send_event(_json(formatting.delta_chunk(gen, batch, texts)).decode())

        await self.stream_generation(gen, on_batch, settings.SSE_HEARTBEAT_S)
        await gen.close()
        if gen.request.include_usage:
            await self.send_event(_json(formatting.usage_chunk(gen)).decode())
        await self.send_event("[DONE]")
        await self.end_stream()

    async def send_stream_error(self, error: ApiError) -> None:
        # The openai client raises an APIError for a `data:` event carrying "error".
        await self.send_event(_json(error.body()).decode())
        await self.end_stream()


class PlatformChatConsumer(EngineHttpConsumer):
    """POST /api/v1/inference/chat: a chat request (the chat completions body), streamed as
    `event: token` (one delta each), then `event: done` ([DONE] with finish reasons and
    usage), or `event: error` (an OpenAI-shaped error) instead of a broken connection.
    `X-Priority: 0|1|2` asks for a lane (never better than the tier's)."""

    async def respond(self, body: bytes) -> None:
        request = await grammar_checks.parse(protocol.parse_chat, protocol.parse_body(body), self.scope["tenant"].pk)
        priority = self._priority_header()
        gen = Generation(request, self.caller(), header_priority=priority, hold_lease=True, endpoint=self.scope["path"],
                         arrived_at=intake.arrival())
        try:
            await self.start_generation(gen)
            headers = {"X-Request-Id": request_ids.adopt(self.scope, gen.id), "X-Lane": f"P{gen.lane}",
                       **gen.rate_limit_headers()}
            await self.start_stream(headers)

            async def on_batch(batch):
                for choice, out in batch:
                    if out.new_text or out.new_token_ids:
                        await self.send_event(_json({
                            "id": gen.id, "index": choice.index, "delta": out.new_text,
                            "tokens": len(out.new_token_ids),
                        }).decode(), event="token")
                    if out.error:
                        raise engine_failure(out.error)

            await self.stream_generation(gen, on_batch, settings.SSE_HEARTBEAT_S)
            await gen.close()
            await self.send_event(_json({
                "id": gen.id,
                "status": "[DONE]",
                "lane": gen.lane,
                "finish_reasons": [formatting.finish_reason(c) for c in gen.choices],
                "usage": gen.usage.as_dict(),
            }).decode(), event="done")
            await self.end_stream()
        finally:
            await gen.close()

    def _priority_header(self) -> int | None:
        value = self.header(b"x-priority")
        if value is None or not value.strip():
            return None
        if value.strip() not in ("0", "1", "2"):
            raise ApiError(400, f"X-Priority must be 0, 1 or 2, got {value!r}.", code="invalid_value", param="X-Priority")
        return int(value)

    async def send_stream_error(self, error: ApiError) -> None:
        await self.send_event(_json(error.body()).decode(), event="error")
        await self.end_stream()
