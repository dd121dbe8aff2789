"""Hooks into daphne that the platform's API needs and daphne does not offer.

1. `install_body_limit`: refuse request bodies over MAX_REQUEST_BYTES while they arrive.
2. `allow_endpoint_close_codes`: let WebSocket consumers close with RFC 6455's 1008
   (policy violation), 1009 (message too big) and 1011 (server error).
3. `install_stream_backpressure`: a stream's `send` (an event stream, a WebSocket, a file
   download) waits while its client is not reading, and a client that reads nothing for
   STREAM_STALL_S is disconnected.
4. `skip_form_parsing`: Twisted does not parse form bodies into `request.args` (daphne never
   reads them; the application parses the body it is handed).
5. `enlarge_body_messages`: bodies reach the application in 256 KiB messages, not 8 KiB ones.
6. `name_status_codes`: statuses Twisted has no reason phrase for (429, 422, 431...) go out
   with the standard one, not "Unknown Status".
7. `pace_accepts`: at most ACCEPTS_PER_TURN new connections per turn of the event loop.
8. `abort_after_late_errors`: an application exception after the response started aborts the
   connection instead of stopping daphne's application checker.
9. `close_idle_connections`: kept-alive connections idle for HTTP_KEEPALIVE_TIMEOUT_S are closed.
10. `raise_open_files_limit`: the soft limit on open files (a connection each) up to the hard one.

All patch daphne's classes in this process only; `config.asgi` installs them, so they
apply exactly where daphne serves the application.

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

import asyncio
import logging
import struct
import time

from config.raw_errors import error_bytes

try:  # Linux: the kernel's count of bytes a socket sent that its peer has not acknowledged
    import fcntl
    from termios import TIOCOUTQ
except ImportError:  # elsewhere only the server's own buffer counts
    fcntl = TIOCOUTQ = None

log = logging.getLogger(__name__)

_state: dict = {"limit": None, "paths": {}}


def _limit_for(path: bytes) -> int:
    """The limit for a request path: a per-path one (file uploads) or the default."""
    path = path.split(b"?", 1)[0].rstrip(b"/")
    return _state["paths"].get(path.decode("latin-1"), _state["limit"])


def _refusal(limit: int) -> bytes:
    return error_bytes(413, f"The request body is larger than this server's limit of {limit} bytes.", "request_too_large")


def _count_refusal(path: bytes) -> None:
    """In /metrics, as the application's own 413s are: no application sees this request."""
    try:
        from inference import http_metrics

        http_metrics.count_response(http_metrics.endpoint_of_path(path.decode("latin-1")), 413, None)
    except Exception:  # a metric is not worth a refusal
        log.exception("counting a refused body failed")


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
            _count_refusal(getattr(request.channel, "_path", b""))

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


# Twisted's Request parses every multipart/form-data POST body with the email package, whole and
# on the reactor thread, before daphne hands the body on, only to fill `request.args`, which
# daphne never reads. A 40 MiB upload of blank lines kept the event loop busy for 30-60 s in that
# parse (py-spy: 1,893 of 1,964 samples of the main thread in email.feedparser, under
# http.Request.requestReceived), every other request of the process waiting: streams stalled
# mid-token, admissions timed out, generation slots lapsed. The application parses the body
# itself (Django's multipart parser, on the upload pool).
def skip_form_parsing() -> None:
    from daphne.http_protocol import WebRequest

    if getattr(WebRequest, "_form_parsing_skipped", False):
        return
    init = WebRequest.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._parsePOSTFormSubmission = False

    WebRequest.__init__ = __init__
    WebRequest._form_parsing_skipped = True


BODY_MESSAGE_BYTES = 256 * 1024


def enlarge_body_messages() -> None:
    """Daphne hands a body to the application in messages of `request_buffer_size` bytes (8 KiB
    by default): 5,120 messages, each a write of Django's body file, for a 40 MiB upload, all on
    the event loop. Quarter-megabyte messages make that 160."""
    from daphne.server import Server

    if getattr(Server, "_body_messages_enlarged", False):
        return
    server_init = Server.__init__

    def server_init_with_larger_body_messages(self, *args, **kwargs):
        server_init(self, *args, **kwargs)
        self.request_buffer_size = max(self.request_buffer_size, BODY_MESSAGE_BYTES)

    Server.__init__ = server_init_with_larger_body_messages
    Server._body_messages_enlarged = True


