"""Usage rows of a replica process that died are completed by a live one (inference.sweep),
with the tokens the dead one last reported, once it has been gone from the fleet long enough;
its own late close still wins. Against a real Redis and the test database; the replicas are
heartbeats, the dead one's rows are written through the ledger's own apply_usage."""
from __future__ import annotations

import pytest
from django.utils import timezone

from inference import fleet
from inference.sweep import GRACE_BEATS, Sweeper
from tenants import actions, quota
from tenants.ledger import UsageEntry
from tenants.models import Tenant, UsageRecord

BEAT_S = 1.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(op: str, key: str, tenant: Tenant, replica: str, completion: int = 0, attempt: int = 0) -> UsageEntry:
    return UsageEntry(op=op, key=key, tenant_id=tenant.pk, lane=1, created=timezone.now().isoformat(), model="m",
                      request_id=key, attempt=attempt, prompt_tokens=40, completion_tokens=completion,
                      finish_reason="length" if op == "close" else "", replica=replica)


@pytest.fixture
def tenant(db) -> Tenant:
    tier, _ = actions.save_tier("sweep", lane=1, requests_per_minute=100, tokens_per_minute=100_000,
                                concurrent_streams=8, max_tokens_per_request=512, monthly_token_budget=10**9)
    return Tenant.objects.create(name="sweep-tenant", tier=tier)


def test_a_dead_replicas_open_rows_are_completed_with_what_it_last_reported(redis, tenant):
    live = fleet.Heartbeat(lambda: {"state": "ready"}, BEAT_S, ident="replica-1")
    dead = fleet.Heartbeat(lambda: {"state": "ready"}, BEAT_S, ident="replica-2",
                           progress=lambda: {"gen-reported": "0:17", "gen-other-attempt": "0:9"})
    live.beat()
    dead.beat()  # its last beat: then it is killed, and its entry expires
    redis.delete("fleet:replica:replica-2")
    actions.apply_usage(entry("open", "gen-reported", tenant, dead.instance))
    actions.apply_usage(entry("open", "gen-unreported", tenant, dead.instance))
    actions.apply_usage(entry("open", "gen-other-attempt", tenant, dead.instance, attempt=1))  # a batch retry's row
    actions.apply_usage(entry("open", "gen-running", tenant, live.instance))
    used_before = quota.monthly_tokens_used(tenant)

    clock = Clock()
    sweep = Sweeper(live.instance, BEAT_S, clock=clock)
    assert sweep(redis) == 0  # absent, but not for long enough yet: a Redis restart looks the same
    clock.now += GRACE_BEATS * BEAT_S
    assert sweep(redis) == 3

    rows = {r.key: r for r in UsageRecord.objects.all()}
    assert (rows["gen-reported"].closed, rows["gen-reported"].completion_tokens) == (True, 17)
    assert rows["gen-reported"].finish_reason == actions.LOST_REPLICA
    assert (rows["gen-unreported"].closed, rows["gen-unreported"].completion_tokens) == (True, 0)
    assert (rows["gen-other-attempt"].closed, rows["gen-other-attempt"].completion_tokens) == (True, 0)
    assert rows["gen-running"].closed is False  # its replica is alive
    assert quota.monthly_tokens_used(tenant) == used_before + 3 * 40 + 17
    assert not redis.exists(fleet.progress_key(dead.instance))
    assert sweep(redis) == 0  # nothing twice


def test_a_process_that_closes_its_row_after_the_sweep_has_the_last_word(redis, tenant):
    live = fleet.Heartbeat(lambda: {"state": "ready"}, BEAT_S, ident="replica-1")
    live.beat()
    cut_off = "replica-2:4242:feedbeef"  # cut off from Redis: its heartbeats stopped landing
    actions.apply_usage(entry("open", "gen-late", tenant, cut_off))
    used_before = quota.monthly_tokens_used(tenant)
    clock = Clock()
    sweep = Sweeper(live.instance, BEAT_S, clock=clock)
    sweep(redis)
    clock.now += GRACE_BEATS * BEAT_S
    assert sweep(redis) == 1

    actions.apply_usage(entry("close", "gen-late", tenant, cut_off, completion=25))
    quota.charge_monthly_tokens(tenant, 40 + 25)  # what its own settlement counts

    row = UsageRecord.objects.get(key="gen-late")
    assert (row.closed, row.completion_tokens, row.finish_reason) == (True, 25, "length")
    assert quota.monthly_tokens_used(tenant) == used_before + 40 + 25  # the sweep's count given back
