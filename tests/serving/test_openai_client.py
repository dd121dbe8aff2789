"""The official `openai` Python client against the live server, as a customer would use it.

Chat and text completions, streamed and not, agree with each other (greedy and seeded);
`n`, logprobs, `stream_options.include_usage` and cached prompt tokens come back in the
shapes the client parses; refusals arrive as the client's typed errors (401, 404, 400 with
`code`/`param`, 429 with Retry-After). Every request is billed with the tokens it actually
used, an abandoned stream included, and the tokens/min bucket keeps only what was used of
the reservation it took up front.
"""
from __future__ import annotations

import time
import uuid

import openai
import pytest
import redis

from tests.live import LiveServer
from tests.serving.conftest import TIERS

TENANT = "client"  # lane P1, max_tokens 512 per request, limits out of reach
TIGHT_TENANT = "client-tight"  # 3 requests/min: only the rate-limit test uses it
METERED_TENANT = "client-metered"  # tier live-metered: 60 tokens/min, 50 tokens per request
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
BILLING_WAIT_S = 30.0


def make_client(live: LiveServer, key: str) -> openai.OpenAI:
    # No retries: a 429 must reach the test, not be waited out by the client.
    return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return make_client(live, live.keys[TENANT])


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1, models
    return models[0].id


def usage_records(live: LiveServer, request_ids: list[str]) -> dict[str, dict]:
    """The completed usage records of these requests, by request id (an open one is left out)."""
    return live.django(f"""
from tenants.models import UsageRecord
result = {{
    r.request_id: {{"tenant": r.tenant.name, "lane": r.lane, "prompt_tokens": r.prompt_tokens,
                   "completion_tokens": r.completion_tokens, "finish_reason": r.finish_reason, "model": r.model}}
    for r in UsageRecord.objects.filter(request_id__in={request_ids!r}, closed=True).select_related("tenant")
}}
""")


def stream_chunks(stream) -> list:
    with stream:
        return list(stream)


