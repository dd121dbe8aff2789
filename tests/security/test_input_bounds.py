"""Every input that costs the engine or the tokenizer work is bounded, on every path a generation
takes (REST chat and completions, the WebSocket `start` message, batch input lines), and a request
past a bound is refused with a 400 (413 for the prompt's size) naming the field.

Issue 24, item 1: four 260,000-character stop strings froze the engine for every tenant. Stop
strings now have a length bound, and the engine's stop check no longer costs the square of their
length per token: a bystander's chat completes while a request with the largest stops allowed runs.

Tenants (tests/isolation_env.py): "bounds" and "bounds-bystander" (lane P1), "bounds-batch" (P2,
batch jobs allowed).
"""
from __future__ import annotations

import asyncio
import json
import threading

import requests
from django.conf import settings
from websockets.asyncio.client import connect

from tests import isolation_env
from tests.live import LiveServer

HANG_GUARD_S = 120  # a broken server fails the test instead of hanging it; never a timing assertion
HI = [{"role": "user", "content": "Say hi."}]


def bound(name: str) -> int:
    """The live server's value of a bound: its environment (isolation_env), else the default."""
    return int(isolation_env.ENV.get(name, getattr(settings, name)))


def long_stops(length: int) -> list[str]:
    """The most stop strings allowed, each `length` characters, which generated text never matches."""
    return ["\x00" + "q" * (length - 2) + chr(1 + i) for i in range(bound("MAX_STOP"))]


def post(live: LiveServer, path: str, body: dict, tenant: str = "bounds", **kwargs) -> requests.Response:
    return requests.post(live.url + path, json=body, headers={"Authorization": f"Bearer {live.keys[tenant]}"},
                         timeout=HANG_GUARD_S, **kwargs)


def assert_refused(response: requests.Response, param: str, bound_name: str, status: int = 400) -> dict:
    """Refused for the bound itself (the message gives it), not later for a consequence of it
    such as a prompt past the context."""
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert str(bound(bound_name)) in error["message"], error
    return error


def chat(**fields) -> dict:
    return {"messages": HI, "max_tokens": 1, **fields}


# -- stop strings, on every path ----------------------------------------------------------------


def test_a_stop_string_past_the_length_bound_is_refused_on_chat(hostile_live: LiveServer):
    stop = long_stops(bound("MAX_STOP_CHARS") + 1)
    assert_refused(post(hostile_live, "/v1/chat/completions", chat(stop=stop)), "stop", "MAX_STOP_CHARS")
    assert_refused(post(hostile_live, "/v1/chat/completions", chat(stop=stop[0], stream=True)), "stop", "MAX_STOP_CHARS")


def test_a_stop_string_past_the_length_bound_is_refused_on_completions(hostile_live: LiveServer):
    body = {"prompt": "Say hi.", "max_tokens": 1, "stop": long_stops(bound("MAX_STOP_CHARS") + 1)}
    assert_refused(post(hostile_live, "/v1/completions", body), "stop", "MAX_STOP_CHARS")


def test_a_stop_string_past_the_length_bound_is_refused_on_a_websocket_start(hostile_live: LiveServer):
    async def start() -> dict:
        headers = {"Authorization": f"Bearer {hostile_live.keys['bounds']}"}
        async with connect(hostile_live.ws_url + "/ws/v1/chat", additional_headers=headers,
                           max_size=None) as ws:
            await ws.send(json.dumps({"type": "start", "id": "long-stop", **chat(stop=long_stops(bound("MAX_STOP_CHARS") + 1))}))
            while True:
                message = json.loads(await ws.recv())
                if message.get("id") == "long-stop" and message["type"] in ("error", "done"):
                    return message

    message = asyncio.run(asyncio.wait_for(start(), HANG_GUARD_S))
    assert message["type"] == "error", message
    assert message["error"]["param"] == "stop" and message["error"]["type"] == "invalid_request_error"


def test_a_batch_line_with_a_stop_string_past_the_length_bound_is_refused(hostile_live: LiveServer):
    line = {"custom_id": "long-stop", "method": "POST", "url": "/v1/chat/completions",
            "body": chat(stop=long_stops(bound("MAX_STOP_CHARS") + 1))}
    response = requests.post(hostile_live.url + "/v1/files", data={"purpose": "batch"},
                             files={"file": ("long-stop.jsonl", json.dumps(line).encode() + b"\n")},
                             headers={"Authorization": f"Bearer {hostile_live.keys['bounds-batch']}"}, timeout=HANG_GUARD_S)
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == "file" and "line 1" in error["message"] and "'stop'" in error["message"]


def test_more_stop_strings_than_the_bound_are_refused(hostile_live: LiveServer):
    stop = [f"stop{i}" for i in range(bound("MAX_STOP") + 1)]
    assert_refused(post(hostile_live, "/v1/chat/completions", chat(stop=stop)), "stop", "MAX_STOP")


def test_more_stop_token_ids_than_the_bound_are_refused(hostile_live: LiveServer):
    ids = list(range(1, bound("MAX_STOP_TOKEN_IDS") + 2))
    assert_refused(post(hostile_live, "/v1/chat/completions", chat(stop_token_ids=ids)), "stop_token_ids", "MAX_STOP_TOKEN_IDS")


