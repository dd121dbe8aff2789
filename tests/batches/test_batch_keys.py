"""A batch runs with the rights of the API key that created it, and of its tenant.

A key may carry its own monthly budget (a tenant handing a contractor a capped key) and may be
revoked (a leaked key). Batch items ran as the tenant, with no key: a capped key's batch spent
the tenant's budget past the key's cap, and a revoked key's batch went on generating for up to
its 24 h window. Now the worker names the batch's key to the internal endpoint, which holds the
request to that key's budget and bills it to the key, and refuses it once the key is revoked;
a revoked key's running batches are cancelled. A deactivated tenant's batch waits for its
reactivation (or its expiry) instead of failing item by item.
"""
from __future__ import annotations

import time

import pytest
from openai import OpenAI

from tests.batches.conftest import chat_lines, read_jsonl, wait_for

pytestmark = pytest.mark.slow

TENANT = "globex"


def _key(stack, name: str, **limits) -> tuple[int, str]:
    issued = stack.server.django(f"""
from tenants import actions
from tenants.models import Tenant
issued = actions.issue_key(Tenant.objects.get(name={TENANT!r}), name={name!r}, **{limits!r})
result = [issued.api_key.pk, issued.plaintext]
""")
    return issued[0], issued[1]


def _client(stack, key: str) -> OpenAI:
    return OpenAI(base_url=stack.server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _run(stack, key: str, lines: str):
    client = _client(stack, key)
    file = client.files.create(file=("in.jsonl", lines.encode()), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")


def _usage(stack, batch_id: str) -> list[dict]:
    return stack.server.django(f"""
from tenants.models import UsageRecord
result = list(UsageRecord.objects.filter(batch={batch_id!r}).values("api_key_id", "prompt_tokens", "completion_tokens"))
""")


def test_a_batch_is_held_to_the_budget_of_the_key_that_created_it_and_billed_to_it(stack):
    stack.ensure_worker()
    budget = 150
    key_id, key = _key(stack, "capped", monthly_token_budget=budget)
    batch = _run(stack, key, chat_lines(12, max_tokens=8, prefix="capped"))
    owner = stack.client(TENANT)  # the tenant's own key reads the results
    done = wait_for(lambda: (b := owner.batches.retrieve(batch.id)).status == "completed" and b, 240,
                    what="the capped key's batch to complete")

    rows = _usage(stack, batch.id)
    assert rows and {row["api_key_id"] for row in rows} == {key_id}, "every item is billed to the batch's key"
    used = [row["prompt_tokens"] + row["completion_tokens"] for row in rows]
    # Admitted while the key's settled and reserved tokens were under its budget: past it by
    # one request's use at most (as the tenant's budget), never by the batch's.
    assert sum(used) <= budget + max(used), f"the key's items used {sum(used)} tokens of a {budget}-token budget"
    assert 0 < done.request_counts.completed < 12
    failures = read_jsonl(owner.files.content(done.error_file_id).text)
    assert len(failures) == 12 - done.request_counts.completed
    for line in failures:
        error = line["response"]["body"]["error"]
        assert (line["response"]["status_code"], error["code"]) == (429, "insufficient_quota"), line
        assert "API key" in error["message"]


def test_revoking_the_key_that_created_a_batch_cancels_what_it_had_not_run(stack):
    stack.ensure_worker()
    key_id, key = _key(stack, "leaked")
    batch = _run(stack, key, chat_lines(120, max_tokens=24, prefix="leaked"))
    owner = stack.client(TENANT)
    wait_for(lambda: owner.batches.retrieve(batch.id).request_counts.completed >= 1, 180,
             what="the first item to complete")
    stack.server.django(f"""
from tenants import actions
from tenants.models import ApiKey
actions.revoke_key(ApiKey.objects.get(pk={key_id}))
result = True
""")
    done = wait_for(lambda: (b := owner.batches.retrieve(batch.id)).status == "cancelled" and b, 60,
                    what="the batch to be cancelled")
    assert [(e.code, e.message) for e in done.errors.data] == [
        ("api_key_revoked", "The API key that created the batch was revoked before this request finished.")]
    assert 1 <= done.request_counts.completed < 120
    failures = read_jsonl(owner.files.content(done.error_file_id).text)
    assert len(failures) == 120 - done.request_counts.completed
    assert {line["error"]["code"] for line in failures} == {"api_key_revoked"}, failures[:3]


def _set_active(stack, tenant: str, active: bool) -> None:
    stack.server.django(f"""
from tenants import actions
from tenants.models import Tenant
actions.set_active(Tenant.objects.get(name={tenant!r}), {active!r})
result = True
""")


def test_a_deactivated_tenants_batch_waits_and_finishes_once_it_is_reactivated(stack):
    """Deactivated, a tenant's requests are refused; its batch items failed one by one with the
    internal endpoint's 404 (naming an internal header in the tenant's error file). They wait,
    queued, and run once the tenant is active again (or expire with the batch)."""
    stack.ensure_worker()
    owner = stack.client("paused")
    batch = _run(stack, stack.server.keys["paused"], chat_lines(60, max_tokens=16, prefix="paused"))
    wait_for(lambda: owner.batches.retrieve(batch.id).request_counts.completed >= 1, 180,
             what="the first item to complete")
    _set_active(stack, "paused", False)
    try:
        time.sleep(3)  # what was running ends; nothing more starts
        during = stack.items(batch.id)
        assert "failed" not in during, during
        assert during.get("queued", 0) > 0, during
        time.sleep(2)
        assert stack.items(batch.id) == during, "items ran while the tenant was deactivated"
    finally:
        _set_active(stack, "paused", True)
    done = wait_for(lambda: (b := owner.batches.retrieve(batch.id)).status == "completed" and b, 240,
                    what="the batch to finish after the reactivation")
    assert (done.request_counts.completed, done.request_counts.failed) == (60, 0)
