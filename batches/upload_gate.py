"""Uploads refused before their body is read: the API key is checked on the headers.

Daphne reads a whole request body before the application sees any of it, so a view can
refuse an unauthenticated 100 MB upload only after the server has received and stored all
of it. For the paths gated here (POST /v1/files) the key is checked as soon as the headers
are in: the connection stops reading while the key is looked up (on a worker thread, never
the event loop's), then either reads on or answers 401 and closes, having read no more
than was already in flight. The view authenticates again as usual; this is only a gate.

The body's lines are counted as they arrive, too: past BATCH_MAX_LINES (and the few lines of
the multipart framing) the upload is answered 400 `too_many_lines` and its connection closed,
so a file of millions of blank lines costs the server what it read up to the limit, not the
whole file (40 MiB of blank lines: 50 KB read instead of 40 MiB received, stored and parsed).

`install()` wraps daphne's `WebRequest` after `config.daphne_hooks.install_body_limit`,
whose `_body_refused` flag it shares, so a refused body is dropped as that hook drops one.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from http import HTTPStatus

from channels.db import database_sync_to_async
from django.conf import settings

from batches.jsonl import too_many_lines
from inference import http_metrics, refusals
from tenants.authentication import authenticate_bearer
from tenants.errors import ApiError, missing_scope
from tenants.models import Scope

log = logging.getLogger(__name__)

GATED_PATHS = frozenset({"/v1/files"})
UPLOAD_ENDPOINT = "v1/files"  # its route, as /metrics labels what Django serves there
# A key lookup is one indexed read (and at most one UPDATE of last_used); one that takes
# this long means the database is in trouble: answer 503 rather than hold the socket.
CHECK_TIMEOUT_S = 10.0
PENDING, PASSED, REFUSED = "pending", "passed", "refused"
# Lines of a multipart body that are not the file's: each part's boundary, headers and blank
# separator (4-5 lines for `purpose`, the same for `file`, the closing boundary). A body over
# the line limit by fewer than this still reaches the view, which counts the file's own lines.
FRAMING_LINES = 32


def _gated(channel) -> bool:
    path = getattr(channel, "_path", b"").split(b"?", 1)[0].rstrip(b"/").decode("latin-1")
    return getattr(channel, "_command", b"") == b"POST" and path in GATED_PATHS


def _response(error: ApiError) -> bytes:
    body = json.dumps(error.body()).encode()
    headers = {**error.headers, "Content-Type": "application/json", "Content-Length": str(len(body)),
               "Connection": "close"}
    head = f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (head + "\r\n").encode("latin-1") + body


def _refusal(header: str | None) -> tuple[ApiError | None, int | None]:
    """(the refusal, or None) and the key's tenant."""
    try:
        api_key = authenticate_bearer(header)
    except ApiError as error:
        return error, None
    if not api_key.allows(Scope.BATCH):  # uploads are batch input
        return missing_scope(Scope.BATCH), None
    return None, api_key.tenant_id


# Uploads of each tenant this process is receiving, from the gate to the response: past
# FILES_MAX_CONCURRENT_UPLOADS the next is refused before its body is read. Each upload's bytes
# pass through the event loop (two clients sending 40 MiB uploads in a loop took a fifth of it),
# so one tenant's parallel uploads would otherwise still cost everyone.
_receiving: Counter = Counter()


def _too_many_uploads() -> ApiError:
    limit = settings.FILES_MAX_CONCURRENT_UPLOADS
    return ApiError(429, f"This organization already has {limit} upload(s) in progress; retry when it finishes.",
                    type="requests", code="too_many_uploads", param="file", headers={"Retry-After": "2"})


def _refuse(request, error: ApiError, tenant_id: int | None) -> None:
    """Answer `error` and close. A known tenant's refusals linger, so that keeping connections
    open a moment is bounded by what its key may do; anonymous ones close at once."""
    http_metrics.count_response(UPLOAD_ENDPOINT, error.status, None if tenant_id is None else str(tenant_id))
    http_metrics.count_refusal(error)
    header = request.requestHeaders.getRawHeaders(b"authorization")
    refusals.note(tenant_id=tenant_id, key=refusals.key_prefix(header[0].decode("latin-1") if header else None),
                  endpoint="/" + UPLOAD_ENDPOINT, status=error.status,
                  error=error.body()["error"])
    request._key_check = REFUSED
    request._body_refused = True
    transport = request.channel.transport if request.channel is not None else None
    _received(request)  # a lingering connection is not an upload in progress
    if transport is None:
        return
    transport.write(_response(error))
    if tenant_id is None:
        transport.loseConnection()
        return
    transport.pauseProducing()
    transport.loseWriteConnection()  # the answer, then FIN: a client reading to the end stops there
    # nginx's lingering close, without the reading: a client that sends the body before it reads
    # (requests, httpx) reads the answer once the connection closes (FILES_REFUSAL_LINGER_S).
    asyncio.get_event_loop().call_later(settings.FILES_REFUSAL_LINGER_S, transport.loseConnection)


