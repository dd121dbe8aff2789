"""A batch item is billed once, however many times it ran (issue 24, suspected: "a batch item
billed twice when its worker dies between the engine's usage write and the item's result").

Confirmed: the engine's internal endpoint recorded a usage row per delivery, so an item whose
worker died after the engine answered (the sweep then runs it again) was billed for both
runs. A worker now names the item and its run (`X-Batch-Item`, `X-Batch-Attempt`); the item
has one usage row, each run replacing the last one's, and the monthly counter gives the
replaced run's tokens back. Here the two deliveries are sent exactly as a worker sends them.
"""
from __future__ import annotations

import json
import urllib.request

import redis

from tests.live import LiveServer

TENANT = "batch-billing"
ITEM = 424242  # the BatchItem's primary key, as a worker sends it


def _deliver(live: LiveServer, run: int, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": "Write a haiku."}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    request = urllib.request.Request(
        live.url + "/internal/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {live.internal_token}", "Content-Type": "application/json",
                 "X-Tenant-Id": str(live.tenant_ids[TENANT]), "X-Request-Id": f"batchreq-test-1-{run}",
                 "X-Batch-Item": str(ITEM), "X-Batch-Attempt": str(run)})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_an_item_run_twice_is_billed_once_for_its_last_run(hostile_live: LiveServer):
    first = _deliver(hostile_live, 1, 12)  # its worker died before storing this answer
    second = _deliver(hostile_live, 2, 5)  # the sweep gave the item to another run
    rows = hostile_live.django(f"""
        import time
        from tenants.models import UsageRecord
        rows = UsageRecord.objects.filter(tenant_id={hostile_live.tenant_ids[TENANT]})
        deadline = time.monotonic() + 30  # the row is normally complete when the response ends
        while not rows.filter(attempt=2, closed=True).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        result = list(rows.values("key", "attempt", "request_id", "prompt_tokens", "completion_tokens", "lane"))
    """)
    assert rows == [{"key": f"batch-item:{ITEM}", "attempt": 2, "request_id": "batchreq-test-1-2", "lane": 2,
                     "prompt_tokens": second["usage"]["prompt_tokens"],
                     "completion_tokens": second["usage"]["completion_tokens"]}]
    assert first["usage"]["completion_tokens"] == 12 and second["usage"]["completion_tokens"] == 5

    month = hostile_live.django("from django.utils import timezone\nresult = f'{timezone.now():%Y-%m}'")
    counter = redis.Redis.from_url(hostile_live.redis_url).get(
        f"limits:{{tenant:{hostile_live.tenant_ids[TENANT]}}}:monthly_tokens:{month}")
    assert int(counter) == second["usage"]["total_tokens"], "the replaced run's tokens stay counted"
