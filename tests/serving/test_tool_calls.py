"""Tool calling through the official `openai` client against the live server: the model is told
of its tools in the Hermes system-prompt format, and with `tool_choice` "required" or a named
function its calls are held to the functions' schemas from the first token."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

TENANT = "tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
FLIGHTS = {"type": "function", "function": {
    "name": "find_flights", "description": "Flights between two airports on a day.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["origin", "destination", "passengers"],
                   "properties": {"origin": {"type": "string", "maxLength": 3, "minLength": 3},
                                  "destination": {"type": "string", "maxLength": 3, "minLength": 3},
                                  "passengers": {"type": "integer", "minimum": 1, "maximum": 9}}}}}
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Quito", "Delhi", "Perth", "Accra", "Boston", "Hanoi", "Dublin",
          "Nairobi", "Seoul", "Lisbon", "Denver", "Manila", "Prague", "Santiago", "Vienna"]



def ask(city: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather like in {city} today?"}]


def arguments_of(call) -> dict:
    return json.loads(call.function.arguments)


def test_a_named_function_is_called_with_arguments_that_validate(sdk: openai.OpenAI, served_model: str):
    def call(city: str):
        return sdk.chat.completions.create(
            model=served_model, messages=ask(city), tools=[WEATHER, FLIGHTS], max_tokens=100, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    with ThreadPoolExecutor(10) as pool:
        completions = list(pool.map(call, CITIES))
    for completion in completions:
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (tool_call,) = choice.message.tool_calls
        assert tool_call.type == "function" and tool_call.id.startswith("call_")
        assert tool_call.function.name == "get_weather"
        jsonschema.validate(arguments_of(tool_call), WEATHER["function"]["parameters"])


def test_required_calls_one_of_the_tools_validly(sdk: openai.OpenAI, served_model: str):
    completion = sdk.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "Find me flights from LHR to JFK for two people."}],
        tools=[WEATHER, FLIGHTS], tool_choice="required", parallel_tool_calls=False, max_tokens=100, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (tool_call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "find_flights": FLIGHTS}[tool_call.function.name]
    jsonschema.validate(arguments_of(tool_call), tool["function"]["parameters"])


def test_a_streamed_call_reassembles_to_the_plain_one(sdk: openai.OpenAI, served_model: str):
    kwargs = dict(model=served_model, messages=ask("Lisbon"), tools=[WEATHER], max_tokens=100, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    plain = sdk.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    with sdk.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls"
    assert (streamed.function.name, arguments_of(streamed)) == (plain.function.name, arguments_of(plain))


def test_a_tool_result_round_trip_is_accepted(sdk: openai.OpenAI, served_model: str):
    first = sdk.chat.completions.create(model=served_model, messages=ask("Oslo"), tools=[WEATHER], max_tokens=100,
                                           temperature=0, tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    history = ask("Oslo") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 4, "sky": "cloudy"})},
    ]
    answer = sdk.chat.completions.create(model=served_model, messages=history, tools=[WEATHER], tool_choice="none",
                                            max_tokens=40, temperature=0)
    choice = answer.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


def test_auto_answers_in_text_or_with_a_valid_call(sdk: openai.OpenAI, served_model: str):
    completion = sdk.chat.completions.create(model=served_model, messages=ask("Tokyo"), tools=[WEATHER], max_tokens=120,
                                                temperature=0)
    message = completion.choices[0].message
    if message.tool_calls:
        assert completion.choices[0].finish_reason == "tool_calls"
        for tool_call in message.tool_calls:
            jsonschema.validate(arguments_of(tool_call), WEATHER["function"]["parameters"])
    else:
        assert message.content


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "book_hotel"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}]},
     "tools[0].function.parameters"),
], ids=["unknown-function", "with-response-format", "bad-name", "bad-parameters"])
def test_bad_tool_input_is_a_400_naming_the_field(sdk: openai.OpenAI, served_model: str, extra: dict, param: str):
    body = {"tools": [WEATHER], **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=served_model, messages=ask("Paris"), max_tokens=10, **body)
    assert caught.value.body["param"] == param