def chunk_texts(chunks: list) -> dict[int, str]:
    """Each choice's text, from every chunk (a chunk may carry several choices)."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
    return texts


def finish_reasons(chunks: list) -> dict[int, list[str]]:
    reasons: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                reasons.setdefault(choice.index, []).append(choice.finish_reason)
    return reasons


# --- responses ------------------------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI, model: str):
    assert client.models.list().data[0].object == "model"
    assert model


def test_a_model_is_retrieved_with_its_context_length(client: openai.OpenAI, model: str):
    served = client.models.retrieve(model)
    assert (served.id, served.object) == (model, "model")
    # vLLM's extra field: what a client sizes prompts by. SmolLM2's context is 8,192 tokens.
    assert served.max_model_len == client.models.list().data[0].max_model_len == 8192
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found"


def test_chat_completion(client: openai.OpenAI, model: str):
    response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    assert response.model == model
    [choice] = response.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 8
    assert response.usage.total_tokens == response.usage.prompt_tokens + 8


def test_streamed_chat_equals_the_greedy_response_and_ends_with_usage(client: openai.OpenAI, model: str):
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    chunks = stream_chunks(client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "chat.completion.chunk" and c.model == model for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == []
    assert all(c.usage is None for c in body)
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.total_tokens == whole.usage.total_tokens
    assert chunk_texts(body) == {0: whole.choices[0].message.content}
    assert finish_reasons(body) == {0: [whole.choices[0].finish_reason]}


def test_text_completion_streamed_and_not_agree(client: openai.OpenAI, model: str):
    prompt = "The three primary colours are"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    assert whole.object == "text_completion"
    assert whole.id.startswith("cmpl-")
    assert whole.choices[0].text
    chunks = stream_chunks(client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in body)
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunk_texts(body) == {0: whole.choices[0].text}
    assert finish_reasons(body) == {0: [whole.choices[0].finish_reason]}


def test_a_stream_silent_before_its_first_token_is_read_past_its_heartbeats(client: openai.OpenAI, model: str):
    """While a long fresh prompt is prefilled the stream is silent, so the server sends
    keep-alive comments (every 0.5 s in these tests) after the opening chunk; the client
    must read past them to the tokens."""
    text = f"Note {uuid.uuid4().hex}. " + "The quick brown fox jumps over the lazy dog. " * 100
    chunks = stream_chunks(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text + "What does the fox do?"}], max_tokens=4,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.prompt_tokens > 900
    assert chunks[-1].usage.completion_tokens == 4
    assert finish_reasons(chunks) == {0: ["length"]}


def test_a_stream_without_include_usage_carries_no_usage(client: openai.OpenAI, model: str):
    chunks = stream_chunks(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, stream=True))
    assert chunks and all(c.usage is None and c.choices for c in chunks)


def test_n_choices(client: openai.OpenAI, model: str):
    response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, n=2,
                                              extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 12

    chunks = stream_chunks(client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, n=2, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    assert set(chunk_texts(chunks)) == {0, 1}
    assert finish_reasons(chunks) == {0: ["length"], 1: ["length"]}
    assert chunks[-1].usage.completion_tokens == 12


def test_n_choices_of_several_prompts_are_numbered_prompt_by_prompt(client: openai.OpenAI, model: str):
    response = client.completions.create(model=model, prompt=["Red, green and", "One, two, three,"], n=2,
                                         max_tokens=5, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    texts = [c.text for c in response.choices]
    # Greedy: the two choices of one prompt agree; the two prompts do not.
    assert texts[0] == texts[1]
    assert texts[2] == texts[3]
    assert texts[0] != texts[2]


# --- determinism ----------------------------------------------------------------------------


def test_a_seed_reproduces_a_sampled_completion(client: openai.OpenAI, model: str):
    def sample(seed: int, **extra) -> str:
        response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=1.0,
                                                  seed=seed, **extra)
        return response.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    chunks = stream_chunks(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12,
                                                          temperature=1.0, seed=1234, stream=True))
    assert chunk_texts(chunks) == {0: first}
    # Each seed fixes its own text, so this holds on every run.
    assert sample(4321) != first

    pair = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=1.0, seed=99, n=2)
    again = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=1.0, seed=99, n=2)
    assert [c.message.content for c in pair.choices] == [c.message.content for c in again.choices]


# --- logprobs -------------------------------------------------------------------------------


def test_chat_logprobs(client: openai.OpenAI, model: str):
    response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == response.usage.completion_tokens == 8
    for entry in entries:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(tops[0])
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    assert "".join(e.token for e in entries) == choice.message.content

    chunks = stream_chunks(client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True,
        extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries])


def test_chat_without_logprobs_has_none(client: openai.OpenAI, model: str):
    response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
    assert response.choices[0].logprobs is None


def test_completion_logprobs(client: openai.OpenAI, model: str):
    response = client.completions.create(model=model, prompt="The three primary colours are", max_tokens=8,
                                         temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token_logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2
        assert token_logprob <= 0
        assert token_logprob == pytest.approx(max(top.values()))


# --- the prefix cache -----------------------------------------------------------------------


def test_a_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI, model: str):
    # A fresh opening, so the first request finds nothing of it cached.
    text = f"Note {uuid.uuid4().hex}. " + "The quick brown fox jumps over the lazy dog. " * 30
    messages = [{"role": "user", "content": text + "What does the fox do?"}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    prompt_tokens = second.usage.prompt_tokens
    assert prompt_tokens == first.usage.prompt_tokens > 300
    assert first.usage.prompt_tokens_details.cached_tokens < 64  # at most the chat template's opening
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert prompt_tokens - 32 <= cached < prompt_tokens


# --- typed errors ---------------------------------------------------------------------------


def test_a_wrong_key_is_an_authentication_error(live: LiveServer, model: str):
    stranger = make_client(live, "sk-" + "0" * 12 + "_" + "x" * 32)
    with pytest.raises(openai.AuthenticationError) as caught:
        stranger.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(model=model, messages=QUESTION, max_tokens=1, stream=True)


@pytest.mark.parametrize(("kind", "params", "code", "param"), [
    ("chat", {"max_tokens": 0}, "invalid_value", "max_tokens"),
    ("chat", {"temperature": 2.5}, "invalid_value", "temperature"),
    ("chat", {"n": 17}, "invalid_value", "n"),
    ("chat", {"top_logprobs": 3}, "invalid_value", "top_logprobs"),
    ("chat", {"max_tokens": 513}, "max_tokens_exceeded", "max_tokens"),
    ("chat", {"extra_body": {"frobnicate": True}}, "unknown_parameter", "frobnicate"),
    ("chat", {"messages": []}, "empty_array", "messages"),
    ("chat", {"messages": [{"role": "user", "content": "hello world " * 4500}]}, "context_length_exceeded",
     "messages"),
    ("chat", {"max_tokens": 0, "stream": True}, "invalid_value", "max_tokens"),
    ("completion", {"prompt": ""}, "empty_prompt", "prompt"),
    ("completion", {"logprobs": 6}, "invalid_value", "logprobs"),
    ("completion", {"prompt": [1, 2, 10**8]}, "invalid_token_id", "prompt"),
], ids=lambda v: str(v)[:40])
def test_a_bad_parameter_is_a_bad_request_error(client: openai.OpenAI, model: str, kind, params, code, param):
    with pytest.raises(openai.BadRequestError) as caught:
        if kind == "chat":
            client.chat.completions.create(**{"model": model, "messages": QUESTION, "max_tokens": 1, **params})
        else:
            client.completions.create(**{"model": model, "prompt": "Once", "max_tokens": 1, **params})
    error = caught.value
    assert error.status_code == 400
    assert (error.code, error.param, error.type) == (code, param, "invalid_request_error")
    assert error.body["message"]


def test_an_unknown_model_is_a_not_found_error(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=1)
    assert (caught.value.status_code, caught.value.code, caught.value.param) == (404, "model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="davinci-002", prompt="Once", max_tokens=1, stream=True)


def test_running_out_of_requests_is_a_rate_limit_error_with_retry_after(live: LiveServer, model: str):
    tight = make_client(live, live.keys[TIGHT_TENANT])
    admitted = 0
    with pytest.raises(openai.RateLimitError) as caught:
        # The tier allows 3 a minute; one more frees every 20 s, so a slow box may get a fourth in.
        for _ in range(8):
            tight.completions.create(model=model, prompt="Once", max_tokens=1)
            admitted += 1
    assert admitted >= 3
    error = caught.value
    assert error.status_code == 429
    assert (error.code, error.type) == ("rate_limit_exceeded", "requests")
    retry_after = int(error.response.headers["retry-after"])
    assert 1 <= retry_after <= 60
    assert error.response.headers["x-ratelimit-limit-requests"] == "3"
    assert error.response.headers["x-ratelimit-remaining-requests"] == "0"


# --- billing --------------------------------------------------------------------------------


def test_every_request_is_billed_with_the_tokens_it_used(live: LiveServer, client: openai.OpenAI, model: str):
    expected: dict[str, tuple[int | None, int]] = {}  # request id -> (prompt tokens or None, completion tokens)
    eos = {"extra_body": {"ignore_eos": True}}

    response = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, **eos)
    expected[response.id] = (response.usage.prompt_tokens, 5)
    response = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3, n=2, **eos)
    expected[response.id] = (response.usage.prompt_tokens, 6)
    chunks = stream_chunks(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, stream=True,
                                                          stream_options={"include_usage": True}, **eos))
    expected[chunks[0].id] = (chunks[-1].usage.prompt_tokens, 4)
    chunks = stream_chunks(client.completions.create(model=model, prompt="Once upon a time", max_tokens=7,
                                                     stream=True, **eos))
    expected[chunks[0].id] = (None, 7)

    records = usage_records(live, list(expected))
    assert set(records) == set(expected)
    for request_id, (prompt_tokens, completion_tokens) in expected.items():
        record = records[request_id]
        assert record["tenant"] == TENANT
        assert record["model"] == model
        assert record["lane"] == 1
        assert record["finish_reason"] == "length"
        assert record["completion_tokens"] == completion_tokens
        assert record["prompt_tokens"] > 0
        if prompt_tokens is not None:
            assert record["prompt_tokens"] == prompt_tokens


def test_an_abandoned_stream_is_billed_for_what_it_generated(live: LiveServer, client: openai.OpenAI, model: str):
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=512, stream=True,
                                            extra_body={"ignore_eos": True})
    received, request_id = 0, None
    with stream:
        for chunk in stream:
            request_id = chunk.id
            received += sum(1 for c in chunk.choices if c.delta.content)
            if received >= 3:
                break
    assert request_id is not None and received >= 3

    deadline = time.monotonic() + BILLING_WAIT_S
    while not (records := usage_records(live, [request_id])) and time.monotonic() < deadline:
        time.sleep(0.05)
    record = records[request_id]
    assert record["finish_reason"] == "abort"
    # A content chunk carries at least one token; the engine may have made a few more
    # before it saw the client leave, never the 512 it was allowed.
    assert received <= record["completion_tokens"] < 512
    assert record["prompt_tokens"] > 0


@pytest.fixture(scope="module")
def metered(live: LiveServer) -> tuple[str, int]:
    """(key, tenant id) of a tenant allowed 60 tokens a minute: its bucket drains one token a
    second, so what a request left in it can be read after the request ends."""
    return live.keys[METERED_TENANT], live.tenant_ids[METERED_TENANT]


def _redis_ms(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


def test_the_token_limits_are_charged_with_the_tokens_used(live: LiveServer, model: str, metered):
    key, tenant_id = metered
    store = redis.Redis.from_url(live.redis_url)
    bucket = f"limits:{{tenant:{tenant_id}}}:tokens"
    assert store.get(bucket) is None, "the metered tenant must be fresh"
    limit = TIERS["live-metered"]["tokens_per_minute"]
    max_tokens = 40
    started_ms = _redis_ms(store)

    raw = make_client(live, key).completions.with_raw_response.create(
        model=model, prompt="The capital of France is", max_tokens=max_tokens, temperature=0, stop=["."])
    response = raw.parse()
    prompt_tokens, completion_tokens = response.usage.prompt_tokens, response.usage.completion_tokens
    used = prompt_tokens + completion_tokens
    assert response.choices[0].finish_reason == "stop" and completion_tokens < max_tokens
    # Admission reserved the most the request could use...
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) == limit - (prompt_tokens + max_tokens)

    # ...and the end gave back what it did not use: the bucket holds `used`, less what
    # drained (one token a second) since the request started.
    stored = store.get(bucket)
    rate_per_ms = limit / 60_000
    if stored is None:
        assert (_redis_ms(store) - started_ms) * rate_per_ms >= used, "the bucket was emptied, not refunded"
    else:
        level, at_ms = (float(v) for v in stored.split())
        assert used - (at_ms - started_ms) * rate_per_ms - 1e-6 <= level <= used + 1e-6

    # The month's counter counts what was used, as do the usage records it is seeded from.
    [counter] = store.keys(f"limits:{{tenant:{tenant_id}}}:monthly_tokens:*")
    assert int(store.get(counter)) == used
    billed = live.django(f"""
from django.db.models import F, Sum
from tenants.models import UsageRecord
records = UsageRecord.objects.filter(tenant_id={tenant_id})
result = records.aggregate(total=Sum(F("prompt_tokens") + F("completion_tokens")))["total"]
""")
    assert billed == used