# RFC 6455 7.4.1 codes an endpoint may send. autobahn (daphne's WebSocket layer) lets an
# application close only with 1000 or 3000-4999 and raises on anything else.
ENDPOINT_CLOSE_CODES = frozenset({1001, 1008, 1009, 1011})


def name_status_codes() -> None:
    """Twisted's reason phrases stop at RFC 2616: every 429 the API sent went out as "HTTP/1.1
    429 Unknown Status", which proxies log and some clients show. The standard library's
    phrases fill the gaps."""
    from http import HTTPStatus

    from twisted.web import http

    for status in HTTPStatus:
        http.RESPONSES.setdefault(status.value, status.phrase.encode())


def abort_after_late_errors() -> None:
    """An application that raises once its response has started (a file deleted during its
    download, say): daphne answers every application exception with its 500 page, whose
    `http.response.start` raised ValueError inside the server's once-a-second application
    checker, which then never ran again in that process (no more timeouts, no reaping of
    finished applications), and the client waited for the rest of a body that never came.
    Here the connection is aborted instead: the client sees its body cut short at once."""
    from daphne.http_protocol import WebRequest

    if getattr(WebRequest, "_late_errors_installed", False):
        return
    handle_exception = WebRequest.handle_exception

    def abort_if_started(self, exception):
        if not getattr(self, "_response_started", False):
            return handle_exception(self, exception)
        transport = self.channel.transport if self.channel is not None else None
        if transport is not None:
            transport.abortConnection()

    WebRequest.handle_exception = abort_if_started
    WebRequest._late_errors_installed = True


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


# Stream backpressure. Daphne's `send` writes into the Twisted transport and returns, whatever
# the client reads: a client that stops reading keeps its generation running to max_tokens
# while the transport's buffer grows. Its socket gives no sign before its buffers fill, and on
# Linux those are large: a loopback socket whose peer reads nothing took 2.9 MB of 300-byte
# writes before the first EAGAIN (the send buffer autotunes to tcp_wmem's 4 MiB), about 400 s
# of one chat stream on a CPU (28 tokens/s, ~270 bytes an event). So what a stream holds is
# counted as Twisted's buffer plus the kernel's unacknowledged send queue (TIOCOUTQ), both of
# which a reading client empties within a round trip.
#
# Past STREAM_MAX_BUFFERED_BYTES a stream's `send` (an SSE body write that is not the last, or
# a WebSocket frame) waits until its client has taken half of that; meanwhile the generation's
# deltas merge into one event (`Generation.events`), so a slow reader loses nothing and gets
# fewer, larger events. A client that takes nothing for STREAM_STALL_S (what its stream holds
# does not shrink; a client's reads show when its kernel reopens its window, every 576 bytes
# freed with the smallest receive buffer) is disconnected (abortConnection: a reset, which also
# frees the kernel's buffers); daphne then tells the
# application (http.disconnect / websocket.disconnect), whose close path aborts the generation,
# frees its blocks and bills what it generated. Other responses (JSON, file downloads) never
# wait: they end by themselves, and throttling them to a stream's cap would slow a large
# download on a long link.
_streams: dict = {"max_bytes": None, "stall_s": None, "server": None, "stalled": 0}
# While a stream waits its buffer is polled, from every 50 ms after progress down to once a
# second while none comes: a thousand stalled clients then cost ~1,000 wake-ups a second.
DRAIN_POLL_S = (0.05, 1.0)


def _socket_transport(transport):
    """The TCP transport under any wrapping protocol (TLS), which owns the socket and the buffer."""
    for _ in range(4):
        if transport is None or hasattr(transport, "dataBuffer"):
            return transport
        transport = getattr(transport, "transport", None)
    return None


