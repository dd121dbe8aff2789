"""Usage read back: time buckets in the shape of OpenAI's organization usage API, and rows
for export.

`buckets` answers GET /v1/usage (a tenant's own) and the staff API's usage query: one
bucket per hour or day from `start_time` (aligned down to its boundary, UTC) to `end_time`,
each with one result per group (none for an empty bucket). The sums are the usage
records' own, so the buckets of a range add up to the rows in it. `export_rows` streams the
rows themselves for `manage.py export_usage`.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone

from django.db.models import Count, F, QuerySet, Sum
from django.db.models.functions import TruncDay, TruncHour

from tenants.models import Tenant, UsageRecord

WIDTHS = {"1h": timedelta(hours=1), "1d": timedelta(days=1)}
# What a result may be grouped by: the parameter's value -> the row's field. `api_key_id` is
# OpenAI's name for `key`.
GROUPS = {"key": "api_key__prefix", "api_key_id": "api_key__prefix", "model": "model", "lane": "lane"}
# Buckets per page, as OpenAI bounds them: a default and a most for each width.
LIMITS = {"1h": (24, 168), "1d": (7, 31)}


@dataclass(frozen=True)
class Query:
    start: datetime
    end: datetime
    width: str  # a key of WIDTHS
    group_by: tuple[str, ...]  # keys of GROUPS, deduplicated
    limit: int  # buckets per page


def _floor(at: datetime, width: str) -> datetime:
    at = at.astimezone(dt_timezone.utc)
    return at.replace(minute=0, second=0, microsecond=0) if width == "1h" else at.replace(
        hour=0, minute=0, second=0, microsecond=0)


def _epoch(at: datetime) -> int:
    return int(at.timestamp())


def buckets(rows: QuerySet[UsageRecord], query: Query) -> dict:
    """One page of buckets over `rows` (already narrowed to a tenant, or not)."""
    step = WIDTHS[query.width]
    first = _floor(query.start, query.width)
    starts = []
    at = first
    while at < query.end and len(starts) <= query.limit:
        starts.append(at)
        at += step
    has_more = len(starts) > query.limit
    starts = starts[:query.limit]
    page_end = min(query.end, starts[-1] + step) if starts else first
    trunc = TruncHour if query.width == "1h" else TruncDay
    fields = [GROUPS[g] for g in query.group_by]
    grouped = (rows.filter(created__gte=first, created__lt=page_end)
               .annotate(bucket=trunc("created", tzinfo=dt_timezone.utc))
               .values("bucket", *fields)
               .annotate(input_tokens=Sum("prompt_tokens"), output_tokens=Sum("completion_tokens"),
                         input_cached_tokens=Sum("cached_tokens"), num_model_requests=Count("pk"))
               .order_by("bucket", *fields))
    by_start: dict[int, list[dict]] = {}
    for group in grouped:
        result = {"object": "organization.usage.completions.result",
                  "input_tokens": group["input_tokens"] or 0, "output_tokens": group["output_tokens"] or 0,
                  "input_cached_tokens": group["input_cached_tokens"] or 0,
                  "num_model_requests": group["num_model_requests"],
                  "api_key_id": None, "model": None, "lane": None}
        if "api_key__prefix" in fields:
            prefix = group["api_key__prefix"]
            result["api_key_id"] = f"sk-{prefix}" if prefix else None  # None: batch items and direct writes
        if "model" in fields:
            result["model"] = group["model"]
        if "lane" in fields:
            result["lane"] = group["lane"]
        by_start.setdefault(_epoch(group["bucket"]), []).append(result)
    data = [{"object": "bucket", "start_time": _epoch(start), "end_time": _epoch(min(start + step, query.end)),
             "results": by_start.get(_epoch(start), [])} for start in starts]
    return {"object": "page", "data": data, "has_more": has_more,
            "next_page": str(_epoch(starts[-1] + step)) if has_more else None}


def parse_query(params, now: datetime) -> Query:
    """GET parameters -> Query; ValueError(param, message) names what is wrong."""
    def when(name: str, default: datetime | None) -> datetime:
        raw = params.get(name)
        if raw in (None, ""):
            if default is None:
                raise ValueError(name, f"'{name}' is required: a Unix time in seconds.")
            return default
        try:
            seconds = int(raw)
            return datetime.fromtimestamp(seconds, dt_timezone.utc)
        except (TypeError, ValueError, OverflowError, OSError):
            raise ValueError(name, f"'{name}' must be a Unix time in seconds.") from None

    page = params.get("page")
    start = when("page", None) if page else when("start_time", None)
    end = when("end_time", now)
    if end <= start:
        raise ValueError("end_time", "'end_time' must be after 'start_time'.")
    width = params.get("bucket_width") or "1d"
    if width not in WIDTHS:
        raise ValueError("bucket_width", f"'bucket_width' must be one of {', '.join(WIDTHS)}.")
    group_by: list[str] = []
    for value in params.getlist("group_by") if hasattr(params, "getlist") else [params.get("group_by") or ""]:
        for name in filter(None, (part.strip() for part in value.split(","))):
            if name not in GROUPS:
                raise ValueError("group_by", f"'group_by' takes {', '.join(GROUPS)}; not {name[:40]!r}.")
            canonical = "key" if name == "api_key_id" else name
            if canonical not in group_by:
                group_by.append(canonical)
    default, most = LIMITS[width]
    raw_limit = params.get("limit")
    try:
        limit = default if raw_limit in (None, "") else int(raw_limit)
    except ValueError:
        raise ValueError("limit", "'limit' must be a whole number.") from None
    if not 1 <= limit <= most:
        raise ValueError("limit", f"'limit' must be from 1 to {most} for bucket_width {width}.")
    return Query(start, end, width, tuple(group_by), limit)


EXPORT_FIELDS = ["id", "created", "tenant_id", "tenant", "api_key", "request_id", "model", "endpoint", "lane",
                 "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "ttft_ms", "latency_ms",
                 "finish_reason", "closed"]


def export_rows(since: datetime, until: datetime, tenant: Tenant | None = None) -> Iterator[dict]:
    """Every usage row created in [since, until), oldest first, read in chunks (a month of a
    busy platform does not fit in memory at once)."""
    rows = UsageRecord.objects.filter(created__gte=since, created__lt=until)
    if tenant is not None:
        rows = rows.filter(tenant=tenant)
    rows = rows.order_by("created", "pk").values(
        "pk", "created", "tenant_id", "tenant__name", "api_key__prefix", "request_id", "model", "endpoint", "lane",
        "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms", "latency_ms", "finish_reason", "closed",
    ).annotate(total_tokens=F("prompt_tokens") + F("completion_tokens"))
    for row in rows.iterator(chunk_size=2000):
        yield {"id": row["pk"], "created": row["created"].astimezone(dt_timezone.utc).isoformat(),
               "tenant_id": row["tenant_id"], "tenant": row["tenant__name"],
               "api_key": f"sk-{row['api_key__prefix']}" if row["api_key__prefix"] else None,
               **{name: row[name] for name in EXPORT_FIELDS[5:]}}
