"""Usage rows left open by a web process that died, completed by a live replica.

A generation's row is written open at admission, naming the process that serves it
(`UsageRecord.replica`, `inference.fleet.instance()`), and closed by that process at the end.
A process killed mid-generation never closes its rows. Every replica's heartbeat thread runs
a `Sweeper` every few beats: a process whose rows are open and whose instance has been absent
from the fleet for `GRACE_BEATS` heartbeats is dead, and each of its open rows is closed with

- the prompt tokens it was opened with, and the completion tokens its process last reported
  (each heartbeat writes `fleet:progress:<instance>`: at most one heartbeat of tokens is not
  billed), or none when no report of that row's attempt survives;
- finish_reason `replica_lost`; and those tokens counted into the tenant's month.

Its slots and reservations need nothing: they lapse by their TTL (STREAM_LEASE_TTL_S). A row
whose process closes it after all (it was cut off from Redis, not dead) takes that close and
gives back what the sweep counted (tenants.actions.apply_usage). Entries live three beats, so
a Redis restart that empties the fleet for one beat closes nothing; one replica sweeps at a
time (a Redis lock).
"""
from __future__ import annotations

import logging
import time

import redis

from inference import fleet
from tenants import quota
from tenants.actions import LOST_REPLICA
from tenants.models import UsageRecord

log = logging.getLogger(__name__)

GRACE_BEATS = 2 * fleet.MISSED_BEATS
LOCK = "fleet:sweep"


class Sweeper:
    def __init__(self, own_instance: str, beat_s: float, clock=time.monotonic) -> None:
        self.own, self.beat_s, self.clock = own_instance, beat_s, clock
        self._absent_since: dict[str, float] = {}

    def __call__(self, client: redis.Redis) -> int:
        """One pass; returns how many rows it completed."""
        if not client.set(LOCK, self.own, nx=True, px=round(self.beat_s * fleet.SWEEP_EVERY_BEATS * 1000)):
            return 0  # another replica is sweeping
        try:
            return self._sweep(client)
        finally:
            client.delete(LOCK)

    def _sweep(self, client: redis.Redis) -> int:
        live = {report.get("instance") for report in fleet.replicas(client)} | {self.own}
        absent = set(UsageRecord.objects.filter(closed=False).exclude(replica="").exclude(replica__in=live)
                     .values_list("replica", flat=True).distinct())
        now = self.clock()
        self._absent_since = {instance: self._absent_since.get(instance, now) for instance in absent}
        grace = GRACE_BEATS * self.beat_s
        dead = [instance for instance, since in self._absent_since.items() if now - since >= grace]
        return sum(self._complete(client, instance) for instance in dead)

    def _complete(self, client: redis.Redis, instance: str) -> int:
        reported = {key.decode(): value.decode() for key, value in client.hgetall(fleet.progress_key(instance)).items()}
        completed = 0
        for row in UsageRecord.objects.filter(closed=False, replica=instance).select_related("tenant", "api_key"):
            attempt, _, tokens = reported.get(row.key or "", "").partition(":")
            generated = int(tokens) if attempt == str(row.attempt) and tokens.isdigit() else 0
            # Only an open row of the same attempt: its process, or a later attempt, may have
            # written it meanwhile.
            if UsageRecord.objects.filter(pk=row.pk, closed=False, attempt=row.attempt).update(
                    closed=True, completion_tokens=generated, finish_reason=LOST_REPLICA):
                completed += 1
                try:
                    quota.charge_monthly_tokens(row.tenant, row.prompt_tokens + generated, row.created, row.api_key)
                except redis.RedisError as exc:  # the month's counter is rebuilt from the rows if lost
                    log.warning("usage %s: completed, but its %d tokens are not in the month's counter: %s",
                                row.key, row.prompt_tokens + generated, exc)
        log.warning("replica process %s left the fleet with %d usage rows open: completed them with the %d "
                    "progress reports it left", instance, completed, len(reported))
        client.delete(fleet.progress_key(instance))
        self._absent_since.pop(instance, None)
        return completed
