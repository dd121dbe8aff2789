"""Bad input, over raw HTTP, against the live server: every malformed, mistyped, out-of-range,
oversized or forbidden request is a 4xx in the OpenAI error shape
(`{"error": {"message", "type", "param", "code"}}`) naming the parameter at fault, never a
500 and never a dropped connection; and the engine serves a good request right after each.

Raw HTTP (http.client, and sockets where the framing itself is the test: chunked bodies, a
Content-Length that lies, `Expect: 100-continue`), because the openai client refuses to send
most of these.
"""
from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest

from tests.live import LiveServer

TENANT = "valid"  # lane P1, max_tokens 512 per request
LANE_2_TENANT = "valid-p2"  # lane P2: may not ask for P0 or P1
TIGHT_TENANT = "valid-tight"  # 3 requests/min, max_tokens 64 per request: at most 3 requests here
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PLATFORM = "/api/v1/inference/chat"
CONTEXT = 8192  # SmolLM2's context, in tokens
HI = [{"role": "user", "content": "hi"}]
ANY = object()


# --- raw HTTP --------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)  # names lower-cased
    body: bytes = b""

    def json(self):
        return json.loads(self.body)


def _address(live: LiveServer) -> tuple[str, int]:
    parts = urlsplit(live.url)
    return parts.hostname, parts.port


