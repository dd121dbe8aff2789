"""Every HTTP response names its request; every log line written while serving it does too.

The caller's `X-Request-Id` is kept when it is a sane token (1 to 128 printable ASCII
characters, no spaces), so a client or a proxy can follow its own id through our logs. Without
one, a generation is known by its own id (`chatcmpl-...`, the key of its usage record: the
consumer names it, `adopt`), anything else by `req_<32 hex>`. The id goes out as
`X-Request-Id` on the response, whatever answered it (a generation, a refusal, a DRF view,
Django's 404), beside `openai-processing-ms` (as OpenAI sends it: until the response's
headers), and into `scope["request_id"]`. `RequestIdFilter` puts it on log records
(`%(request_id)s`) for the task that serves the request and the threads it hands work to with
its context.
"""
from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from typing import Any

current: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_SANE = re.compile(rb"[\x21-\x7e]{1,128}")
_OURS = (b"x-request-id", b"openai-processing-ms")


def callers_id(scope: dict) -> str | None:
    """The caller's X-Request-Id when it is sane."""
    for key, value in scope.get("headers", ()):
        if key.lower() == b"x-request-id":
            return value.decode("ascii") if _SANE.fullmatch(value) else None
    return None


def adopt(scope: dict, own_id: str) -> str:
    """The id a handler answers and logs under once it has one of its own (a generation's):
    the caller's when it sent one, else `own_id`."""
    rid = scope.get("request_id") if scope.get("request_id_given") else own_id
    current.set(rid)
    return rid


class RequestIdMiddleware:
    """ASGI: names each HTTP request and WebSocket connection; stamps HTTP responses."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        given = callers_id(scope)
        rid = given or f"req_{uuid.uuid4().hex}"
        token = current.set(rid)
        started = time.monotonic()

        async def stamped(message: dict) -> None:
            if message["type"] == "http.response.start":
                elapsed_ms = int((time.monotonic() - started) * 1000)
                headers = list(message.get("headers", ()))
                named = next((v for k, v in headers if k.lower() == b"x-request-id"), None)
                headers = [(k, v) for k, v in headers if k.lower() not in _OURS]
                # The caller's id wins; else the handler's own (adopt), else ours.
                final = given.encode() if given else (named or rid.encode())
                headers += [(b"x-request-id", final), (b"openai-processing-ms", str(elapsed_ms).encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app({**scope, "request_id": rid, "request_id_given": given is not None}, receive,
                           stamped if scope["type"] == "http" else send)
        finally:
            current.reset(token)


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every record: the request being served, or "-" outside one."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current.get()
        return True