def buffered_bytes(transport) -> int:
    """Bytes written to a connection that its client has not taken yet: Twisted's buffer plus
    the kernel's send queue (sent but not acknowledged, or not sent for want of window)."""
    tcp = _socket_transport(transport)
    if tcp is None:
        return 0
    held = len(tcp.dataBuffer) - tcp.offset + tcp._tempDataLen
    if TIOCOUTQ is not None and not tcp.disconnected:
        try:
            held += struct.unpack("i", fcntl.ioctl(tcp.fileno(), TIOCOUTQ, b"\0\0\0\0"))[0]
        except (OSError, ValueError):  # closed meanwhile, or not a socket that keeps the count
            pass
    return held


def _path(protocol) -> str:
    path = getattr(protocol, "path", b"")
    return path.decode("latin-1", "replace") if isinstance(path, bytes) else str(path)


# Unread bytes a file download may hold (batches.views streams it 1 MiB at a time): more than
# an event stream's, so a reader that keeps up never waits on the drain's polling.
DOWNLOAD_BUFFER_BYTES = 2 * 1024**2


def _is_stream_write(protocol, message: dict) -> bool:
    kind = message["type"]
    if kind == "http.response.start":
        content_type = next((v for k, v in message.get("headers", ()) if k.lower() == b"content-type"), b"").lower()
        download = content_type.startswith(b"application/jsonl")
        protocol._is_stream = download or content_type.startswith(b"text/event-stream")
        protocol._stream_limit = DOWNLOAD_BUFFER_BYTES if download else None
        return False
    if kind == "http.response.body":
        return bool(message.get("more_body")) and getattr(protocol, "_is_stream", False)
    if kind == "websocket.send":
        protocol._is_stream = True
        return True
    return False


async def _wait_for_reader(protocol) -> None:
    """Return once the client has taken enough of what its stream holds; disconnect it when it
    takes nothing for STREAM_STALL_S."""
    limit, stall_s = getattr(protocol, "_stream_limit", None) or _streams["max_bytes"], _streams["stall_s"]
    transport = getattr(protocol, "transport", None)
    held = buffered_bytes(transport)
    if held <= limit:
        return
    last, progress_at, pause = held, time.monotonic(), DRAIN_POLL_S[0]
    while True:
        await asyncio.sleep(pause)
        tcp = _socket_transport(transport)
        if tcp is None or tcp.disconnected or getattr(protocol, "_stalled", False):
            return  # gone: daphne drops later writes and tells the application
        held = buffered_bytes(transport)
        if held <= limit // 2:
            return
        now = time.monotonic()
        if held < last:
            progress_at, pause = now, DRAIN_POLL_S[0]
        elif now - progress_at >= stall_s:
            protocol._stalled = True
            _streams["stalled"] += 1
            log.warning("stream %s: the client took nothing for %.0f s with %d bytes unsent; disconnecting it "
                        "(STREAM_STALL_S)", _path(protocol), now - progress_at, held)
            transport.abortConnection()
            return
        else:
            pause = min(pause * 2, DRAIN_POLL_S[1])
        last = held


def install_stream_backpressure(max_bytes: int, stall_s: float) -> None:
    """Hook daphne's ASGI `send` (once per process; a second call only changes the limits)."""
    _streams["max_bytes"], _streams["stall_s"] = max_bytes, stall_s
    from daphne.server import Server

    if getattr(Server, "_backpressure_installed", False):
        return
    handle_reply = Server.handle_reply

    async def handle_reply_then_wait(self, protocol, message):
        _streams["server"] = self
        if getattr(protocol, "_stalled", False):
            # Aborted, and daphne learns it on the reactor's next turn: until then the application
            # would still write, e.g. one event of every delta that piled up (47 KB in one run).
            return
        await handle_reply(self, protocol, message)
        if _is_stream_write(protocol, message):
            await _wait_for_reader(protocol)

    Server.handle_reply = handle_reply_then_wait
    Server._backpressure_installed = True


