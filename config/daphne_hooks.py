"""Two hooks into daphne that the platform's API needs and daphne does not offer.

1. `install_body_limit`: refuse request bodies over MAX_REQUEST_BYTES while they arrive.
2. `allow_endpoint_close_codes`: let WebSocket consumers close with RFC 6455's 1008
   (policy violation), 1009 (message too big) and 1011 (server error).

Both patch daphne's protocol classes in this process only; `config.asgi` installs them,
so they apply exactly where daphne serves the application.

Body limit. Daphne (Twisted underneath) reads a whole request body into memory or a temporary file
before the application sees a byte of it, then queues all of it for the application at
once, so a consumer can only count a body after the server has already stored it. These
hooks on daphne's `WebRequest` count body bytes as the connection receives them:

- a declared Content-Length over the limit is refused before the body is read, and
  before Twisted answers `Expect: 100-continue` with `100 Continue`;
- a chunked body (no Content-Length) is refused the moment it passes the limit.

(A Content-Length smaller than the body makes Twisted cut the body there and read the rest
as the next request, which is then malformed: the consumer sees only the declared part.)

The refusal is the API's 413 in the OpenAI error shape, with `Connection: close`; the rest
of the body is dropped unread. The consumers keep their own count as a second line.
"""
from __future__ import annotations

import json

_state: dict = {"limit": None, "paths": {}}


def _limit_for(path: bytes) -> int:
    """The limit for a request path: a per-path one (file uploads) or the default."""
    path = path.split(b"?", 1)[0].rstrip(b"/")
    return _state["paths"].get(path.decode("latin-1"), _state["limit"])


def _refusal(limit: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"The request body is larger than this server's limit of {limit} bytes.",
        "type": "invalid_request_error", "param": None, "code": "request_too_large",
    }}).encode()
    head = (
        "HTTP/1.1 413 Request Entity Too Large\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + body


def install_body_limit(limit: int, paths: dict[str, int] | None = None) -> None:
    """Hook daphne's request class (once per process; a second call only changes the limits).
    `paths` maps exact request paths to their own limit (file uploads take more)."""
    _state["limit"] = limit
    _state["paths"] = {p.rstrip("/"): n for p, n in (paths or {}).items()}
    from daphne.http_protocol import WebRequest

    if getattr(WebRequest, "_body_limit_installed", False):
        return
    got_length, handle_chunk, process = WebRequest.gotLength, WebRequest.handleContentChunk, WebRequest.process

    def refuse(request) -> None:
        request._body_refused = True
        request.requestHeaders.removeHeader(b"Expect")  # no `100 Continue` for a body we refuse
        transport = request.channel.transport if request.channel is not None else None
        if transport is not None:
            transport.write(_refusal(request._body_limit))
            transport.loseConnection()

    def gotLength(self, length):
        self._body_seen = 0
        self._body_refused = False
        self._body_limit = _limit_for(getattr(self.channel, "_path", b""))
        got_length(self, length)
        if length is not None and length > self._body_limit:
            refuse(self)

    def handleContentChunk(self, data):
        if getattr(self, "_body_refused", False):
            return
        self._body_seen = getattr(self, "_body_seen", 0) + len(data)
        if self._body_seen > getattr(self, "_body_limit", _state["limit"]):
            refuse(self)
            return
        handle_chunk(self, data)

    def guarded_process(self):
        if getattr(self, "_body_refused", False):
            return  # already answered; the connection is closing
        return process(self)

    WebRequest.gotLength = gotLength
    WebRequest.handleContentChunk = handleContentChunk
    WebRequest.process = guarded_process
    WebRequest._body_limit_installed = True


# RFC 6455 7.4.1 codes an endpoint may send. autobahn (daphne's WebSocket layer) lets an
# application close only with 1000 or 3000-4999 and raises on anything else.
ENDPOINT_CLOSE_CODES = frozenset({1001, 1008, 1009, 1011})


def allow_endpoint_close_codes() -> None:
    from daphne.ws_protocol import WebSocketProtocol

    if getattr(WebSocketProtocol, "_endpoint_codes_installed", False):
        return
    server_close = WebSocketProtocol.serverClose

    def serverClose(self, code=None):
        if code in ENDPOINT_CLOSE_CODES:
            # What autobahn's sendClose does after its range check.
            self.sendCloseFrame(code=code, reasonUtf8=None, isReply=False)
            return
        server_close(self, code)

    WebSocketProtocol.serverClose = serverClose
    WebSocketProtocol._endpoint_codes_installed = True