def post(live: LiveServer, path: str, body: bytes | dict, tenant: str | None = TENANT,
         headers: dict[str, str] | None = None, method: str = "POST") -> Reply:
    """One request with http.client (which sets Content-Length to the real length)."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(*_address(live), timeout=120)
    try:
        sent = {"Content-Type": "application/json", **(headers or {})}
        if tenant is not None:
            sent["Authorization"] = f"Bearer {live.keys[tenant]}"
        conn.request(method, path, body=payload, headers=sent)
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


def head_bytes(live: LiveServer, path: str, headers: dict[str, str], tenant: str = TENANT) -> bytes:
    host, port = _address(live)
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Authorization: Bearer {live.keys[tenant]}",
             "Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class _KeepOpen:
    """The socket's reader, lent to http.client without letting it close (and drop) the buffer,
    so the bytes after one response can still be read."""

    def __init__(self, reader) -> None:
        self._reader = reader

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def close(self) -> None:
        pass


class _Lent:
    def __init__(self, reader) -> None:
        self._reader = reader

    def makefile(self, *args, **kwargs):
        return _KeepOpen(self._reader)


class RawConnection:
    """A socket that sends exactly the bytes given and parses the responses it gets back."""

    def __init__(self, live: LiveServer) -> None:
        self.sock = socket.create_connection(_address(live), timeout=60)
        self.reader = self.sock.makefile("rb")

    def send(self, *parts: bytes) -> None:
        for part in parts:
            self.sock.sendall(part)

    def status_line(self) -> bytes:
        return self.reader.readline()

    def reply(self) -> Reply:
        response = http.client.HTTPResponse(_Lent(self.reader))
        response.begin()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())

    def rest(self) -> bytes:
        """Whatever the server sends until it closes the connection."""
        return self.reader.read()

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def chunked(payload: bytes, size: int = 16 * 1024) -> list[bytes]:
    parts = [b"%x\r\n%s\r\n" % (len(payload[i:i + size]), payload[i:i + size]) for i in range(0, len(payload), size)]
    return [*parts, b"0\r\n\r\n"]


# --- assertions ------------------------------------------------------------------------------


def assert_error(reply: Reply, status: int, code: str | None, param=ANY, type: str = ANY) -> dict:
    assert reply.status == status, (reply.status, reply.body[:500])
    assert reply.headers.get("content-type", "").startswith("application/json"), reply.headers
    body = reply.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["code"] == code, error
    if param is not ANY:
        assert error["param"] == param, error
    if type is not ANY:
        assert error["type"] == type, error
    return error


def assert_serves(live: LiveServer, tenant: str = TENANT) -> None:
    """A good request right after a bad one is answered in full."""
    reply = post(live, CHAT, {"messages": HI, "max_tokens": 1, "temperature": 0}, tenant)
    assert reply.status == 200, (reply.status, reply.body[:500])
    body = reply.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 1


def limit(live: LiveServer) -> int:
    return int(live.env["MAX_REQUEST_BYTES"])


def long_text(tokens: int) -> str:
    """About `tokens` tokens: "hello world " is two SmolLM2 tokens."""
    return "hello world " * (tokens // 2)


# --- bodies that are not a JSON object ---------------------------------------------------------

GOOD_CHAT = json.dumps({"messages": HI, "max_tokens": 1}).encode()

BODIES = {
    "truncated JSON": (b'{"messages": [{"role": "user", "content": "hi"}', "invalid_json"),
    "trailing garbage": (GOOD_CHAT + b" xyz", "invalid_json"),
    "a JSON array": (b'[{"messages": [{"role": "user", "content": "hi"}]}]', "invalid_json"),
    "a JSON string": (b'"hi"', "invalid_json"),
    "a JSON number": (b"42", "invalid_json"),
    "JSON null": (b"null", "invalid_json"),
    "an empty body": (b"", "invalid_json"),
    "a blank body": (b" \r\n\t ", "invalid_json"),
    "NaN": (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "invalid_json"),
    "Infinity": (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": Infinity}', "invalid_json"),
    "a number too large for a double": (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}',
                                        "invalid_json"),
    "nesting deeper than the parser's stack": (b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "invalid_json"),
    "invalid UTF-8": (b'{"messages": [{"role": "user", "content": "caf\xe9 \xff\xfe"}]}', "invalid_encoding"),
    "an overlong UTF-8 encoding": (b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}', "invalid_encoding"),
    "a lone high surrogate escape": (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "invalid_encoding"),
    "a lone low surrogate escape": (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "invalid_encoding"),
    "a lone surrogate in a key": (b'{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}',
                                  "invalid_encoding"),
}


# The body is parsed before the endpoint matters: every case on chat, a few on the other two.
BODY_CASES = [(CHAT, name) for name in BODIES] + [
    (path, name) for path in (COMPLETIONS, PLATFORM)
    for name in ("truncated JSON", "a JSON array", "an empty body", "invalid UTF-8", "a lone high surrogate escape")
]


@pytest.mark.parametrize(("path", "name"), BODY_CASES, ids=[f"{p} {n}" for p, n in BODY_CASES])
def test_a_body_that_is_not_a_json_object_is_refused(live: LiveServer, path: str, name: str):
    body, code = BODIES[name]
    assert_error(post(live, path, body), 400, code, param=None, type="invalid_request_error")
    assert_serves(live)


def test_a_surrogate_pair_escape_is_a_valid_character(live: LiveServer):
    body = b'{"messages": [{"role": "user", "content": "Say \\ud83d\\ude00"}], "max_tokens": 1}'
    reply = post(live, CHAT, body)
    assert reply.status == 200, reply.body
    assert reply.json()["usage"]["completion_tokens"] == 1


# --- fields: missing, mistyped, out of range, unknown -----------------------------------------


def chat(**fields) -> dict:
    return {"messages": HI, "max_tokens": 1, **fields}


def completion(**fields) -> dict:
    return {"prompt": "Once upon a time", "max_tokens": 1, **fields}


def _without(body: dict, name: str) -> dict:
    return {k: v for k, v in body.items() if k != name}


# (name, path, body, status, code, param)
FIELDS = [
    ("unknown model", CHAT, chat(model="gpt-4o"), 404, "model_not_found", "model"),
    ("unknown model, completions", COMPLETIONS, completion(model="davinci-002"), 404, "model_not_found", "model"),
    ("model not a string", CHAT, chat(model=7), 400, "invalid_type", "model"),
    ("no messages", CHAT, _without(chat(), "messages"), 400, "missing_required_parameter", "messages"),
    ("empty messages", CHAT, chat(messages=[]), 400, "empty_array", "messages"),
    ("messages a string", CHAT, chat(messages="hi"), 400, "invalid_type", "messages"),
    ("messages an object", CHAT, chat(messages={"role": "user", "content": "hi"}), 400, "invalid_type", "messages"),
    ("a message not an object", CHAT, chat(messages=["hi"]), 400, "invalid_type", "messages[0]"),
    ("an unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "invalid_value",
     "messages[0].role"),
    ("no role", CHAT, chat(messages=[{"content": "hi"}]), 400, "invalid_value", "messages[0].role"),
    ("content a number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "invalid_type",
     "messages[0].content"),
    ("content an object", CHAT, chat(messages=[{"role": "user", "content": {"text": "hi"}}]), 400, "invalid_type",
     "messages[0].content"),
    ("no content", CHAT, chat(messages=[{"role": "user"}]), 400, "missing_required_parameter", "messages[0].content"),
    ("an image part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]), 400, "unsupported_content",
     "messages[0].content[0]"),
    ("a text part whose text is a number", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": 5}]}]), 400, "invalid_type", "messages[0].content[0].text"),
    ("every message empty", CHAT, chat(messages=[{"role": "user", "content": ""}]), 400, "empty_prompt", "messages"),
    ("temperature a string", CHAT, chat(temperature="hot"), 400, "invalid_type", "temperature"),
    ("temperature a boolean", CHAT, chat(temperature=True), 400, "invalid_type", "temperature"),
    ("temperature above 2", CHAT, chat(temperature=2.5), 400, "invalid_value", "temperature"),
    ("top_p 0", CHAT, chat(top_p=0), 400, "invalid_value", "top_p"),
    ("max_tokens a string", CHAT, chat(max_tokens="5"), 400, "invalid_type", "max_tokens"),
    ("max_tokens a boolean", CHAT, chat(max_tokens=True), 400, "invalid_type", "max_tokens"),
    ("max_tokens a fraction", CHAT, chat(max_tokens=2.5), 400, "invalid_type", "max_tokens"),
    ("max_tokens 0", CHAT, chat(max_tokens=0), 400, "invalid_value", "max_tokens"),
    ("max_tokens negative", CHAT, chat(max_tokens=-1), 400, "invalid_value", "max_tokens"),
    ("max_tokens 0, completions", COMPLETIONS, completion(max_tokens=0), 400, "invalid_value", "max_tokens"),
    ("max_tokens above the tier's 512", CHAT, chat(max_tokens=513), 400, "max_tokens_exceeded", "max_tokens"),
    ("max_completion_tokens above the tier's 512", CHAT, _without(chat(max_completion_tokens=513), "max_tokens"), 400,
     "max_tokens_exceeded", "max_completion_tokens"),
    ("max_tokens and max_completion_tokens disagree", CHAT, chat(max_completion_tokens=2), 400, "invalid_value", ANY),
    ("n 0", CHAT, chat(n=0), 400, "invalid_value", "n"),
    ("n 17", CHAT, chat(n=17), 400, "invalid_value", "n"),
    ("seed a fraction", CHAT, chat(seed=1.5), 400, "invalid_type", "seed"),
    ("seed beyond 64 bits", CHAT, chat(seed=2**70), 400, "invalid_value", "seed"),
    ("five stop sequences", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "invalid_value", "stop"),
    ("an empty stop sequence", CHAT, chat(stop=[""]), 400, "invalid_value", "stop"),
    ("stop a number", CHAT, chat(stop=5), 400, "invalid_type", "stop"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "invalid_value", "top_logprobs"),
    ("top_logprobs 21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "invalid_value", "top_logprobs"),
    ("logprobs a string", CHAT, chat(logprobs="yes"), 400, "invalid_type", "logprobs"),
    ("stream a string", CHAT, chat(stream="yes"), 400, "invalid_type", "stream"),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400, "invalid_value",
     "stream_options"),
    ("an unknown stream option", CHAT, chat(stream=True, stream_options={"bogus": 1}), 400, "unknown_parameter",
     "stream_options"),
    ("an unknown field", CHAT, chat(frobnicate=1), 400, "unknown_parameter", "frobnicate"),
    ("a misspelt field", CHAT, chat(max_token=5), 400, "unknown_parameter", "max_token"),
    ("legacy functions", CHAT, chat(functions=[{"name": "f"}]), 400, "unsupported_parameter", "functions"),
    ("tool_choice without tools", CHAT, chat(tool_choice="required"), 400, "invalid_value", "tool_choice"),
    ("a tool that is not a function", CHAT, chat(tools=[{"type": "retrieval"}]), 400, "invalid_value", "tools[0]"),
    ("a non-empty logit_bias", CHAT, chat(logit_bias={"50256": -100}), 400, "unsupported_parameter", "logit_bias"),
    ("response_format a string", CHAT, chat(response_format="json"), 400, "invalid_type", "response_format"),
    ("an unknown response_format type", CHAT, chat(response_format={"type": "yaml"}), 400, "invalid_value",
     "response_format.type"),
    ("json_schema without its object", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "missing_required_parameter", "response_format.json_schema"),
    ("a json_schema name with a space", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}), 400, "invalid_value",
     "response_format.json_schema.name"),
    ("a schema of an unknown type", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "strnig"}}}), 400,
     "invalid_schema", "response_format.json_schema.schema"),
    ("a schema with a keyword the grammar engine lacks", COMPLETIONS,
     completion(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"not": {}}}}), 400,
     "invalid_schema", "response_format.json_schema.schema"),
    ("priority a string", CHAT, chat(priority="high"), 400, "invalid_type", "priority"),
    ("priority 3", CHAT, chat(priority=3), 400, "invalid_value", "priority"),
    ("a streamed request with a bad field", CHAT, chat(stream=True, temperature="hot"), 400, "invalid_type",
     "temperature"),
    ("no prompt", COMPLETIONS, _without(completion(), "prompt"), 400, "missing_required_parameter", "prompt"),
    ("an empty prompt", COMPLETIONS, completion(prompt=""), 400, "empty_prompt", "prompt"),
    ("an empty prompt list", COMPLETIONS, completion(prompt=[]), 400, "empty_prompt", "prompt"),
    ("one empty prompt of two", COMPLETIONS, completion(prompt=["Once", ""]), 400, "empty_prompt", "prompt"),
    ("a prompt that is a number", COMPLETIONS, completion(prompt=5), 400, "invalid_type", "prompt"),
    ("a prompt of mixed types", COMPLETIONS, completion(prompt=["Once", 5]), 400, "invalid_type", "prompt"),
    ("a token id outside the vocabulary", COMPLETIONS, completion(prompt=[1, 2, 10**8]), 400, "invalid_token_id",
     "prompt"),
    ("a negative token id", COMPLETIONS, completion(prompt=[1, -2]), 400, "invalid_token_id", "prompt"),
    ("65 prompts", COMPLETIONS, completion(prompt=["a"] * 65), 400, "invalid_value", "prompt"),
    ("logprobs 6 on completions", COMPLETIONS, completion(logprobs=6), 400, "invalid_value", "logprobs"),
    ("echo a string", COMPLETIONS, completion(echo="yes"), 400, "invalid_type", "echo"),
    ("suffix", COMPLETIONS, completion(suffix="The end."), 400, "unsupported_parameter", "suffix"),
    ("messages sent to completions", COMPLETIONS, completion(messages=HI), 400, "unknown_parameter", "messages"),
    ("prompt sent to chat", CHAT, chat(prompt="hi"), 400, "unknown_parameter", "prompt"),
    ("empty messages, platform stream", PLATFORM, chat(messages=[]), 400, "empty_array", "messages"),
    ("max_tokens 0, platform stream", PLATFORM, chat(max_tokens=0), 400, "invalid_value", "max_tokens"),
    ("unknown model, platform stream", PLATFORM, chat(model="gpt-4o"), 404, "model_not_found", "model"),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "code", "param"), FIELDS, ids=[f[0] for f in FIELDS])
def test_a_bad_field_is_refused_naming_it(live: LiveServer, name, path, body, status, code, param):
    assert_error(post(live, path, body), status, code, param=param, type="invalid_request_error")
    assert_serves(live)


def test_a_tier_limit_on_max_tokens_names_that_tiers_limit(live: LiveServer):
    error = assert_error(post(live, CHAT, chat(max_tokens=65), TIGHT_TENANT), 400, "max_tokens_exceeded", "max_tokens")
    assert "64" in error["message"]
    # The limit itself is allowed (a stop sequence keeps the answer short).
    reply = post(live, CHAT, chat(max_tokens=64, temperature=0, stop=[" "]), TIGHT_TENANT)
    assert reply.status == 200, reply.body
    assert 1 <= reply.json()["usage"]["completion_tokens"] <= 64


# --- the context ----------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"messages": [{"role": "user", "content": long_text(CONTEXT + 500)}], "max_tokens": 1}, "messages"),
    (COMPLETIONS, {"prompt": long_text(CONTEXT + 500), "max_tokens": 1}, "prompt"),
    (COMPLETIONS, {"prompt": ["short", long_text(CONTEXT + 500)], "max_tokens": 1}, "prompt"),
    (PLATFORM, {"messages": [{"role": "user", "content": long_text(CONTEXT + 500)}], "max_tokens": 1}, "messages"),
    # The prompt fits; the prompt and the completion it asks for do not.
    (COMPLETIONS, {"prompt": long_text(CONTEXT - 100), "max_tokens": 500}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": long_text(CONTEXT - 200)}], "max_tokens": 500}, "max_tokens"),
], ids=["chat", "completions", "the second of two prompts", "platform stream", "completions + max_tokens",
        "chat + max_tokens"])
def test_a_prompt_longer_than_the_context_is_refused(live: LiveServer, path, body, param):
    error = assert_error(post(live, path, body), 400, "context_length_exceeded", param)
    assert str(CONTEXT) in error["message"]
    assert_serves(live)


# --- lanes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("priority", [0, 1])
def test_a_priority_better_than_the_tiers_lane_is_forbidden(live: LiveServer, priority: int):
    error = assert_error(post(live, CHAT, chat(priority=priority), LANE_2_TENANT), 403, "priority_not_allowed",
                         "priority", type="permission_error")
    assert f"P{priority}" in error["message"]
    assert_serves(live, LANE_2_TENANT)


def test_an_x_priority_header_better_than_the_tiers_lane_is_forbidden(live: LiveServer):
    reply = post(live, PLATFORM, chat(), LANE_2_TENANT, headers={"X-Priority": "0"})
    assert_error(reply, 403, "priority_not_allowed", "X-Priority", type="permission_error")
    assert_error(post(live, PLATFORM, chat(), LANE_2_TENANT, headers={"X-Priority": "urgent"}), 400, "invalid_value",
                 "X-Priority")
    assert_serves(live, LANE_2_TENANT)


def test_a_worse_lane_than_the_tiers_is_granted(live: LiveServer):
    reply = post(live, CHAT, chat(priority=2), TENANT)
    assert reply.status == 200, reply.body
    assert reply.headers["x-lane"] == "P2"
    reply = post(live, PLATFORM, chat(), TENANT, headers={"X-Priority": "2"})
    assert reply.status == 200, reply.body
    assert reply.headers["x-lane"] == "P2"
    assert b"event: done" in reply.body


# --- method and key -------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, PLATFORM])
def test_a_get_is_refused(live: LiveServer, path: str):
    assert_error(post(live, path, b"", method="GET"), 405, "method_not_allowed")


def test_a_missing_or_wrong_key_is_refused(live: LiveServer):
    reply = post(live, CHAT, chat(), tenant=None)
    assert_error(reply, 401, "missing_api_key")
    assert reply.headers["www-authenticate"] == "Bearer"
    reply = post(live, CHAT, chat(), tenant=None, headers={"Authorization": "Bearer sk-not-a-key-of-this-server"})
    assert_error(reply, 401, "invalid_api_key")
    assert_serves(live)


# --- body size and framing ------------------------------------------------------------------


def padded_chat(size: int) -> bytes:
    """A good chat body of exactly `size` bytes (JSON whitespace pads it)."""
    body = json.dumps(chat(temperature=0)).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def test_a_body_at_the_limit_is_served_and_one_byte_more_is_refused(live: LiveServer):
    at_limit = padded_chat(limit(live))
    assert len(at_limit) == limit(live)
    reply = post(live, CHAT, at_limit)
    assert reply.status == 200, reply.body[:500]
    error = assert_error(post(live, CHAT, padded_chat(limit(live) + 1)), 413, "request_too_large", None)
    assert str(limit(live)) in error["message"]
    assert_serves(live)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, PLATFORM])
def test_a_body_over_the_limit_is_refused(live: LiveServer, path: str):
    body = {"messages": [{"role": "user", "content": "x" * (limit(live) + 1000)}], "max_tokens": 1}
    if path == COMPLETIONS:
        body = {"prompt": "x" * (limit(live) + 1000), "max_tokens": 1}
    assert_error(post(live, path, body), 413, "request_too_large", None)
    assert_serves(live)


@pytest.mark.parametrize(("size", "status"), [(-1, 200), (+1, 413)], ids=["under", "over"])
def test_a_chunked_body_without_content_length_is_held_to_the_limit(live: LiveServer, size: int, status: int):
    conn = RawConnection(live)
    try:
        conn.send(head_bytes(live, CHAT, {"Transfer-Encoding": "chunked"}), *chunked(padded_chat(limit(live) + size)))
        reply = conn.reply()
    finally:
        conn.close()
    if status == 413:
        assert_error(reply, 413, "request_too_large", None)
    else:
        assert reply.status == 200, reply.body[:500]
    assert_serves(live)


def test_a_content_length_over_the_limit_is_refused(live: LiveServer):
    body = padded_chat(limit(live) + 1)
    conn = RawConnection(live)
    try:
        conn.send(head_bytes(live, CHAT, {"Content-Length": str(len(body))}), body)
        assert_error(conn.reply(), 413, "request_too_large", None)
    finally:
        conn.close()
    assert_serves(live)


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_sent(live: LiveServer):
    """curl and most HTTP clients send `Expect: 100-continue` before a large body and wait. The
    headers already say the body is 40 times the limit, so the answer is a 413 now, not a
    `100 Continue` inviting 10 MiB that will be read in full and then refused."""
    conn = RawConnection(live)
    try:
        conn.send(head_bytes(live, CHAT, {"Content-Length": str(40 * limit(live)), "Expect": "100-continue"}))
        status_line = conn.status_line()
    finally:
        conn.close()
    assert status_line.startswith(b"HTTP/1.1 413"), (
        f"the server answered {status_line!r} to a request declaring {40 * limit(live)} bytes "
        f"(limit {limit(live)}): it asks for the whole body before refusing it"
    )
    assert_serves(live)


def test_an_understated_content_length_cuts_the_body_where_it_says(live: LiveServer):
    """The server reads as many bytes as Content-Length declares, so a body cut short is
    invalid JSON (400); the bytes left over are not a request, which the server refuses or
    ignores by closing the connection; nothing is a 5xx."""
    body = json.dumps(chat(temperature=0)).encode()
    conn = RawConnection(live)
    try:
        conn.send(head_bytes(live, CHAT, {"Content-Length": str(len(body) - 10)}), body + b"\r\n\r\n")
        assert_error(conn.reply(), 400, "invalid_json", None)
        rest = conn.rest()
    finally:
        conn.close()
    assert rest == b"" or rest.startswith(b"HTTP/1.1 400"), rest[:200]
    assert_serves(live)


def test_an_understated_content_length_over_a_complete_object_serves_that_object(live: LiveServer):
    body = json.dumps(chat(temperature=0)).encode()
    conn = RawConnection(live)
    try:
        conn.send(head_bytes(live, CHAT, {"Content-Length": str(len(body))}), body + b"GARBAGE\r\n\r\n")
        reply = conn.reply()
        assert reply.status == 200, reply.body[:500]
        assert reply.json()["usage"]["completion_tokens"] == 1
        rest = conn.rest()
    finally:
        conn.close()
    assert rest == b"" or rest.startswith(b"HTTP/1.1 400"), rest[:200]
    assert_serves(live)
