"""Quota policy: which limits a tenant's tier sets, applied through `tenants.limits`.

Every function here either returns the admitting decision or raises an `ApiError` that
names the limit and when to retry. The tier is read from the tenant row the request
already loaded, so a tier change takes effect on the next request.
"""
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.db.models import F, Sum
from django.utils import timezone

from config import redis as shared_redis
from tenants import errors
from tenants.fallback import FallbackLimiter
from tenants.limits import BucketState, Decision, Lease, Limiter, Reservation
from tenants.models import ApiKey, QuotaTier, Tenant, UsageRecord

MINUTE_S = 60.0


# One per Redis URL, deadline and share (tests point REDIS_URL elsewhere); a handful at most.
_limiters: dict[tuple, FallbackLimiter] = {}
_limiters_lock = threading.Lock()


def limiter() -> FallbackLimiter:
    """Limits in Redis, decided by this process alone while Redis does not answer."""
    at = (settings.REDIS_URL, settings.LIMITS_REDIS_TIMEOUT_S, settings.LIMITS_FALLBACK_SHARE)
    with _limiters_lock:
        found = _limiters.get(at)
        if found is None:
            found = _limiters[at] = FallbackLimiter(
                Limiter(shared_redis.admission_client()), Limiter(shared_redis.client()), settings.LIMITS_FALLBACK_SHARE)
        return found


def forget_local_limits() -> None:
    """Drop what every limiter of this process counted on its own (tests: between cases)."""
    with _limiters_lock:
        for found in _limiters.values():
            found.forget()


def _scope(tenant: Tenant) -> str:
    return f"tenant:{tenant.pk}"


def _minute_buckets(tenant: Tenant, requests: int) -> Decision:
    """Charge `requests` to requests/min and report both minute buckets (tokens uncharged).
    A limit of 0 is reported as an empty bucket without asking Redis (it cannot drain)."""
    tier = tenant.tier
    limits = {"requests": (tier.requests_per_minute, requests), "tokens": (tier.tokens_per_minute, 0)}
    live = {name: cost for name, cost in limits.items() if cost[0] > 0}
    decision = limiter().admit(_scope(tenant), MINUTE_S, live) if live else Decision(True, ())
    empty = tuple(BucketState(name, 0, 0, 0.0, 0.0) for name, (limit, _) in limits.items() if limit <= 0)
    return Decision(decision.allowed, decision.buckets + empty)


def _refuse_zero(tier: QuotaTier, field: str, what: str) -> None:
    """A limit an operator set to 0 stops the tier's tenants from doing `what` at all: say
    so (403), rather than a 429 whose Retry-After would never come true."""
    if getattr(tier, field) <= 0:
        raise errors.ApiError(
            403, f"This organization's tier ({tier.name}) allows no {what}: its {field} is 0. Ask the platform's "
                 "operators to raise it.", type="permission_error", code="limit_is_zero")


def admit_request(tenant: Tenant) -> Decision:
    """Count one request against requests/min; also report tokens/min (without charging)."""
    _refuse_zero(tenant.tier, "requests_per_minute", "requests")
    decision = _minute_buckets(tenant, 1)
    if not decision.allowed:
        raise errors.rate_limited(decision)
    return decision


def minute_state(tenant: Tenant) -> tuple[Decision, int]:
    """What is left of the tenant's requests/min and tokens/min buckets (read at cost 0,
    charging nothing) and how many generation slots it holds now. Raises RedisError."""
    return _minute_buckets(tenant, 0), limiter().leases_held(_scope(tenant), "streams")


@dataclass(frozen=True)
class TokenAdmission:
    """What admitting a generation took: the tokens/min decision (None outside tokens/min),
    how many tokens/min units it reserved, and its hold on the monthly budget."""

    decision: Decision | None
    reserved: int
    budget: Reservation


def admit_tokens(tenant: Tenant, prompt_tokens: int, max_tokens: int, choices: int = 1) -> TokenAdmission:
    """Admit a generation of up to `prompt_tokens + max_tokens * choices` tokens.

    Tokens/min and the monthly budget are both reserved up front for the most the request
    can use (as OpenAI does for tokens/min), so a burst of parallel requests cannot overrun
    either; `settle` gives back what it did not use once it ends.
    """
    tier = tenant.tier
    _check_max_tokens(tier, max_tokens)
    _refuse_zero(tier, "tokens_per_minute", "tokens")
    cost = prompt_tokens + max_tokens * choices
    if cost > tier.tokens_per_minute:
        raise errors.ApiError(
            400,
            f"This request may use {cost} tokens, more than this tier's {tier.tokens_per_minute} tokens per minute.",
            code="tokens_exceed_rate_limit",
            param="max_tokens",
        )
    budget = reserve_budget(tenant, cost)
    try:
        decision = limiter().admit(_scope(tenant), MINUTE_S, {"tokens": (tier.tokens_per_minute, cost)})
    except BaseException:
        release_budget(budget)
        raise
    if not decision.allowed:
        release_budget(budget)
        raise errors.rate_limited(decision)
    return TokenAdmission(decision, cost, budget)


def admit_unmetered_tokens(tenant: Tenant, prompt_tokens: int, max_tokens: int, choices: int = 1) -> TokenAdmission:
    """Batch work: outside tokens/min (it runs at the engine's pace in its own lane), but
    within the tier's per-request limit and its monthly budget, reserved up front too."""
    _check_max_tokens(tenant.tier, max_tokens)
    return TokenAdmission(None, 0, reserve_budget(tenant, prompt_tokens + max_tokens * choices))


