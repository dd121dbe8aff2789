"""Key rights and usage on the live platform, through the official client (issue 23): a key's
scopes and its own requests/min hold on the generation endpoints (Channels consumers, not
DRF), and a generation's usage row carries its endpoint and cached tokens, which the tenant
reads back from GET /v1/usage. Keys are issued through the staff admin API."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import openai
import pytest
import websockets

from tests.live import LiveServer

TENANT = "keys"
CHAT = [{"role": "user", "content": "Say hi."}]
LINE = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"messages": CHAT, "max_tokens": 2}}).encode() + b"\n"


def _admin(live: LiveServer, path: str, body: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    request = urllib.request.Request(live.url + "/api/v1/admin" + path, method=method,
                                     data=json.dumps(body or {}).encode() if method != "GET" else None,
                                     headers={"Authorization": f"Bearer {live.internal_token}",
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _issue(live: LiveServer, **rights) -> str:
    status, body = _admin(live, f"/tenants/{live.tenant_ids[TENANT]}/keys", rights)
    assert status == 201, body
    return body["secret"]


def _client(live: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_a_key_scoped_to_batch_gets_403_on_chat_completions_and_its_socket(live: LiveServer, served_model: str):
    key = _issue(live, name="batch only", scopes=["batch"])
    with pytest.raises(openai.PermissionDeniedError) as refused:
        _client(live, key).chat.completions.create(model=served_model, messages=CHAT, max_tokens=2)
    assert refused.value.code == "missing_scope_inference"
    with pytest.raises(openai.PermissionDeniedError):
        _client(live, key).chat.completions.create(model=served_model, messages=CHAT, max_tokens=2, stream=True)

    async def socket() -> tuple[dict, int]:
        async with websockets.connect(live.url.replace("http", "ws") + "/ws/v1/chat",
                                      additional_headers={"Authorization": f"Bearer {key}"}) as ws:
            error = json.loads(await asyncio.wait_for(ws.recv(), 30))
            await asyncio.wait_for(ws.wait_closed(), 30)
            return error, ws.close_code
    error, code = asyncio.run(socket())
    assert (error["error"]["code"], code) == ("missing_scope_inference", 4403)
    # What it is scoped to, it may do: the Files API's upload (a POST on a thread of its own).
    upload = _client(live, key).files.create(file=("in.jsonl", LINE), purpose="batch")
    assert upload.id.startswith("file-")


def test_a_key_without_batch_cannot_upload_or_create_batches(live: LiveServer):
    key = _issue(live, name="chat only", scopes=["inference"])
    with pytest.raises(openai.PermissionDeniedError) as upload:
        _client(live, key).files.create(file=("in.jsonl", LINE), purpose="batch")
    assert upload.value.code == "missing_scope_batch"
    with pytest.raises(openai.PermissionDeniedError) as batch:
        _client(live, key).batches.create(input_file_id="file-x", endpoint="/v1/chat/completions",
                                          completion_window="24h")
    assert batch.value.code == "missing_scope_batch"


def test_a_key_with_rpm_2_under_its_tenants_100_000_gets_2_of_5_chats(live: LiveServer, served_model: str):
    client = _client(live, _issue(live, name="slow", requests_per_minute=2))
    outcomes = []
    for _ in range(5):
        try:
            client.chat.completions.create(model=served_model, messages=CHAT, max_tokens=1)
            outcomes.append(200)
        except openai.RateLimitError as refused:
            assert refused.response.headers["x-ratelimit-limit-requests"] == "2"
            outcomes.append(429)
    assert outcomes.count(200) == 2 and outcomes.count(429) == 3, outcomes


def test_a_rotated_keys_old_secret_works_during_the_grace_then_401s(live: LiveServer, served_model: str):
    old = _issue(live, name="rotating")
    key_id = next(k["id"] for k in _admin(live, f"/tenants/{live.tenant_ids[TENANT]}/keys", method="GET")[1]["data"]
                  if old.startswith(k["key_prefix"] + "_"))
    status, new = _admin(live, f"/keys/{key_id}/rotate", {"grace_s": 2})
    assert status == 201
    rotated_at = time.monotonic()
    assert _client(live, old).models.list().data and _client(live, new["secret"]).models.list().data
    time.sleep(max(0.0, 2.2 - (time.monotonic() - rotated_at)))
    with pytest.raises(openai.AuthenticationError, match="expired"):
        _client(live, old).chat.completions.create(model=served_model, messages=CHAT, max_tokens=1)
    assert _client(live, new["secret"]).chat.completions.create(model=served_model, messages=CHAT, max_tokens=1)


def test_a_generations_usage_row_carries_its_endpoint_and_cached_tokens_and_reads_back(live: LiveServer,
                                                                                       served_model: str):
    key = _issue(live, name="usage", scopes=["inference", "read"])
    client = _client(live, key)
    # The same long prompt twice: the second reuses the first's cached blocks (the tenant's own).
    messages = [{"role": "user", "content": "Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 8}]
    started = int(time.time()) - 1
    for _ in range(2):
        completion = client.chat.completions.create(model=served_model, messages=messages, max_tokens=2)
    cached = completion.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    rows = live.django(f"""
from tenants.models import UsageRecord
result = list(UsageRecord.objects.filter(api_key__prefix={key.split('_')[0].removeprefix('sk-')!r})
              .order_by("created").values("endpoint", "prompt_tokens", "cached_tokens", "completion_tokens"))
""")
    assert [r["endpoint"] for r in rows] == ["/v1/chat/completions"] * 2
    assert rows[1]["cached_tokens"] == cached
    deadline = time.monotonic() + 10
    while True:  # the rows are written by the ledger's writer, just after the responses
        page = _usage(live, key, {"start_time": started, "group_by": "key", "bucket_width": "1h"})
        mine = [r for b in page["data"] for r in b["results"] if key.startswith(r["api_key_id"] + "_")]
        if sum(r["num_model_requests"] for r in mine) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sum(r["input_tokens"] for r in mine) == sum(r["prompt_tokens"] for r in rows)
    assert sum(r["input_cached_tokens"] for r in mine) == sum(r["cached_tokens"] for r in rows) >= cached
    assert sum(r["output_tokens"] for r in mine) == sum(r["completion_tokens"] for r in rows)
    # A key without `read` may not read the tenant's usage.
    with pytest.raises(urllib.error.HTTPError) as refused:
        _usage(live, _issue(live, name="no read", scopes=["inference"]), {"start_time": started})
    assert refused.value.code == 403


def _usage(live: LiveServer, key: str, params: dict) -> dict:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    request = urllib.request.Request(f"{live.url}/v1/usage?{query}", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_version_answers_without_a_key(live: LiveServer):
    with urllib.request.urlopen(live.url + "/version", timeout=30) as response:
        body = json.loads(response.read())
    assert response.status == 200 and body["version"].count(".") == 2