def pace_accepts(per_turn: int) -> None:
    """Accept at most `per_turn` connections per turn of the event loop. Twisted accepts up to
    100 at once and grows that by 20 each time it fills it, so a burst of 400 connections was
    read, parsed and refused in a few turns of hundreds of callbacks each, and every hop of a
    running stream (the engine's token to its SSE event to the socket) waited behind one: the
    bystander's first token left the engine in 33-57 ms and reached its client 80-140 ms
    later. Paced, the burst waits in the listen backlog (raised for it) and is served between
    the streams' hops; the same work, interleaved. With config.intake an accepted connection's
    request is parsed in its caller's turn, not in the accepting one, so the pace is 64 a turn
    (~5 ms of accepting) rather than 8."""
    from twisted.internet import tcp

    if getattr(tcp.Port, "_paced", False):
        return
    # Twisted reads and adapts the instance's `numberAccepts` in doRead: a property caps it.
    tcp.Port.numberAccepts = property(lambda self: per_turn, lambda self, value: None)
    tcp.Port._paced = True


def close_idle_connections(seconds: float) -> None:
    """A kept-alive connection with no request in progress is closed after `seconds` of silence
    (0: never), as nginx's keepalive_timeout (75 s) does. Twisted's default is 12 hours: each
    idle connection a client left open held a file descriptor of the process that long. Twisted
    stops the clock while a request is being answered, so a long stream is never cut by it."""
    from daphne.http_protocol import HTTPFactory

    HTTPFactory._idle_timeout = seconds or None
    if getattr(HTTPFactory, "_idle_timeout_installed", False):
        return
    init = HTTPFactory.__init__

    def __init__(self, server):
        init(self, server)
        self.timeOut = HTTPFactory._idle_timeout

    HTTPFactory.__init__ = __init__
    HTTPFactory._idle_timeout_installed = True


def raise_open_files_limit() -> tuple[int, int]:
    """The soft limit on open files raised to the hard one, as nginx's worker_rlimit_nofile and
    vLLM's server do: every connection is a file descriptor, and a stock Linux's soft limit of
    1,024 stopped daphne accepting at about a thousand concurrent streams (Twisted then leaves
    the rest in the listen queue until one closes). Returns (before, after)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        return soft, soft
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError):  # a hard limit the kernel caps lower (fs.nr_open): keep the soft one
        log.warning("could not raise the open files limit from %d to %d", soft, wanted)
        return soft, soft
    return soft, wanted


def call_when_serving(*calls) -> None:
    """Run `calls` once daphne's reactor runs. daphne sends no lifespan startup, so without
    this the engine loaded (and the replica joined the fleet) on its first connection: behind
    nginx, which sends none until a request hashes to it, a replica stayed unloaded."""
    from daphne.server import Server

    if getattr(Server, "_serving_calls", None) is not None:
        Server._serving_calls.extend(calls)
        return
    Server._serving_calls = list(calls)
    original = Server.run

    def run(self):
        from twisted.internet import reactor

        Server.serving = self  # the one server of this process (config.front_worker hands it connections)
        # Inside the running loop: after Twisted's signal handlers (drain replaces SIGTERM's).
        for call in Server._serving_calls:
            reactor.callLater(0, call)
        return original(self)

    Server.run = run


def stream_buffers() -> dict:
    """What this process holds for its open streams' clients (operators' stats): bytes not yet
    taken in all and by the worst one, and how many clients were disconnected for stalling."""
    server = _streams["server"]
    held = []
    if server is not None:
        # Read from a view's thread while the reactor changes the dict: list() copies the keys
        # in one step under the GIL; a connection closing meanwhile counts as 0.
        for protocol in list(server.connections):
            if getattr(protocol, "_is_stream", False):
                held.append(buffered_bytes(getattr(protocol, "transport", None)))
    return {"open": len(held), "buffered_bytes": sum(held), "buffered_bytes_max": max(held, default=0),
            "stalled_disconnected": _streams["stalled"]}


def open_sse_responses() -> int:
    """SSE responses this process is still writing (a drain waits for them to end)."""
    from daphne.ws_protocol import WebSocketProtocol

    server = _streams["server"]
    if server is None:
        return 0
    return sum(1 for protocol in list(server.connections)
               if getattr(protocol, "_is_stream", False) and not isinstance(protocol, WebSocketProtocol))
