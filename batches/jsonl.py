"""The JSONL formats of the Batch API: input lines in, output and error lines out.

An input line is `{"custom_id", "method": "POST", "url", "body"}`. Every line of an
uploaded file is checked here before any batch can use it: the line's shape, its
`custom_id` (present, unique in the file), its `url`, and its body with the same parser
the live endpoints use, so a line that would be refused at run time is refused at upload,
with its line number.
"""
from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from django.conf import settings

from inference import catalog, protocol
from tenants.errors import ApiError

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
LINE_FIELDS = {"custom_id", "method", "url", "body"}
MAX_CUSTOM_ID = 512
MAX_REPORTED = 20  # bad lines named in one error message
_PARSER_POSITION = re.compile(r"line 1 column (\d+) \(char \d+\)")


@dataclass(frozen=True)
class InputLine:
    line: int  # 1-based
    custom_id: str
    url: str
    body: dict[str, Any]


class FileRejected(ApiError):
    """An upload refused as a whole; `problems` lists (line number, what is wrong)."""

    def __init__(self, problems: list[tuple[int, str]], total: int) -> None:
        shown = "; ".join(f"line {n}: {what.rstrip('.')}" for n, what in problems[:MAX_REPORTED])
        more = f"; and {total - MAX_REPORTED} more" if total > MAX_REPORTED else ""
        super().__init__(400, f"The file has {total} invalid line(s): {shown}{more}.", code="invalid_file", param="file")
        self.problems = problems


def _check_line(data: Any) -> str | None:
    """What is wrong with one parsed input line, or None."""
    if not isinstance(data, dict):
        return "each line must be a JSON object"
    unknown = sorted(set(data) - LINE_FIELDS)
    if unknown:
        return f"unknown field(s) {', '.join(repr(k) for k in unknown)}"
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "'custom_id' must be a non-empty string"
    if len(custom_id) > MAX_CUSTOM_ID:
        return f"'custom_id' is longer than {MAX_CUSTOM_ID} characters"
    if data.get("method") != "POST":
        return "'method' must be \"POST\""
    if data.get("url") not in ENDPOINTS:
        return f"'url' must be one of {', '.join(ENDPOINTS)}"
    body = data.get("body")
    if not isinstance(body, dict):
        return "'body' must be a JSON object"
    return _check_body(data["url"], body)


def _check_body(url: str, body: dict) -> str | None:
    try:
        request = protocol.parse_chat(body) if ENDPOINTS[url] == "chat" else protocol.parse_completion(body)
    except ApiError as error:
        return f"body: {error.message}"
    if request.stream:
        return "body: 'stream' must be false or absent in a batch"
    served = catalog.served_model_id()
    if request.model is not None and request.model != served:
        return f"body: the model '{request.model}' does not exist; this server serves '{served}'"
    return None


def _parse_line(raw: str) -> dict:
    return protocol.parse_body(raw.encode())


CHUNK_BYTES = 64 * 1024  # read size while splitting a file into lines


def _raw_lines(source: BinaryIO, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(offset, line without its end) for each line of `source`, read in chunks; None for a
    line longer than `max_line_bytes`, which is skipped unread so no line costs more memory."""
    offset, start, tail, too_long = 0, 0, b"", False
    while chunk := source.read(CHUNK_BYTES):
        pieces = chunk.split(b"\n")
        for piece in pieces[:-1]:
            line = None if too_long or len(tail) + len(piece) > max_line_bytes else tail + piece
            yield start, line.removesuffix(b"\r") if line is not None else None
            offset += len(piece) + 1
            start, tail, too_long = offset, b"", False
        rest = pieces[-1]
        offset += len(rest)
        if too_long or len(tail) + len(rest) > max_line_bytes:
            tail, too_long = b"", True
        else:
            tail += rest
    if tail or too_long:
        yield start, None if too_long else tail.removesuffix(b"\r")


def too_many_lines(max_lines: int) -> ApiError:
    return ApiError(400, f"The file has more than {max_lines} lines (blank lines count).", code="too_many_lines",
                    param="file")


def parse_input(source: bytes | BinaryIO, max_lines: int, max_line_bytes: int | None = None) -> list[InputLine]:
    """Every line of an uploaded batch file, or `FileRejected` naming the bad ones.

    Reads the file line by line: memory grows with the requests kept, never with the
    file's size. Every line counts towards `max_lines`, blank ones too: a file of
    millions of empty lines is as much work to read as one of requests."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    if max_line_bytes is None:
        max_line_bytes = settings.MAX_REQUEST_BYTES
    lines: list[InputLine] = []
    problems: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    for number, (offset, raw) in enumerate(_raw_lines(source, max_line_bytes), start=1):
        if number > max_lines:
            raise too_many_lines(max_lines)
        if raw is None:
            problems.append((number, f"the line is longer than {max_line_bytes} bytes"))
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(400, f"The file is not valid UTF-8 (byte {offset + exc.start}).", code="invalid_file",
                           param="file") from None
        if not text.strip():
            continue
        try:
            data = _parse_line(text)
        except ApiError as error:
            # The JSON parser counts lines inside the one line it saw: keep only its column.
            message = _PARSER_POSITION.sub(r"column \1", error.message)
            problems.append((number, message.replace("The request body", "the line")))
            continue
        problem = _check_line(data)
        if problem is None and data["custom_id"] in seen:
            problem = f"duplicate custom_id {data['custom_id']!r} (first on line {seen[data['custom_id']]})"
        if problem is not None:
            problems.append((number, problem))
            continue
        seen[data["custom_id"]] = number
        lines.append(InputLine(number, data["custom_id"], data["url"], data["body"]))
    if problems:
        raise FileRejected(problems, len(problems))
    if not lines:
        raise ApiError(400, "The file has no requests.", code="empty_file", param="file")
    return lines


def parse_stored(content: bytes) -> list[InputLine]:
    """The lines of a file that passed `parse_input` at upload."""
    return parse_input(content, max_lines=10**9, max_line_bytes=len(content))


def output_line(item_id: str, custom_id: str, status_code: int | None, request_id: str,
                response: Any, error: dict | None) -> str:
    """One line of an output or error file, in OpenAI's format."""
    body = None if status_code is None else {"status_code": status_code, "request_id": request_id, "body": response}
    return json.dumps({"id": item_id, "custom_id": custom_id, "response": body, "error": error}, separators=(",", ":"))
