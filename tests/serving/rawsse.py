"""A hand-written HTTP/1.1 client for the SSE endpoints, at the byte level.

The disconnect and stream tests need what an HTTP library hides: closing the socket
between two events, a reset instead of a FIN, each `: heartbeat` comment, each `id:`.
`request_bytes` writes the request; `Wire` parses the response (status line, headers,
chunked body, SSE framing) from whatever bytes arrive, without doing any I/O itself, so
both the blocking client (`SocketStream`) and asyncio streams can feed it.
"""
from __future__ import annotations

import asyncio
import json
import socket
import struct
from dataclasses import dataclass
from urllib.parse import urlsplit

PLATFORM_CHAT = "/api/v1/inference/chat"
OPENAI_CHAT = "/v1/chat/completions"


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def chat_body(max_tokens: int, content: str = "Count from one to one hundred.", **extra) -> dict:
    # ignore_eos: the stream has exactly max_tokens tokens, so a test knows which one is last.
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, **extra}


def request_bytes(url: str, path: str, key: str, body: dict, headers: dict[str, str] | None = None) -> bytes:
    host, port = host_port(url)
    payload = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Authorization: Bearer {key}",
             "Content-Type: application/json", "Accept: text/event-stream", f"Content-Length: {len(payload)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


@dataclass(frozen=True)
class Comment:
    text: str  # "heartbeat", "ok"


@dataclass(frozen=True)
class Event:
    id: int | None
    event: str | None
    data: str

    def json(self):
        return json.loads(self.data)


class Wire:
    """One HTTP response carrying an SSE stream, parsed as its bytes are fed in."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.ended = False  # the body is complete (last chunk, or Content-Length reached)
        self.body = b""  # a body that is not an event stream (an error)
        self._raw = b""
        self._sse = b""  # body bytes (de-chunked) not parsed into events yet
        self._fields: dict[str, str] = {}  # of the event being read
        self._chunked = False
        self._length: int | None = None
        self._received = 0  # body bytes, without chunked framing

    def feed(self, data: bytes) -> list[Comment | Event]:
        self._raw += data
        if self.status is None and not self._parse_head():
            return []
        if self.ended:
            return []
        if self._chunked:
            self._dechunk()
        else:
            self._sse += self._raw
            self._received += len(self._raw)
            self._raw = b""
            self.ended = self._length is not None and self._received >= self._length
        if not self.headers.get("content-type", "").startswith("text/event-stream"):
            self.body, self._sse = self.body + self._sse, b""
            return []
        return self._events()

    def _parse_head(self) -> bool:
        head, sep, rest = self._raw.partition(b"\r\n\r\n")
        if not sep:
            return False
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        for line in header_lines:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self._chunked = self.headers.get("transfer-encoding", "").lower() == "chunked"
        if "content-length" in self.headers:
            self._length = int(self.headers["content-length"])
        self._raw = rest
        return True

    def _dechunk(self) -> None:
        while not self.ended:
            size_line, sep, rest = self._raw.partition(b"\r\n")
            if not sep:
                return
            size = int(size_line.split(b";")[0], 16)
            if len(rest) < size + 2:
                return
            self._sse += rest[:size]
            self._raw = rest[size + 2:]
            self.ended = size == 0

    def _events(self) -> list[Comment | Event]:
        """Line by line, as the SSE spec reads a stream: a comment line counts when it arrives
        (the server's heartbeats end with one newline, not a blank line), an event at the blank
        line that ends it."""
        items: list[Comment | Event] = []
        while b"\n" in self._sse:
            raw, _, self._sse = self._sse.partition(b"\n")
            line = raw.decode("utf-8")
            if line.startswith(":"):
                items.append(Comment(line[1:].strip()))
                continue
            if not line:
                fields, self._fields = self._fields, {}
                if fields:
                    items.append(Event(int(fields["id"]) if "id" in fields else None, fields.get("event"), fields.get("data", "")))
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data" and name in self._fields:  # a multi-line data field
                value = self._fields[name] + "\n" + value
            self._fields[name] = value
        return items


def set_reset_on_close(sock: socket.socket) -> None:
    """SO_LINGER on with a zero timeout: close() then sends RST instead of FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class SocketStream:
    """A blocking SSE request over one socket: send, read item by item, close or reset."""

    def __init__(self, url: str, path: str, key: str, body: dict, headers: dict[str, str] | None = None,
                 timeout: float = 120.0) -> None:
        self.sock = socket.create_connection(host_port(url), timeout=timeout)
        self.sock.sendall(request_bytes(url, path, key, body, headers))
        self.wire = Wire()
        self._items: list[Comment | Event] = []

    def next(self) -> Comment | Event | None:
        """The next comment or event; None once the response has ended (or the server closed)."""
        while not self._items:
            if self.wire.ended:
                return None
            data = self.sock.recv(65536)
            if not data:
                return None
            self._items += self.wire.feed(data)
        return self._items.pop(0)

    def next_event(self) -> Event | None:
        while (item := self.next()) is not None and not isinstance(item, Event):
            pass
        return item

    def close(self, reset: bool = False) -> None:
        if reset:
            set_reset_on_close(self.sock)
        else:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # the server closed first
                pass
        self.sock.close()


class AsyncStream:
    """The same over asyncio streams, for many concurrent requests in one thread."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.wire = Wire()
        self._items: list[Comment | Event] = []

    @classmethod
    async def open(cls, url: str, path: str, key: str, body: dict, headers: dict[str, str] | None = None) -> AsyncStream:
        reader, writer = await asyncio.open_connection(*host_port(url))
        writer.write(request_bytes(url, path, key, body, headers))
        await writer.drain()
        return cls(reader, writer)

    async def next(self) -> Comment | Event | None:
        while not self._items:
            if self.wire.ended:
                return None
            data = await self.reader.read(65536)
            if not data:
                return None
            self._items += self.wire.feed(data)
        return self._items.pop(0)

    async def rest(self) -> list[Comment | Event]:
        """Every item up to the end of the response."""
        items = []
        while (item := await self.next()) is not None:
            items.append(item)
        return items

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:  # the server reset first
            pass
