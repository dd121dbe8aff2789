"""The OpenAPI schema publishes the request bounds that `inference.protocol` enforces, from the
same settings and the engine's one table of ranges: at each published bound a request is
accepted, one past it is refused naming the field. Built in-process (no live server): the schema view's own generator and hooks."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils.module_loading import import_string
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.settings import spectacular_settings

from config.urls import SCHEMA_HOOKS
from inference import protocol
from inference.checks import check_request_bounds
from inference.engine.api import (LIMITS, MAX_STOP_SEQUENCES, MAX_STOP_TOTAL_CHARS, InvalidRequestError,
                                  SamplingParams)
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


REQUESTS = {"ChatCompletionRequestRequest": (protocol.parse_chat, chat), "CompletionRequestRequest": (
    protocol.parse_completion, lambda **fields: {"prompt": "hi", **fields})}
# A field whose check needs a partner field to be reached at all.
PARTNERS = {"top_logprobs": {"logprobs": True}}
# Fields whose range a bound over several fields lowers when the field is alone (n = 1, one prompt).
CAPS = {"max_tokens": "MAX_REQUEST_TOKENS", "max_completion_tokens": "MAX_REQUEST_TOKENS",
        "top_logprobs": "MAX_REQUEST_LOGPROBS", "logprobs": "MAX_REQUEST_LOGPROBS"}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed")


def _just_past(value, integer: bool, direction: int):
    return value + direction if integer else value + direction * max(1e-9, abs(value) * 1e-9)


def test_every_numeric_field_has_the_one_range_in_the_schema_validation_and_engine(schemas):
    published = set()
    for schema_name, (parse, body) in REQUESTS.items():
        for name, field in schemas[schema_name]["properties"].items():
            if "minimum" not in field and "maximum" not in field:
                continue
            limit = LIMITS[name]  # a bounded field the table does not hold is a limit written elsewhere
            published.add(name)
            high = min(limit.high, getattr(settings, CAPS[name])) if name in CAPS else limit.high
            assert (field["minimum"], field["maximum"]) == (limit.low, high), name
            assert field.get("exclusiveMinimum", False) is limit.low_open, name
            assert field["type"] == ("integer" if limit.integer else "number"), name
            extra = PARTNERS.get(name, {})
            if name == "best_of":  # accepted only equal to n
                extra = {"n": high}
            at_top = {name: high, **extra}
            parse(body(**at_top))
            past = refused(parse, body(**{**at_top, name: _just_past(high, limit.integer, +1)}))
            assert past.param == name or (name, past.param) == ("best_of", "n"), (name, past.message)
            if limit.low_open:
                assert refused(parse, body(**{name: limit.low, **extra})).param == name
            else:
                low = {name: limit.low, **extra, **({"n": limit.low} if name == "best_of" else {})}
                parse(body(**low))
                assert refused(parse, body(**{**low, name: _just_past(limit.low, limit.integer, -1)})).param == name
    assert published == set(LIMITS), "every range of the table is published"
    # The engine takes the same ranges from the same table: what the API lets through, it serves.
    for name in SAMPLING:
        limit = LIMITS[name]
        SamplingParams(**{name: limit.high})
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(**{name: _just_past(limit.high, limit.integer, +1)})
        assert caught.value.param == name
    SamplingParams(max_tokens=LIMITS["max_tokens"].high, logprobs=LIMITS["top_logprobs"].high)
    with pytest.raises(InvalidRequestError):
        SamplingParams(logprobs=LIMITS["top_logprobs"].high + 1)


def test_stop_bounds_above_the_engines_ceilings_fail_the_system_check():
    assert check_request_bounds() == []
    with override_settings(MAX_STOP=MAX_STOP_SEQUENCES + 1):
        assert [e.id for e in check_request_bounds()] == ["inference.E007"]
    with override_settings(MAX_STOP=4, MAX_STOP_CHARS=MAX_STOP_TOTAL_CHARS // 4 + 1):
        assert "MAX_STOP x MAX_STOP_CHARS" in check_request_bounds()[0].msg


def test_request_parsing_imports_neither_torch_nor_a_model():
    # A subprocess: this test process has long imported torch for other tests.
    code = ("import sys, inference.protocol, inference.engine.api; "
            "heavy = sorted(m for m in ('torch', 'inference.engine.engine', 'inference.engine.sequence') if m in sys.modules); "
            "print(heavy); sys.exit(bool(heavy))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout + done.stderr


def test_prompt_cache_key_is_accepted_within_its_published_length(schemas):
    # Newer OpenAI SDKs send it; refusing it as an unknown field broke those clients.
    for name, (parse, body) in REQUESTS.items():
        field = schemas[name]["properties"]["prompt_cache_key"]
        assert (field["minLength"], field["maxLength"]) == (1, protocol.MAX_PROMPT_CACHE_KEY_CHARS)
        parse(body(prompt_cache_key="k" * protocol.MAX_PROMPT_CACHE_KEY_CHARS))
        for bad in ("", "k" * (protocol.MAX_PROMPT_CACHE_KEY_CHARS + 1), 7):
            assert refused(parse, body(prompt_cache_key=bad)).param == "prompt_cache_key"


def test_the_speculative_opt_out_is_published_and_reaches_the_engine(schemas):
    assert schemas["ChatCompletionRequestRequest"]["properties"]["speculative"]["type"] == "boolean"
    assert protocol.parse_chat(chat()).sampling_params(8).speculative is True
    assert protocol.parse_chat(chat(speculative=False)).sampling_params(8).speculative is False
    assert protocol.parse_completion({"prompt": "hi", "speculative": False}).sampling_params(8).speculative is False
    assert refused(protocol.parse_chat, chat(speculative="no")).param == "speculative"
