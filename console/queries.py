"""Read-only queries behind the console's pages and socket. Writes go through
`tenants.actions` and `batches.actions`, never through here."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone

import redis
from django.db.models import Count, F, OuterRef, QuerySet, Subquery, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from batches.models import Batch, BatchItem
from tenants import quota
from tenants.models import ApiKey, Lane, Tenant, UsageRecord

log = logging.getLogger(__name__)

LATENCY_WINDOW = timedelta(minutes=5)
LATENCY_MAX_ROWS = 5000  # the newest requests of the window: enough for a p99, cheap to sort


def month_start(now: datetime) -> datetime:
    return now.astimezone(dt_timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def tokens_this_month(now: datetime | None = None) -> dict[int, int]:
    """tenant id -> tokens used this month, from the usage records (the billing source of truth)."""
    rows = (UsageRecord.objects.filter(created__gte=month_start(now or timezone.now()))
            .values("tenant_id").annotate(total=Sum(F("prompt_tokens") + F("completion_tokens"))))
    return {row["tenant_id"]: int(row["total"] or 0) for row in rows}


@dataclass(frozen=True)
class LimitsState:
    requests_left: int
    tokens_left: int
    streams_held: int


def limits_state(tenant: Tenant) -> LimitsState | None:
    """What is left of the tenant's per-minute buckets and how many streams it holds now;
    None when Redis does not answer. A cost of 0 reads the buckets without charging them."""
    try:
        decision, streams = quota.minute_state(tenant)
    except redis.RedisError as exc:
        log.warning("console: limits of tenant %s unreadable: %s", tenant.pk, exc)
        return None
    return LimitsState(decision.bucket("requests").remaining, decision.bucket("tokens").remaining, streams)


@dataclass(frozen=True)
class Bar:
    label: str
    value: int
    x: float
    y: float
    height: float


def bars(points: list[tuple[str, int]], width: float = 600, height: float = 120) -> list[Bar]:
    """Bar geometry for a server-rendered SVG chart (no JavaScript needed for history)."""
    top = max((v for _, v in points), default=0) or 1
    step = width / max(len(points), 1)
    return [Bar(label, value, i * step, height - value / top * height, value / top * height)
            for i, (label, value) in enumerate(points)]


def usage_by_day(tenant: Tenant, days: int = 30, now: datetime | None = None) -> list[tuple[str, int]]:
    today = (now or timezone.now()).date()
    first = today - timedelta(days=days - 1)
    rows = (UsageRecord.objects.filter(tenant=tenant, created__date__gte=first)
            .annotate(day=TruncDate("created")).values("day")
            .annotate(total=Sum(F("prompt_tokens") + F("completion_tokens"))))
    totals = {row["day"]: int(row["total"] or 0) for row in rows}
    return [(f"{d:%m-%d}", totals.get(d, 0)) for d in (first + timedelta(days=i) for i in range(days))]


def usage_by_lane(tenant: Tenant, now: datetime | None = None) -> list[tuple[str, int]]:
    rows = (UsageRecord.objects.filter(tenant=tenant, created__gte=month_start(now or timezone.now()))
            .values("lane").annotate(total=Sum(F("prompt_tokens") + F("completion_tokens"))))
    totals = {row["lane"]: int(row["total"] or 0) for row in rows}
    return [(f"P{lane.value}", totals.get(lane.value, 0)) for lane in Lane]


def keys_with_usage(tenant: Tenant, now: datetime | None = None) -> QuerySet[ApiKey]:
    """The tenant's keys, each with this month's requests and tokens (`month_requests`,
    `month_tokens`), in one query: subqueries rather than a join, which would multiply rows."""
    month = UsageRecord.objects.filter(api_key=OuterRef("pk"), created__gte=month_start(now or timezone.now()))
    per_key = month.values("api_key").annotate(requests=Count("pk"), tokens=Sum(F("prompt_tokens") + F("completion_tokens")))
    return tenant.api_keys.annotate(month_requests=Subquery(per_key.values("requests")),
                                    month_tokens=Subquery(per_key.values("tokens")))


def item_counts(batch_ids: list[str]) -> dict[str, dict[str, int]]:
    """batch id -> {item state: count}, for a page of batches in one query."""
    counts: dict[str, dict[str, int]] = {batch_id: {} for batch_id in batch_ids}
    rows = BatchItem.objects.filter(batch_id__in=batch_ids).values_list("batch_id", "state").annotate(n=Count("id"))
    for batch_id, state, n in rows:
        counts[batch_id][state] = n
    return counts


def batch_rows(limit: int = 50) -> list[dict]:
    page = list(Batch.objects.select_related("tenant")[:limit])
    counts = item_counts([b.id for b in page])
    rows = []
    for batch in page:
        by_state = counts[batch.id]
        total = sum(by_state.values())
        done = sum(n for state, n in by_state.items() if state in BatchItem.FINAL)
        rows.append({"batch": batch, "by_state": [(s.value, by_state.get(s.value, 0)) for s in BatchItem.State],
                     "total": total, "done": done, "cancellable": batch.status in (Batch.Status.VALIDATING,
                                                                                  Batch.Status.IN_PROGRESS)})
    return rows


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def latency_by_lane(now: datetime | None = None) -> dict[str, dict]:
    """TTFT and inter-token latency p50/p99 per lane over the last LATENCY_WINDOW, from the
    usage record every request leaves (the engine's own histograms count since it started).
    Inter-token latency of a request: (latency - ttft) / (completion tokens - 1)."""
    since = (now or timezone.now()) - LATENCY_WINDOW
    rows = (UsageRecord.objects.filter(created__gte=since, ttft_ms__isnull=False)
            .order_by("-created").values_list("lane", "ttft_ms", "latency_ms", "completion_tokens")[:LATENCY_MAX_ROWS])
    ttft: dict[int, list[float]] = {lane.value: [] for lane in Lane}
    itl: dict[int, list[float]] = {lane.value: [] for lane in Lane}
    for lane, ttft_ms, latency_ms, tokens in rows:
        ttft[lane].append(ttft_ms)
        if tokens >= 2 and latency_ms is not None:
            itl[lane].append(max(0, latency_ms - ttft_ms) / (tokens - 1))
    result = {}
    for lane in Lane:
        t, i = sorted(ttft[lane.value]), sorted(itl[lane.value])
        result[str(lane.value)] = {"requests": len(t), "ttft_p50_ms": percentile(t, 0.5), "ttft_p99_ms": percentile(t, 0.99),
                                   "itl_p50_ms": percentile(i, 0.5), "itl_p99_ms": percentile(i, 0.99)}
    return result
