"""Refused requests in the console's requests tail (issue 22): a request refused before any
generation ran leaves no usage row, so the ASGI layer that counts responses keeps it in Redis
(inference.refusals) and the tail merges it with the usage rows, filterable like them.

The application is the platform's own ASGI stack in front of a small consumer, driven as daphne
would; the database is reached from other threads, hence transaction=True."""
from __future__ import annotations

import json
import re

import pytest
from asgiref.sync import async_to_sync
from channels.generic.http import AsyncHttpConsumer
from channels.testing import HttpCommunicator
from django.test import override_settings
from django.urls import reverse

from inference import http_metrics, refusals
from tenants import actions
from tenants.middleware import ApiKeyAuthMiddleware
from tests.console.test_pages import rows_of, text

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"


class Answer(AsyncHttpConsumer):
    """Admitted: 200, or a 500 after marking the request billed (as a generation that ran does)."""

    async def handle(self, body: bytes) -> None:
        if json.loads(body or b"{}").get("fail_after_running"):
            http_metrics.note_billed(self.scope)
            await self.send_response(500, b'{"error": {"message": "engine failed", "type": "server_error"}}')
            return
        await self.send_response(200, b"{}", headers=[(b"content-type", b"application/json")])


APP = http_metrics.ResponseMetrics(ApiKeyAuthMiddleware(Answer.as_asgi()))


def call(key: str, body: dict | None = None, path: str = CHAT) -> int:
    async def go():
        return await HttpCommunicator(APP, "POST", path, body=json.dumps(body or {}).encode(),
                                      headers=[(b"authorization", f"Bearer {key}".encode())]).get_response()
    return async_to_sync(go)()["status"]


@pytest.fixture
def tenants(redis):
    refusals.flush()  # what earlier tests left in this process's buffer
    redis.flushall()
    tier, _ = actions.save_tier("refusals-rpm-1", lane=1, requests_per_minute=1, tokens_per_minute=10**6,
                                concurrent_streams=4, max_tokens_per_request=256, monthly_token_budget=10**9)
    acme, globex = actions.create_tenant("acme", tier), actions.create_tenant("globex", tier)
    return {"acme": (acme, actions.issue_key(acme, name="app")), "globex": (globex, actions.issue_key(globex, name="app"))}


def tail(client, **params) -> list[str]:
    page = client.get(reverse("console:requests"), params).content.decode()
    return [text(row) for row in rows_of(page, "requests")]


def test_refused_requests_show_in_the_tail_with_their_status_tenant_and_key(admin_client, tenants, redis):
    (acme, acme_key), (_, globex_key) = tenants["acme"], tenants["globex"]
    assert call(acme_key.plaintext) == 200
    assert call(acme_key.plaintext) == 429  # requests/min of 1
    assert call(globex_key.plaintext) == 200
    forged = f"sk-{globex_key.api_key.prefix}_not-the-secret"
    assert call(forged) == 401
    assert call(acme_key.plaintext, path="/console/") == 429  # not a tenant-facing path: not kept
    actions.record_usage(acme, lane=1, prompt_tokens=5, completion_tokens=3, api_key=acme_key.api_key,
                         finish_reason="stop", endpoint=CHAT, request_id="req-acme")
    refusals.flush()

    stored = redis.lrange(refusals.REDIS_KEY, 0, -1)
    assert len(stored) == 2
    assert not any(b"not-the-secret" in raw or acme_key.plaintext.encode() in raw for raw in stored)

    rows = tail(admin_client)
    assert len(rows) == 3  # the usage row, then the two refusals, newest first
    assert rows[0].startswith(tuple("0123456789")) and "acme" in rows[0] and "stop" in rows[0]
    forged_row, limited = rows[1], rows[2]
    assert re.search(rf"not authenticated sk-{globex_key.api_key.prefix}_… {CHAT} – 401 invalid_api_key", forged_row), forged_row
    assert re.search(rf"acme sk-{acme_key.api_key.prefix}_… {CHAT} – 429 rate_limit_exceeded – – – \d+ ms", limited), limited

    assert len(tail(admin_client, status="refused")) == 2
    assert [("429" in r) for r in tail(admin_client, status="429")] == [True]
    assert tail(admin_client, status="429", tenant="glob") == ["No requests match this filter."]
    assert len(tail(admin_client, key=f"sk-{acme_key.api_key.prefix}")) == 2  # its usage row and its 429
    assert len(tail(admin_client, lane="1")) == 1  # a refusal never reached a lane
    assert len(tail(admin_client, status="stop")) == 1


def test_an_error_after_a_generation_ran_is_its_usage_rows_not_a_refusal(tenants, redis):
    _, key = tenants["acme"]
    assert call(key.plaintext, {"fail_after_running": True}) == 500
    refusals.flush()
    assert redis.llen(refusals.REDIS_KEY) == 0


def test_the_list_keeps_the_newest_and_the_tail_says_when_redis_is_away(admin_client, tenants, redis):
    _, key = tenants["acme"]
    forged = f"sk-{key.api_key.prefix}_wrong"
    with override_settings(REFUSALS_KEPT=3):
        for _ in range(5):
            call(forged)
        refusals.flush()
        assert redis.llen(refusals.REDIS_KEY) == 3
        assert len(tail(admin_client)) == 3
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):
        page = admin_client.get(reverse("console:requests")).content.decode()
    assert "refused requests are not shown: Redis did not answer" in page
