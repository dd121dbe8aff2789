"""The OpenAPI schema publishes the request bounds that `inference.protocol` enforces, from the
same settings: at each published bound a request is accepted, one past it is refused naming the
field. Built in-process (no live server): the schema view's own generator and hooks."""
from __future__ import annotations

import pytest
from django.conf import settings
from django.utils.module_loading import import_string
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.settings import spectacular_settings

from config.urls import SCHEMA_HOOKS
from inference import protocol
from tenants.errors import ApiError


@pytest.fixture(scope="module")
def schemas() -> dict:
    previous = spectacular_settings.POSTPROCESSING_HOOKS
    spectacular_settings.POSTPROCESSING_HOOKS = [import_string(hook) for hook in SCHEMA_HOOKS]
    try:
        schema = SchemaGenerator(urlconf="inference.openapi").get_schema(request=None, public=True)
    finally:
        spectacular_settings.POSTPROCESSING_HOOKS = previous
    return schema["components"]["schemas"]


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def refused(parse, body: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body)
    return caught.value


def test_stop_bounds_in_the_schema_are_the_ones_enforced(schemas):
    for name in ("ChatCompletionRequestRequest", "CompletionRequestRequest"):
        one, many = schemas[name]["properties"]["stop"]["oneOf"]
        assert one["maxLength"] == many["items"]["maxLength"] == settings.MAX_STOP_CHARS
        assert many["maxItems"] == settings.MAX_STOP
    longest = "x" * settings.MAX_STOP_CHARS
    protocol.parse_chat(chat(stop=[longest] * settings.MAX_STOP))
    assert refused(protocol.parse_chat, chat(stop=[longest + "x"])).param == "stop"
    assert refused(protocol.parse_chat, chat(stop=["x"] * (settings.MAX_STOP + 1))).param == "stop"


def test_stop_token_ids_bound_in_the_schema_is_the_one_enforced(schemas):
    assert schemas["ChatCompletionRequestRequest"]["properties"]["stop_token_ids"]["maxItems"] == settings.MAX_STOP_TOKEN_IDS
    protocol.parse_chat(chat(stop_token_ids=[1] * settings.MAX_STOP_TOKEN_IDS))
    assert refused(protocol.parse_chat, chat(stop_token_ids=[1] * (settings.MAX_STOP_TOKEN_IDS + 1))).param == "stop_token_ids"


def test_message_bounds_in_the_schema_are_the_ones_enforced(schemas):
    messages = schemas["ChatCompletionRequestRequest"]["properties"]["messages"]
    assert messages["maxItems"] == settings.MAX_MESSAGES
    content = schemas["ChatMessageRequest"]["properties"]["content"]["oneOf"][0]
    assert content["maxLength"] == settings.MAX_PROMPT_CHARS
    protocol.parse_chat({"messages": [{"role": "user", "content": "hi"}] * settings.MAX_MESSAGES})
    too_many = refused(protocol.parse_chat, {"messages": [{"role": "user", "content": "hi"}] * (settings.MAX_MESSAGES + 1)})
    assert (too_many.status, too_many.param) == (400, "messages")
    protocol.parse_chat({"messages": [{"role": "user", "content": "x" * settings.MAX_PROMPT_CHARS}]})
    too_long = refused(protocol.parse_chat, {"messages": [{"role": "user", "content": "x" * settings.MAX_PROMPT_CHARS},
                                                          {"role": "user", "content": "x"}]})
    assert (too_long.status, too_long.param) == (413, "messages")


def test_bounds_over_several_fields_are_published_as_enforced(schemas):
    for name in ("ChatCompletionRequestRequest", "CompletionRequestRequest"):
        assert schemas[name]["x-request-bounds"] == {
            "max_request_tokens": settings.MAX_REQUEST_TOKENS,
            "max_request_logprobs": settings.MAX_REQUEST_LOGPROBS,
            "max_prompt_chars": settings.MAX_PROMPT_CHARS,
            "max_choices": settings.MAX_CHOICES,
        }
    per_choice = settings.MAX_REQUEST_TOKENS // 4
    protocol.parse_chat(chat(n=4, max_tokens=per_choice))
    assert refused(protocol.parse_chat, chat(n=4, max_tokens=per_choice + 1)).param == "max_tokens"
    assert refused(protocol.parse_chat, chat(n=4, max_completion_tokens=per_choice + 1)).param == "max_completion_tokens"
    top = settings.MAX_REQUEST_LOGPROBS // 5
    protocol.parse_chat(chat(n=5, logprobs=True, top_logprobs=top))
    assert refused(protocol.parse_chat, chat(n=6, logprobs=True, top_logprobs=top)).param == "top_logprobs"
    prompts = ["x" * (settings.MAX_PROMPT_CHARS // 2)] * 2
    protocol.parse_completion({"prompt": prompts})
    assert refused(protocol.parse_completion, {"prompt": prompts + ["x"]}).status == 413
    assert refused(protocol.parse_completion, {"prompt": ["x"] * 16, "n": 5}).param == "n"
