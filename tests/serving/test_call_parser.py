"""The Hermes-format parser that turns a chat's output back into OpenAI tool calls, fed whole or
in the pieces a stream delivers."""
import json

import pytest

from inference.tool_calls import CallParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = CALL + "\n" + CALL.replace("Paris", "Lima")


def feed_in_pieces(text: str, size: int) -> tuple[str, list[dict]]:
    parser, content, calls = CallParser(), [], []
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        got, done = parser.feed(piece, final=i == len(pieces) - 1)
        content.append(got)
        calls += done
    return "".join(content), calls


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_calls_come_out_whole_however_the_text_is_cut(size):
    content, calls = feed_in_pieces("Let me check. " + TWO, size)
    assert content == "Let me check. "
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_weather", {"city": "Lima"})]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_text_that_only_looks_like_a_call_is_content(size):
    text = "a < b and <tool is not a tag; <tool_call>\nnot json\n</tool_call> stays as written"
    content, calls = feed_in_pieces(text, size)
    assert (content, calls) == (text, [])


def test_a_call_cut_off_by_max_tokens_is_returned_as_text():
    content, calls = feed_in_pieces('<tool_call>\n{"name": "get_wea', 5)
    assert (content, calls) == ('<tool_call>\n{"name": "get_wea', [])
