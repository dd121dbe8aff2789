"""An OpenAI-shaped error written straight onto a connection, for the hooks that answer before
daphne builds a request an application (a body over its limit, a request that never finished
arriving, a tenant past its in-flight bound): the same bytes an application's JSON error has,
and the connection closed after them."""
from __future__ import annotations

import json
from http import HTTPStatus


def error_bytes(status: int, message: str, code: str) -> bytes:
    """An invalid_request_error naming no parameter."""
    return response_bytes(status, {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                             "code": code}})


def response_bytes(status: int, body: dict, headers: dict[str, str] | None = None) -> bytes:
    """HTTP/1.1 `status` with `body` as JSON, then `headers`, and Connection: close."""
    data = json.dumps(body).encode()
    fields = {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {}),
              "Connection": "close"}
    head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    return (head + "\r\n").encode("latin-1") + data
