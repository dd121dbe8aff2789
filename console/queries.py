"""Read-only queries behind the console's pages and socket. Writes go through
`tenants.actions` and `batches.actions`, never through here."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone

import redis
from django.conf import settings
from django.core.paginator import Page, Paginator
from django.db.models import Count, F, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.functions import Coalesce, TruncDate
from django.utils import timezone

from batches.models import Batch, BatchItem
from inference import refusals
from tenants import quota
from tenants.models import ApiKey, Lane, PromptCapture, Tenant, UsageRecord

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


TENANT_SORTS = {"name": ("name",), "usage": ("-month_tokens", "name"), "tier": ("tier__lane", "tier__name", "name"),
                "created": ("-created", "name")}
TENANTS_PER_PAGE = 50


def tenant_page(search: str, sort: str, number: str | int, now: datetime | None = None) -> Page:
    """One page of tenants whose name or tier matches `search`, each with this month's tokens
    (`month_tokens`), sorted by TENANT_SORTS[sort]: two queries (the count and the page),
    however many tenants, because the usage is a subquery of the page's query."""
    month = (UsageRecord.objects.filter(tenant=OuterRef("pk"), created__gte=month_start(now or timezone.now()))
             .values("tenant").annotate(total=Sum(F("prompt_tokens") + F("completion_tokens"))).values("total"))
    tenants = Tenant.objects.select_related("tier").annotate(month_tokens=Coalesce(Subquery(month), 0))
    if search:
        tenants = tenants.filter(Q(name__icontains=search) | Q(tier__name__icontains=search))
    tenants = tenants.order_by(*TENANT_SORTS.get(sort, TENANT_SORTS["name"]))
    return Paginator(tenants, TENANTS_PER_PAGE).get_page(number)


def budget_pct(used: int, budget: int) -> int:
    return min(100, round(100 * used / budget)) if budget else 100


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


def usage_by_day(tenant: Tenant, days: int = 30, now: datetime | None = None) -> dict[str, list[int]]:
    """The tenant's tokens per UTC day over the last `days`, as the chart's columns: `t`, each
    day's start in Unix seconds, and `tokens`."""
    today = (now or timezone.now()).astimezone(dt_timezone.utc).date()
    first = today - timedelta(days=days - 1)
    rows = (UsageRecord.objects.filter(tenant=tenant, created__date__gte=first)
            .annotate(day=TruncDate("created", tzinfo=dt_timezone.utc)).values("day")
            .annotate(total=Sum(F("prompt_tokens") + F("completion_tokens"))))
    totals = {row["day"]: int(row["total"] or 0) for row in rows}
    dates = [first + timedelta(days=i) for i in range(days)]
    return {"t": [int(datetime(d.year, d.month, d.day, tzinfo=dt_timezone.utc).timestamp()) for d in dates],
            "tokens": [totals.get(d, 0) for d in dates]}


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


# The segments of a batch's progress bar, in the order drawn: what ended and how, then what runs.
PROGRESS_STATES = (BatchItem.State.SUCCEEDED, BatchItem.State.FAILED, BatchItem.State.CANCELLED,
                   BatchItem.State.EXPIRED, BatchItem.State.RUNNING)


@dataclass(frozen=True)
class Progress:
    total: int
    done: int  # items in a final state, however they ended
    segments: list[tuple[str, int, float]]  # (state, items, percent of the total)

    @property
    def label(self) -> str:
        parts = [f"{n} {state}" for state, n, _ in self.segments if n]
        return f"{', '.join(parts) or 'nothing finished'} of {self.total}"


def progress(by_state: dict[str, int]) -> Progress:
    total = sum(by_state.values())
    done = sum(n for state, n in by_state.items() if state in BatchItem.FINAL)
    return Progress(total, done, [(state.value, by_state.get(state, 0), 100 * by_state.get(state, 0) / (total or 1))
                                  for state in PROGRESS_STATES])


def batch_rows(limit: int = 50) -> list[dict]:
    page = list(Batch.objects.select_related("tenant")[:limit])
    counts = item_counts([b.id for b in page])
    return [{"batch": batch, "by_state": [(s.value, counts[batch.id].get(s.value, 0)) for s in BatchItem.State],
             "progress": progress(counts[batch.id])} for batch in page]


def cancellable(batch: Batch) -> bool:
    return batch.status in (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS)


@dataclass(frozen=True)
class Pace:
    items_per_min: float
    tokens_per_s: float
    eta: timedelta | None  # None: nothing has finished yet, so no rate to go by


def pace(batch: Batch, done: int, total: int, tokens: int, now: datetime | None = None) -> Pace | None:
    """How fast a running batch goes since it started, and when it ends at that rate; None
    once it stopped running (its rate is history, the timestamps say it)."""
    if batch.status != Batch.Status.IN_PROGRESS or batch.in_progress_at is None:
        return None
    elapsed = max(1.0, ((now or timezone.now()) - batch.in_progress_at).total_seconds())
    per_s = done / elapsed
    eta = timedelta(seconds=round((total - done) / per_s)) if per_s > 0 else None
    return Pace(60 * per_s, tokens / elapsed, eta)


FAILED_SHOWN = 50


