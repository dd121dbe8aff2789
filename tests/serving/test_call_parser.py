"""The Hermes-format parser that turns a chat's output back into OpenAI tool calls, fed whole or
in the pieces a stream delivers, and where a request's tools go in the prompt."""
import copy
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


WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_tools_go_to_a_template_that_renders_them_else_into_the_hermes_system_prompt():
    from dataclasses import replace

    from inference.engine.tokenizer import Tokenizer
    from inference.tool_calls import Tools, conversation
    from tests.engine.tiny import smol_tokenizer

    tok = smol_tokenizer()
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    tools = Tools((WEATHER, {**WEATHER, "name": "other"}), "function", name="get_weather")
    messages, template_tools = conversation(ask, tools, tok.knows_tools)
    assert not tok.knows_tools and template_tools is None  # SmolLM2's template has no tools
    assert messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    assert '"other"' not in messages[0]["content"]  # a named choice offers only that function
    assert conversation(ask, replace(tools, choice="none"), tok.knows_tools) == (ask, None)

    # A template that renders tools itself (as Qwen2.5's does) gets them as its `tools` argument.
    hf = copy.deepcopy(tok.hf)
    hf.chat_template = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}" + tok.chat_template
    aware = Tokenizer(hf)
    messages, template_tools = conversation(ask, tools, aware.knows_tools)
    assert messages == ask and template_tools == [{"type": "function", "function": WEATHER}]
    rendered = aware.render_chat(messages, tools=template_tools)
    assert rendered.startswith("<tools>") and "get_weather" in rendered and "other" not in rendered
