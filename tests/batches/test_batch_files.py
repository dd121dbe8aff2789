"""The batch input format, without a server: `parse_input` accepts what the endpoints would
accept and refuses everything else at upload, naming each bad line by its number, so a
user can fix the file instead of finding out hours later; `output_line` writes OpenAI's
output/error line format."""
from __future__ import annotations

import json

import pytest

from batches.jsonl import MAX_CUSTOM_ID, FileRejected, InputLine, output_line, parse_input
from inference import catalog
from tenants.errors import ApiError

CHAT_URL, COMPLETION_URL = "/v1/chat/completions", "/v1/completions"


def chat(custom_id: str = "c-1", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL,
            "body": {"model": catalog.served_model_id(), "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 5, **body}}


def completion(custom_id: str = "p-1", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETION_URL,
            "body": {"model": catalog.served_model_id(), "prompt": "Once upon", "max_tokens": 5, **body}}


def jsonl(*lines: dict | str) -> bytes:
    """A file of the given lines: dicts as JSON, strings as they are (raw or blank)."""
    return ("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n").encode()


def rejected(content: bytes, max_lines: int = 100) -> FileRejected:
    with pytest.raises(FileRejected) as caught:
        parse_input(content, max_lines)
    error = caught.value
    assert (error.status, error.type, error.code, error.param) == (400, "invalid_request_error", "invalid_file", "file")
    return error


def refused(content: bytes, max_lines: int = 100) -> ApiError:
    """A refusal of the file as a whole (not line by line)."""
    with pytest.raises(ApiError) as caught:
        parse_input(content, max_lines)
    assert not isinstance(caught.value, FileRejected)
    assert caught.value.status == 400 and caught.value.param == "file"
    return caught.value


# --- accepted -----------------------------------------------------------------------------


def test_chat_and_completion_lines_are_parsed_with_their_line_numbers():
    lines = parse_input(jsonl(chat("a"), completion("b", temperature=0.5)), max_lines=10)
    assert lines == [
        InputLine(1, "a", CHAT_URL, chat("a")["body"]),
        InputLine(2, "b", COMPLETION_URL, completion("b", temperature=0.5)["body"]),
    ]


def test_a_line_without_a_model_is_accepted():
    line = chat("a")
    del line["body"]["model"]
    assert [p.custom_id for p in parse_input(jsonl(line), max_lines=10)] == ["a"]


def test_blank_lines_are_skipped_but_still_counted_in_line_numbers():
    lines = parse_input(jsonl("", chat("a"), "   ", "\t", chat("b"), ""), max_lines=6)
    assert [(p.line, p.custom_id) for p in lines] == [(2, "a"), (5, "b")]


def test_windows_line_endings_are_accepted():
    content = json.dumps(chat("a")).encode() + b"\r\n" + json.dumps(chat("b")).encode() + b"\r\n"
    assert [p.custom_id for p in parse_input(content, max_lines=10)] == ["a", "b"]


# --- each kind of bad line, reported with its line number ------------------------------------


def _without(line: dict, key: str) -> dict:
    return {k: v for k, v in line.items() if k != key}


def _with_body(**changes) -> dict:
    line = chat("bad")
    body = {k: v for k, v in {**line["body"], **changes}.items() if v is not None}
    return {**line, "body": body}


BAD_LINES = {
    "not JSON": ('{"custom_id": "x", "method": "POST",', "not valid JSON"),
    "not an object": ('["custom_id", "x"]', "must be a JSON object"),
    "a JSON string": ('"just text"', "must be a JSON object"),
    "custom_id missing": (_without(chat(), "custom_id"), "'custom_id' must be a non-empty string"),
    "custom_id empty": (chat(""), "'custom_id' must be a non-empty string"),
    "custom_id not a string": ({**chat(), "custom_id": 7}, "'custom_id' must be a non-empty string"),
    "custom_id too long": (chat("x" * (MAX_CUSTOM_ID + 1)), f"longer than {MAX_CUSTOM_ID} characters"),
    "method GET": ({**chat(), "method": "GET"}, "'method' must be \"POST\""),
    "method missing": (_without(chat(), "method"), "'method' must be \"POST\""),
    "url not allowed": ({**chat(), "url": "/v1/embeddings"}, "'url' must be one of /v1/chat/completions, /v1/completions"),
    "body not an object": ({**chat(), "body": "hello"}, "'body' must be a JSON object"),
    "body missing": (_without(chat(), "body"), "'body' must be a JSON object"),
    "temperature 5": (_with_body(temperature=5), "temperature"),
    "messages missing": (_with_body(messages=None), "'messages'"),
    "completion body on the chat url": ({**completion(), "url": CHAT_URL}, "prompt"),
    "stream true": (_with_body(stream=True), "'stream' must be false or absent in a batch"),
    "unknown model": (_with_body(model="gpt-4o"), "the model 'gpt-4o' does not exist"),
    "unknown top-level field": ({**chat(), "headers": {}}, "unknown field(s) 'headers'"),
}


@pytest.mark.parametrize("bad, expected", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_a_bad_line_is_refused_with_its_line_number(bad, expected):
    error = rejected(jsonl(chat("ok-1"), "", bad, chat("ok-2")))
    assert error.problems == [(3, error.problems[0][1])]
    assert expected in error.problems[0][1]
    assert error.message.startswith("The file has 1 invalid line(s): line 3: ")
    assert expected in error.message


def test_a_completion_line_is_checked_with_the_completion_rules():
    error = rejected(jsonl(completion("a"), completion("b", prompt="")))
    assert error.problems[0][0] == 2 and "'prompt' must not be an empty string" in error.message


def test_stream_false_is_accepted():
    assert len(parse_input(jsonl(chat("a", stream=False)), max_lines=10)) == 1


def test_every_bad_line_is_named_not_only_the_first():
    error = rejected(jsonl(chat("a"), "nope", chat("b"), {**chat("c"), "method": "PUT"}, chat("d", temperature=5)))
    assert [n for n, _ in error.problems] == [2, 4, 5]
    assert error.message.startswith("The file has 3 invalid line(s): line 2: ")
    assert "; line 4: 'method' must be \"POST\"; line 5: body: " in error.message


def test_a_duplicate_custom_id_is_refused_naming_both_lines():
    error = rejected(jsonl(chat("same"), chat("other"), "", completion("same")))
    assert error.problems == [(4, "duplicate custom_id 'same' (first on line 1)")]
    assert "line 4: duplicate custom_id 'same' (first on line 1)" in error.message


def test_more_than_twenty_bad_lines_says_how_many_more():
    error = rejected(jsonl(*(f"bad {i}" for i in range(25))))
    assert len(error.problems) == 25
    assert error.message.startswith("The file has 25 invalid line(s): line 1: ")
    assert "line 20: " in error.message and "line 21: " not in error.message
    assert error.message.endswith("; and 5 more.")


def test_twenty_bad_lines_are_all_named_with_no_more():
    error = rejected(jsonl(*(f"bad {i}" for i in range(20))))
    assert "line 20: " in error.message and "more" not in error.message


# --- the file as a whole ------------------------------------------------------------------


def test_max_lines_requests_are_accepted_one_more_is_refused():
    assert len(parse_input(jsonl(*(chat(f"r{i}") for i in range(3))), max_lines=3)) == 3
    error = refused(jsonl(*(chat(f"r{i}") for i in range(4))), max_lines=3)
    assert error.code == "too_many_lines" and error.message == "The file has more than 3 lines (blank lines count)."


def test_blank_lines_count_towards_max_lines():
    # Reading a million empty lines costs as much as reading a million requests (issue 24).
    assert len(parse_input(jsonl(chat("a"), "", "", "", chat("b")), max_lines=5)) == 2
    assert refused(jsonl(chat("a"), "", "", "", chat("b")), max_lines=4).code == "too_many_lines"


def test_an_empty_file_is_refused():
    for content in (b"", b"\n\n  \n"):
        error = refused(content)
        assert error.code == "empty_file" and error.message == "The file has no requests."


def test_invalid_utf8_is_refused_naming_the_byte():
    content = jsonl(chat("a")) + b'{"custom_id": "\xff\xfe"}\n'
    error = refused(content)
    assert error.code == "invalid_file"
    assert error.message == f"The file is not valid UTF-8 (byte {len(jsonl(chat('a'))) + 15})."


# --- output lines -------------------------------------------------------------------------


def test_an_output_line_carries_the_response_in_openais_format():
    body = {"object": "chat.completion", "choices": []}
    line = json.loads(output_line("batch_req_1", "c-1", 200, "req-9", body, None))
    assert line == {"id": "batch_req_1", "custom_id": "c-1",
                    "response": {"status_code": 200, "request_id": "req-9", "body": body}, "error": None}


def test_an_error_line_with_a_status_keeps_the_endpoints_error_body():
    body = {"error": {"message": "too long", "type": "invalid_request_error", "param": "max_tokens",
                      "code": "context_length_exceeded"}}
    line = json.loads(output_line("batch_req_2", "c-2", 400, "req-10", body, None))
    assert line["response"] == {"status_code": 400, "request_id": "req-10", "body": body}
    assert line["error"] is None


def test_an_error_line_without_a_response_carries_the_error():
    error = {"code": "batch_cancelled", "message": "The batch was cancelled before this request finished."}
    line = json.loads(output_line("batch_req_3", "c-3", None, "", None, error))
    assert line == {"id": "batch_req_3", "custom_id": "c-3", "response": None, "error": error}


def test_an_output_line_is_one_line_of_json():
    text = output_line("batch_req_4", "multi\nline", 200, "r", {"text": "a\nb"}, None)
    assert "\n" not in text and json.loads(text)["custom_id"] == "multi\nline"


def test_each_problem_reads_as_one_sentence():
    # The endpoint's own messages end in a full stop; the file's message must not double it.
    error = rejected(jsonl(chat("a", temperature=5), '["x"]'))
    assert ".." not in error.message
    assert error.message.endswith("not an array.")