def _check_max_tokens(tier: QuotaTier, max_tokens: int) -> None:
    if max_tokens > tier.max_tokens_per_request:
        raise errors.ApiError(
            400,
            f"max_tokens is {max_tokens}, above this tier's limit of {tier.max_tokens_per_request}.",
            code="max_tokens_exceeded",
            param="max_tokens",
        )


def settle_tokens(tenant: Tenant, reserved: int, used: int, local: bool = False) -> None:
    """Give back the part of a tokens/min reservation a finished request did not use."""
    if reserved > used:
        limiter().refund(_scope(tenant), "tokens", tenant.tier.tokens_per_minute, MINUTE_S, reserved - used,
                         local=local)


def settle(tenant: Tenant, admission: TokenAdmission, used: int, done: set[str] | None = None) -> None:
    """A generation ended having used `used` tokens: refund tokens/min, settle the budget.
    `done` carries what an earlier attempt settled, so a retry does neither part twice."""
    done = set() if done is None else done
    if "tokens" not in done:
        local = admission.decision is not None and admission.decision.local
        settle_tokens(tenant, admission.reserved, used, local=local)
        done.add("tokens")
    if "budget" not in done:
        settle_budget(tenant, admission.budget, used)
        done.add("budget")


def open_stream(tenant: Tenant, ttl_s: float | None = None, count: int = 1, param: str = "n") -> Lease:
    """Take `count` concurrent-generation slots (one per choice), all or none. The caller
    renews them while generating and closes them in `finally`; if the process dies, they
    free themselves after the lease TTL."""
    tier = tenant.tier
    _refuse_zero(tier, "concurrent_streams", "concurrent generations")
    if count > tier.concurrent_streams:
        raise errors.ApiError(
            400, f"This request runs {count} generations at once (one per choice), more than this tier's "
                 f"{tier.concurrent_streams} concurrent generations.", code="too_many_choices", param=param)
    ttl = settings.STREAM_LEASE_TTL_S if ttl_s is None else ttl_s
    lease, decision = limiter().acquire_lease(_scope(tenant), "streams", tier.concurrent_streams, ttl, count)
    if lease is None:
        raise errors.rate_limited(decision)
    return lease


def open_socket(api_key: ApiKey) -> Lease:
    """One of the key's WS_MAX_SOCKETS_PER_KEY WebSocket slots, renewed while the socket is open."""
    lease, decision = limiter().acquire_lease(f"key:{api_key.pk}", "sockets", settings.WS_MAX_SOCKETS_PER_KEY,
                                              settings.STREAM_LEASE_TTL_S)
    if lease is None:
        raise errors.rate_limited(decision)
    return lease


def renew_socket(lease: Lease) -> bool:
    return limiter().renew_lease(lease)


def close_socket(lease: Lease) -> None:
    limiter().release_lease(lease)


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


def reserve_budget(tenant: Tenant, tokens: int, now: datetime | None = None) -> Reservation:
    """Hold `tokens` against this month's budget while a generation runs (see
    `Limiter.reserve_budget`). The hold lasts STREAM_LEASE_TTL_S unless renewed."""
    now = now or timezone.now()
    name, ttl_s = _month_counter(now)
    budget = tenant.tier.monthly_token_budget
    hold_s = settings.STREAM_LEASE_TTL_S
    def used_so_far() -> int:  # asked only when Redis is away and this process never heard of the month
        return _used_in_database(tenant, now)

    state = limiter().reserve_budget(_scope(tenant), name, budget, tokens, hold_s, ttl_s, used_so_far)
    if state.status == "missing":
        monthly_tokens_used(tenant, now)  # seeds the counter from the usage records
        state = limiter().reserve_budget(_scope(tenant), name, budget, tokens, hold_s, ttl_s, used_so_far)
    if state.status == "reserved":
        return state.reservation
    if state.status == "held":
        raise errors.budget_held(budget, state.used, state.reserved)
    _, end = _month_bounds(now)
    raise errors.quota_exhausted(budget, (end - now).total_seconds())


def renew_budget(reservation: Reservation) -> bool:
    return limiter().renew_reservation(reservation)


def release_budget(reservation: Reservation) -> None:
    """Drop a reservation whose generation never ran."""
    limiter().settle_budget(reservation, 0)


def settle_budget(tenant: Tenant, reservation: Reservation, used: int) -> None:
    """Drop the reservation and count what the generation used in its month's counter."""
    if limiter().settle_budget(reservation, used) is None:
        # Redis lost the counter: rebuild it from the usage records, then count this use.
        now = timezone.now()
        limiter().counter_seed(_scope(tenant), reservation.month, _used_in_database(tenant, now), _month_counter(now)[1])
        limiter().counter_add(_scope(tenant), reservation.month, used)


def charge_monthly_tokens(tenant: Tenant, tokens: int, now: datetime | None = None) -> None:
    """Add used tokens to this month's counter (called after the usage record is written,
    so a seed from the database already includes them). `tokens` may be negative."""
    now = now or timezone.now()
    name, ttl_s = _month_counter(now)
    if limiter().counter_add(_scope(tenant), name, tokens) is None:
        limiter().counter_seed(_scope(tenant), name, _used_in_database(tenant, now), ttl_s)