# -- messages and prompts -----------------------------------------------------------------------


def test_more_messages_than_the_bound_are_refused(hostile_live: LiveServer):
    messages = [{"role": "user", "content": "hi"}] * (bound("MAX_MESSAGES") + 1)
    assert_refused(post(hostile_live, "/v1/chat/completions", chat(messages=messages)), "messages", "MAX_MESSAGES")


def test_messages_past_the_prompt_size_bound_are_refused_with_413(hostile_live: LiveServer):
    half = "x" * (bound("MAX_PROMPT_CHARS") // 2)
    messages = [{"role": "system", "content": half}, {"role": "user", "content": half + "x"}]
    assert_refused(post(hostile_live, "/v1/chat/completions", chat(messages=messages)), "messages", "MAX_PROMPT_CHARS", status=413)


def test_prompts_past_the_prompt_size_bound_are_refused_with_413(hostile_live: LiveServer):
    half = "x" * (bound("MAX_PROMPT_CHARS") // 2)
    body = {"prompt": [half, half + "x"], "max_tokens": 1}
    assert_refused(post(hostile_live, "/v1/completions", body), "prompt", "MAX_PROMPT_CHARS", status=413)


# -- what the choices of one request add up to -----------------------------------------------------


def test_n_times_max_tokens_past_the_bound_is_refused(hostile_live: LiveServer):
    n = 16
    per_choice = bound("MAX_REQUEST_TOKENS") // n + 1
    assert_refused(post(hostile_live, "/v1/chat/completions", chat(n=n, max_tokens=per_choice)), "max_tokens", "MAX_REQUEST_TOKENS")
    assert_refused(post(hostile_live, "/v1/chat/completions", {"messages": HI, "n": n, "max_completion_tokens": per_choice}),
                   "max_completion_tokens", "MAX_REQUEST_TOKENS")
    # Each choice alone fits the context, the KV cache and the tier; together they are past the bound.
    prompts = bound("MAX_CHOICES")
    body = {"prompt": ["a"] * prompts, "max_tokens": bound("MAX_REQUEST_TOKENS") // prompts + 1}
    assert_refused(post(hostile_live, "/v1/completions", body), "max_tokens", "MAX_REQUEST_TOKENS")


def test_top_logprobs_times_n_past_the_bound_is_refused(hostile_live: LiveServer):
    top = 20
    n = bound("MAX_REQUEST_LOGPROBS") // top + 1
    assert_refused(post(hostile_live, "/v1/chat/completions", chat(n=n, logprobs=True, top_logprobs=top)), "top_logprobs", "MAX_REQUEST_LOGPROBS")
    body = {"prompt": ["a"] * n, "max_tokens": 1, "logprobs": 5, "n": 4}  # 4n choices x 5 alternatives
    assert_refused(post(hostile_live, "/v1/completions", body), "logprobs", "MAX_REQUEST_LOGPROBS")


def test_more_completion_choices_than_the_bound_are_refused(hostile_live: LiveServer):
    body = {"prompt": ["a"] * 16, "n": bound("MAX_CHOICES") // 16 + 1, "max_tokens": 1}
    assert_refused(post(hostile_live, "/v1/completions", body), "n", "MAX_CHOICES")


# -- the engine under the largest stops allowed -------------------------------------------------------


def test_a_bystanders_chat_completes_while_a_request_with_the_largest_stops_allowed_runs(hostile_live: LiveServer):
    """The attack of issue 24 at the largest size still accepted: four stop strings of the most
    characters allowed, that never match, on a request decoding for hundreds of tokens. Another
    tenant's short chat is served beside it: it completes while the attack is still decoding."""
    attack = post(hostile_live, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Count from one to one thousand in words."}],
        "stream": True, "max_tokens": 512, "ignore_eos": True, "temperature": 0,
        "stop": long_stops(bound("MAX_STOP_CHARS")),
    }, stream=True)
    assert attack.status_code == 200, attack.text[:500]
    first_token, attack_done = threading.Event(), threading.Event()
    tokens = []

    def read_attack():
        try:
            for line in attack.iter_lines():
                if line == b"data: [DONE]":
                    break
                if line.startswith(b"data: "):
                    tokens.append(line)
                    first_token.set()
        except Exception:  # noqa: BLE001 - the test closes the response under this thread once it is done
            pass
        finally:
            attack_done.set()
            first_token.set()

    reader = threading.Thread(target=read_attack, daemon=True)
    reader.start()
    try:
        assert first_token.wait(HANG_GUARD_S) and not attack_done.is_set(), "the attack never started decoding"
        answer = post(hostile_live, "/v1/chat/completions", {"messages": HI, "max_tokens": 8, "temperature": 0},
                      tenant="bounds-bystander")
        still_decoding = not attack_done.is_set()
        assert answer.status_code == 200, answer.text[:500]
        assert answer.json()["choices"][0]["message"]["content"]
        assert still_decoding, f"the bystander's chat finished only after the attack's {len(tokens)} events"
    finally:
        attack.close()
        reader.join(HANG_GUARD_S)
