"""The usage ledger writes the entries that arrive together in one transaction
(tenants.actions.apply_usage_batch): the rows and the monthly counters it leaves must be
the ones that writing each entry on its own leaves, whatever the entries and however they
are cut into batches. Against the test database and a real Redis."""
from __future__ import annotations

import random

import pytest
from django.utils import timezone

from tenants import actions, quota
from tenants.actions import LOST_REPLICA
from tenants.ledger import UsageEntry
from tenants.models import Tenant, UsageRecord

FIELDS = ["key", *actions.USAGE_FIELDS]


def entries(seed: int, tenants: list[Tenant], count: int = 60) -> list[UsageEntry]:
    """A ledger's worth of entries over a few keys: generations opened and closed, voided,
    batch items retried (later attempts), stale and repeated entries, closes of rows the
    sweep completed, in an order where a key's entries may come late or twice."""
    rng = random.Random(seed)
    created = timezone.now().isoformat()
    out = []
    for _ in range(count):
        key = f"gen-{rng.randrange(8)}"
        tenant = tenants[int(key[-1]) % len(tenants)]
        op = rng.choice(["open", "open", "close", "close", "close", "void"])
        finish = LOST_REPLICA if op == "close" and rng.random() < 0.2 else ("length" if op == "close" else "")
        out.append(UsageEntry(op=op, key=key, tenant_id=tenant.pk, lane=rng.choice([0, 1, 2]), created=created,
                              request_id=key, model="m", attempt=rng.choice([0, 0, 1, 2]),
                              prompt_tokens=rng.randrange(1, 50), completion_tokens=rng.randrange(0, 80) if op == "close" else 0,
                              finish_reason=finish, ttft_ms=rng.choice([None, 12]), replica="r1"))
    return out


def state(tenants: list[Tenant]) -> tuple[list[dict], list[int]]:
    rows = list(UsageRecord.objects.order_by("key").values(*FIELDS))
    return rows, [quota.monthly_tokens_used(t) for t in tenants]


def fresh(tenants: list[Tenant], redis) -> None:
    UsageRecord.objects.all().delete()
    redis.flushall()
    for tenant in tenants:  # a counter to give replaced attempts back to: seeded (0 rows), then raised
        quota.charge_monthly_tokens(tenant, 0)
        quota.charge_monthly_tokens(tenant, 10_000)


@pytest.mark.parametrize("seed", range(6))
def test_entries_written_in_batches_leave_the_rows_and_counters_one_at_a_time_leaves(redis, make_tenant, seed):
    tenants = [make_tenant("usage-a")[0], make_tenant("usage-b")[0]]
    written = entries(seed, tenants)

    fresh(tenants, redis)
    for entry in written:
        actions.apply_usage(entry)
    one_by_one = state(tenants)
    assert one_by_one[0], "the entries leave some rows"
    assert one_by_one[1] != [10_000, 10_000], "some replaced attempts gave their tokens back"

    rng = random.Random(seed)
    for cut in ("whole", "random"):
        fresh(tenants, redis)
        start = 0
        while start < len(written):
            size = len(written) if cut == "whole" else rng.randrange(1, 12)
            actions.apply_usage_batch(written[start:start + size])
            start += size
        assert state(tenants) == one_by_one, cut


def test_a_generations_entries_bill_it_once_in_one_row_batched_or_not(redis, make_tenant):
    """Its open and close arriving together write one closed row, and a repeat of either (a
    retry of a write that had landed) changes nothing; a close arriving in a later batch
    completes the row the open wrote, which keeps its id."""
    tenant, key = make_tenant("usage-once")

    def entry(op: str, name: str, **fields) -> UsageEntry:
        return UsageEntry(op=op, key=name, tenant_id=tenant.pk, lane=1, created=timezone.now().isoformat(),
                          request_id=name, api_key_id=key.api_key.pk, prompt_tokens=11, **fields)

    closing = {"completion_tokens": 29, "finish_reason": "stop"}
    actions.apply_usage_batch([entry("open", "gen-together"), entry("close", "gen-together", **closing)])
    actions.apply_usage_batch([entry("open", "gen-together"), entry("close", "gen-together", **closing),
                               entry("open", "gen-apart")])
    opened = UsageRecord.objects.get(key="gen-apart")
    actions.apply_usage_batch([entry("open", "gen-other"), entry("close", "gen-apart", **closing)])
    assert UsageRecord.objects.get(key="gen-apart").pk == opened.pk
    assert list(UsageRecord.objects.order_by("key").values("key", "prompt_tokens", "completion_tokens", "closed",
                                                           "api_key_id")) == [
        {"key": "gen-apart", "prompt_tokens": 11, "completion_tokens": 29, "closed": True, "api_key_id": key.api_key.pk},
        {"key": "gen-other", "prompt_tokens": 11, "completion_tokens": 0, "closed": False, "api_key_id": key.api_key.pk},
        {"key": "gen-together", "prompt_tokens": 11, "completion_tokens": 29, "closed": True, "api_key_id": key.api_key.pk},
    ]
