"""vLLM's /tokenize and /detokenize with a tenant's key: the ids a prompt or a chat is, exactly
as the generation endpoints count them, and back."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.live import LiveServer

TENANT = "tokens"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a blue fruit, please."}]


def post(live: LiveServer, path: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not False:
        headers["Authorization"] = f"Bearer {key or live.keys[TENANT]}"
    request = urllib.request.Request(live.url + path, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_chat_tokenizes_to_what_its_usage_reports(live: LiveServer, sdk: openai.OpenAI, served_model: str):
    status, body = post(live, "/tokenize", {"model": served_model, "messages": CHAT})
    assert status == 200 and body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    usage = sdk.chat.completions.create(model=served_model, messages=CHAT, max_tokens=1).usage
    assert body["count"] == usage.prompt_tokens


def test_a_chat_with_tools_counts_the_tools_prompt_too(live: LiveServer, sdk: openai.OpenAI, served_model: str):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    plain = post(live, "/tokenize", {"messages": CHAT})[1]["count"]
    status, body = post(live, "/tokenize", {"messages": CHAT, "tools": tools})
    usage = sdk.chat.completions.create(model=served_model, messages=CHAT, tools=tools, max_tokens=1).usage
    assert status == 200 and body["count"] == usage.prompt_tokens > plain


def test_a_prompt_tokenizes_as_a_completion_counts_it_and_detokenizes_back(live: LiveServer, sdk: openai.OpenAI,
                                                                        served_model: str):
    prompt = "Once upon a time, in a quiet village"
    status, body = post(live, "/tokenize", {"prompt": prompt})
    assert status == 200
    assert body["count"] == sdk.completions.create(model=served_model, prompt=prompt, max_tokens=1).usage.prompt_tokens
    status, back = post(live, "/detokenize", {"tokens": body["tokens"]})
    assert (status, back) == (200, {"prompt": prompt})


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "colour": 1}, 400, "colour"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
], ids=["both", "neither", "unknown-field", "empty-chat", "out-of-vocabulary", "not-ids"])
def test_bad_input_is_a_400_naming_the_field(live: LiveServer, path, body, status, param):
    got, answer = post(live, path, body)
    assert got == status and answer["error"]["param"] == param, answer


def test_a_key_is_needed(live: LiveServer):
    status, answer = post(live, "/tokenize", {"prompt": "a"}, key=False)
    assert status == 401 and answer["error"]["message"]


def test_a_key_without_the_inference_scope_is_refused_naming_it(live: LiveServer):
    # Live: these views run on a pool of their own, whose connections an in-process test's
    # transaction would hide its tenant from.
    key = live.django(f"""
from tenants import actions
from tenants.models import Tenant
result = actions.issue_key(Tenant.objects.get(name={TENANT!r}), name="read-only", scopes=["read"]).plaintext
""")
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1, 2]})):
        status, answer = post(live, path, body, key=key)
        assert (status, answer["error"]["code"]) == (403, "missing_scope_inference"), (path, answer)