def failed_items(batch: Batch, limit: int = FAILED_SHOWN) -> list[dict]:
    """The first failed items by line, each with the error its output line carries: the
    endpoint's error body when it answered, else the item's own (transport, attempts)."""
    rows = []
    for line, custom_id, status_code, response, error in (
            batch.items.filter(state=BatchItem.State.FAILED).order_by("line")
            .values_list("line", "custom_id", "status_code", "response", "error")[:limit]):
        body = (response or {}).get("error") if isinstance(response, dict) else None
        detail = body or error or {}
        rows.append({"line": line, "custom_id": custom_id, "status_code": status_code,
                     "code": detail.get("code") or detail.get("type") or "", "message": detail.get("message", "")})
    return rows


TAIL_MAX = 500
TAIL_DEFAULT = 100


REFUSED = "refused"


@dataclass(frozen=True)
class TailFilter:
    tenant: str = ""  # a substring of the tenant's name
    endpoint: str = ""  # a substring of the API path ("batch" for batch items)
    lane: int | None = None
    # "open" (still running) or a finish reason (stop, length, abort, error): admitted requests;
    # "refused", or an HTTP status ("429"): refused ones
    status: str = ""
    key_prefix: str = ""
    limit: int = TAIL_DEFAULT

    @property
    def refusals_only(self) -> bool:
        return self.status == REFUSED or self.status.isdigit()

    @property
    def admitted_only(self) -> bool:
        # A refusal has no lane: it never reached one.
        return bool(self.status and not self.refusals_only) or self.lane is not None


@dataclass(frozen=True)
class RefusedRow:
    """A refused request in the tail, beside the usage rows (inference.refusals)."""

    created: datetime
    tenant_id: int | None
    tenant_name: str
    key_prefix: str
    endpoint: str
    status: int
    code: str
    message: str
    duration_ms: int | None
    refused: bool = True


@dataclass(frozen=True)
class Tail:
    rows: list  # UsageRecord and RefusedRow, newest first
    refusals_error: str = ""  # why refusals are missing (Redis did not answer), else ""


def request_tail(f: TailFilter) -> Tail:
    """The newest requests across tenants: the admitted ones from their usage rows (every
    generation leaves one, aborted ones too), merged with the refused ones (inference.refusals)."""
    limit = max(1, min(f.limit, TAIL_MAX))
    rows: list = [] if f.refusals_only else admitted_tail(f, limit)
    error = ""
    if not f.admitted_only:
        try:
            rows += refused_tail(f, limit)
        except redis.RedisError as exc:
            log.warning("console: refusals unreadable: %s: %s", type(exc).__name__, exc)
            error = f"refused requests are not shown: Redis did not answer ({type(exc).__name__})"
    rows.sort(key=lambda r: r.created, reverse=True)
    return Tail(rows[:limit], error)


def refused_tail(f: TailFilter, limit: int) -> list[RefusedRow]:
    """The newest refusals that match `f`: one Redis read, one query for their tenants' names."""
    found = refusals.newest(settings.REFUSALS_KEPT)
    names = dict(Tenant.objects.filter(pk__in={r.tenant_id for r in found if r.tenant_id is not None})
                 .values_list("pk", "name"))
    prefix = f.key_prefix.removeprefix("sk-").rstrip("_…")
    rows = []
    for r in found:
        name = names.get(r.tenant_id, "")
        if ((f.tenant and f.tenant.lower() not in name.lower()) or (f.endpoint and f.endpoint.lower() not in r.endpoint.lower())
                or (prefix and not r.key_prefix.startswith(prefix)) or (f.status.isdigit() and str(r.status) != f.status)):
            continue
        rows.append(RefusedRow(created=datetime.fromtimestamp(r.at, dt_timezone.utc), tenant_id=r.tenant_id,
                               tenant_name=name, key_prefix=r.key_prefix, endpoint=r.endpoint, status=r.status,
                               code=r.code or r.type, message=r.message, duration_ms=r.duration_ms))
        if len(rows) == limit:
            break
    return rows


def admitted_tail(f: TailFilter, limit: int) -> list[UsageRecord]:
    """The newest admitted requests from their usage rows: one query, the tenant and key joined."""
    # `captured`: the prompt, where the tenant's debug capture (off by default) stored one.
    captured = PromptCapture.objects.filter(tenant=OuterRef("tenant"), request_id=OuterRef("request_id")).values("prompt")
    rows = UsageRecord.objects.select_related("tenant", "api_key").only(
        "created", "tenant__name", "api_key__prefix", "endpoint", "lane", "closed", "finish_reason", "prompt_tokens",
        "cached_tokens", "completion_tokens", "ttft_ms", "latency_ms", "model", "request_id", "batch",
    ).annotate(captured=Subquery(captured[:1]))
    if f.tenant:
        rows = rows.filter(tenant__name__icontains=f.tenant)
    if f.endpoint:
        rows = rows.filter(endpoint__icontains=f.endpoint)
    if f.lane is not None:
        rows = rows.filter(lane=f.lane)
    if f.status == "open":
        rows = rows.filter(closed=False)
    elif f.status:
        rows = rows.filter(closed=True, finish_reason__contains=f.status)
    if f.key_prefix:
        rows = rows.filter(api_key__prefix__startswith=f.key_prefix.removeprefix("sk-").rstrip("_…"))
    return list(rows.order_by("-created", "-pk")[:limit])


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
