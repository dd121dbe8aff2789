"""Quota policy: which limits a tenant's tier sets, applied through `tenants.limits`.

Every function here either returns the admitting decision or raises an `ApiError` that
names the limit and when to retry. The tier is read from the tenant row the request
already loaded, so a tier change takes effect on the next request.
"""
from datetime import datetime, timedelta, timezone as dt_timezone
from functools import lru_cache

import redis

from django.conf import settings
from django.db.models import F, Sum
from django.utils import timezone

from config import redis as shared_redis
from tenants import errors
from tenants.limits import Decision, Lease, Limiter
from tenants.models import QuotaTier, Tenant, UsageRecord

MINUTE_S = 60.0


def limiter() -> Limiter:
    return _limiter_for(shared_redis.client())


@lru_cache(maxsize=4)
def _limiter_for(client: redis.Redis) -> Limiter:
    return Limiter(client)


def _scope(tenant: Tenant) -> str:
    return f"tenant:{tenant.pk}"


def _minute_buckets(tenant: Tenant, requests: int) -> Decision:
    """Charge `requests` to requests/min and report both minute buckets (tokens uncharged)."""
    tier = tenant.tier
    return limiter().admit(_scope(tenant), MINUTE_S, {"requests": (tier.requests_per_minute, requests),
                                                      "tokens": (tier.tokens_per_minute, 0)})


def admit_request(tenant: Tenant) -> Decision:
    """Count one request against requests/min; also report tokens/min (without charging)."""
    decision = _minute_buckets(tenant, 1)
    if not decision.allowed:
        raise errors.rate_limited(decision)
    return decision


def minute_state(tenant: Tenant) -> tuple[Decision, int]:
    """What is left of the tenant's requests/min and tokens/min buckets (read at cost 0,
    charging nothing) and how many stream leases it holds now. Raises RedisError."""
    return _minute_buckets(tenant, 0), limiter().leases_held(_scope(tenant), "streams")


def admit_tokens(tenant: Tenant, prompt_tokens: int, max_tokens: int, choices: int = 1) -> Decision:
    """Admit a generation of up to `prompt_tokens + max_tokens * choices` tokens.

    Tokens/min is reserved up front for the most the request can use (as OpenAI does), so
    a burst of long requests cannot overrun it; `settle_tokens` gives back what it did not
    use once it ends. The monthly budget counts only what was used.
    """
    tier = tenant.tier
    _check_max_tokens(tier, max_tokens)
    cost = prompt_tokens + max_tokens * choices
    if cost > tier.tokens_per_minute:
        raise errors.ApiError(
            400,
            f"This request may use {cost} tokens, more than this tier's {tier.tokens_per_minute} tokens per minute.",
            code="tokens_exceed_rate_limit",
            param="max_tokens",
        )
    check_monthly_budget(tenant)
    decision = limiter().admit(_scope(tenant), MINUTE_S, {"tokens": (tier.tokens_per_minute, cost)})
    if not decision.allowed:
        raise errors.rate_limited(decision)
    return decision


def admit_unmetered_tokens(tenant: Tenant, max_tokens: int) -> None:
    """Batch work: outside tokens/min (it runs at the engine's pace in its own lane), but
    within the tier's per-request limit and monthly budget."""
    _check_max_tokens(tenant.tier, max_tokens)
    check_monthly_budget(tenant)


def _check_max_tokens(tier: QuotaTier, max_tokens: int) -> None:
    if max_tokens > tier.max_tokens_per_request:
        raise errors.ApiError(
            400,
            f"max_tokens is {max_tokens}, above this tier's limit of {tier.max_tokens_per_request}.",
            code="max_tokens_exceeded",
            param="max_tokens",
        )


def settle_tokens(tenant: Tenant, reserved: int, used: int) -> None:
    """Give back the part of a tokens/min reservation a finished request did not use."""
    if reserved > used:
        limiter().refund(_scope(tenant), "tokens", tenant.tier.tokens_per_minute, MINUTE_S, reserved - used)


def open_stream(tenant: Tenant, ttl_s: float | None = None) -> Lease:
    """Take a concurrent-stream slot. The caller renews it while streaming and closes it
    in `finally`; if the process dies, the slot frees itself after the lease TTL."""
    ttl = settings.STREAM_LEASE_TTL_S if ttl_s is None else ttl_s
    lease, decision = limiter().acquire_lease(_scope(tenant), "streams", tenant.tier.concurrent_streams, ttl)
    if lease is None:
        raise errors.rate_limited(decision)
    return lease


def renew_stream(lease: Lease) -> bool:
    return limiter().renew_lease(lease)


def close_stream(lease: Lease) -> None:
    limiter().release_lease(lease)


# --- monthly budget -----------------------------------------------------------------------


def _month_bounds(now: datetime) -> tuple[datetime, datetime]:
    start = now.astimezone(dt_timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (start + timedelta(days=32)).replace(day=1)
    return start, end


def _month_counter(now: datetime) -> tuple[str, float]:
    """The counter's name and a TTL that outlives its month."""
    start, end = _month_bounds(now)
    return f"monthly_tokens:{start:%Y-%m}", (end - now).total_seconds() + 86400


def _used_in_database(tenant: Tenant, now: datetime) -> int:
    start, end = _month_bounds(now)
    total = UsageRecord.objects.filter(tenant=tenant, created__gte=start, created__lt=end).aggregate(
        total=Sum(F("prompt_tokens") + F("completion_tokens"))
    )["total"]
    return int(total or 0)


def monthly_tokens_used(tenant: Tenant, now: datetime | None = None) -> int:
    """This month's tokens, from Redis; seeded from the usage records if Redis lost it."""
    now = now or timezone.now()
    name, ttl_s = _month_counter(now)
    used = limiter().counter_get(_scope(tenant), name)
    if used is None:
        used = limiter().counter_seed(_scope(tenant), name, _used_in_database(tenant, now), ttl_s)
    return used


def check_monthly_budget(tenant: Tenant, now: datetime | None = None) -> None:
    now = now or timezone.now()
    budget = tenant.tier.monthly_token_budget
    if monthly_tokens_used(tenant, now) >= budget:
        _, end = _month_bounds(now)
        raise errors.quota_exhausted(budget, (end - now).total_seconds())


def charge_monthly_tokens(tenant: Tenant, tokens: int, now: datetime | None = None) -> None:
    """Add used tokens to this month's counter (called after the usage record is written,
    so a seed from the database already includes them)."""
    now = now or timezone.now()
    name, ttl_s = _month_counter(now)
    if limiter().counter_add(_scope(tenant), name, tokens) is None:
        limiter().counter_seed(_scope(tenant), name, _used_in_database(tenant, now), ttl_s)
