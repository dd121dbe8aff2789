"""A tenant's large JSON schemas are checked off the event loop (issue 24: no tenant slows another).

Checking a `response_format` schema (or a tool's parameters) is llguidance compiling it: ~40 ms
for the ~55 KB schemas below, under STRUCTURED_MAX_SCHEMA_BYTES. Checked on the event loop, a
tenant's sixteen of them stopped every stream of the process in turn: another tenant's chat sent
just after them had its first token only after all sixteen were answered. The order of the
answers is what is asserted, not how long anything took.
"""
from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

from tests.live import LiveServer
from tests.serving.rawsse import SocketStream, chat_body, host_port, request_bytes

ATTACKS = 16
TIMEOUT_S = 120  # a hang guard, not a timing assertion


def schema_that_fails_late(i: int) -> dict:
    """~55 KB of properties (their own names: nothing is cached), then a pattern llguidance cannot
    parse: the check does most of the work before it refuses the schema."""
    fields = {f"f{i}_{j}": {"type": ["string", "integer", "array"],
                            "items": {"type": "string", "pattern": f"[a-z]{{3,{5 + j % 50}}}"}} for j in range(520)}
    fields["last"] = {"type": "string", "pattern": "[a-"}
    return {"type": "object", "properties": fields}


def _refused_at(live: LiveServer, sock: socket.socket) -> tuple[float, int, dict]:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return time.monotonic(), int(head.split(b" ", 2)[1]), body


def _first_token_at(stream: SocketStream) -> float | None:
    try:
        while (event := stream.next_event()) is not None and event.data != "[DONE]":
            if any(c.get("delta", {}).get("content") for c in event.json().get("choices", ())):
                return time.monotonic()
        return None
    finally:
        stream.close()


def test_a_tenants_large_schemas_hold_up_no_other_tenants_first_token(hostile_live: LiveServer):
    key = hostile_live.keys["schemas"]
    sockets = []
    for i in range(ATTACKS):
        body = chat_body(4, "Hi.", stream=True, response_format={
            "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema_that_fails_late(i)}})
        sock = socket.create_connection(host_port(hostile_live.url), timeout=TIMEOUT_S)
        sock.sendall(request_bytes(hostile_live.url, "/v1/chat/completions", key, body))
        sockets.append(sock)
    bystander = SocketStream(hostile_live.url, "/v1/chat/completions", hostile_live.keys["schemas-bystander"],
                             chat_body(4, "Hi.", stream=True))
    with ThreadPoolExecutor(ATTACKS + 1) as pool:
        first = pool.submit(_first_token_at, bystander)
        refusals = list(pool.map(lambda s: _refused_at(hostile_live, s), sockets))
        first_token = first.result(TIMEOUT_S)

    for _, status, body in refusals:
        assert status == 400 and b'"invalid_schema"' in body, (status, body[:300])
    assert first_token is not None
    last_refusal = max(at for at, _, _ in refusals)
    assert first_token < last_refusal, "the other tenant's first token waited for every schema's check"