def _received(request) -> None:
    """The upload no longer counts as one its tenant is sending (once, whichever comes first:
    its refusal or the end of its request)."""
    tenant_id = getattr(request, "_upload_tenant", None)
    if tenant_id is None:
        return
    request._upload_tenant = None
    _receiving[tenant_id] -= 1
    if _receiving[tenant_id] <= 0:
        del _receiving[tenant_id]


async def _check(request, header: str | None) -> None:
    try:
        check = database_sync_to_async(_refusal, thread_sensitive=False)
        error, tenant_id = await asyncio.wait_for(check(header), CHECK_TIMEOUT_S)
    except Exception:  # a database error or the timeout: the platform's fault, so retry later
        log.exception("upload gate: the key check failed")
        error, tenant_id = ApiError(503, "The server could not check the API key; retry shortly.", type="server_error",
                                    code="service_unavailable", headers={"Retry-After": "5"}), None
    channel = request.channel
    if getattr(request, "_body_refused", False):  # refused meanwhile by another hook (its size)
        return
    if channel is None or channel.transport is None:  # the client left meanwhile
        request._key_check = REFUSED
        return
    if error is None and request._lines_over:  # too many lines arrived during the check
        error = too_many_lines(settings.BATCH_MAX_LINES)
    if error is None and _receiving[tenant_id] >= settings.FILES_MAX_CONCURRENT_UPLOADS:
        error = _too_many_uploads()
    if error is None:
        _receiving[tenant_id] += 1
        request._upload_tenant = tenant_id
        request.notifyFinish().addBoth(lambda _result: _received(request))
    if error is not None:
        _refuse(request, error, tenant_id)
        return
    request._key_check = PASSED
    if request._expect_continue:
        channel.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    channel.transport.resumeProducing()
    if request._body_complete:
        request.process()


def install() -> None:
    """Hook daphne's request class (once per process)."""
    from daphne.http_protocol import WebRequest

    if getattr(WebRequest, "_key_gate_installed", False):
        return
    got_length, handle_chunk, process = WebRequest.gotLength, WebRequest.handleContentChunk, WebRequest.process

    def gotLength(self, length):
        got_length(self, length)
        channel = self.channel
        if getattr(self, "_body_refused", False) or not _gated(channel):
            return
        header = self.requestHeaders.getRawHeaders(b"authorization")
        expect = self.requestHeaders.getRawHeaders(b"expect")
        # Twisted answers `Expect: 100-continue` right after this returns: the gate answers it
        # instead, once the key passed, so a well-behaved client sends nothing before that.
        self._expect_continue = bool(expect) and expect[0].lower() == b"100-continue"
        self.requestHeaders.removeHeader(b"expect")
        self._key_check, self._body_complete, self._body_lines, self._lines_over = PENDING, False, 0, False
        channel.transport.pauseProducing()
        asyncio.get_event_loop().create_task(_check(self, header[0].decode("latin-1") if header else None))

    def handleContentChunk(self, data):
        if not getattr(self, "_body_refused", False) and hasattr(self, "_body_lines"):
            if self._lines_over:
                return  # bytes that were in flight: the key check answers (see below)
            self._body_lines += data.count(b"\n")
            if self._body_lines > settings.BATCH_MAX_LINES + FRAMING_LINES:
                if self._key_check == PENDING:
                    # The bytes in flight during the check were already too many: whose they are
                    # decides the answer (a 401, or too_many_lines lingering for a known tenant),
                    # so `_check` gives it.
                    self._lines_over = True
                    return
                _refuse(self, too_many_lines(settings.BATCH_MAX_LINES), self._upload_tenant)
                return
        handle_chunk(self, data)

    def gated_process(self):
        state = getattr(self, "_key_check", PASSED)
        if state == PENDING:
            self._body_complete = True  # all of it was already in flight: process once the key passes
            return None
        if state == REFUSED:
            return None
        return process(self)

    WebRequest.gotLength = gotLength
    WebRequest.handleContentChunk = handleContentChunk
    WebRequest.process = gated_process
    WebRequest._key_gate_installed = True
