"""Quota policy: which limits a tenant's tier sets, applied through `tenants.limits`.

Every function here either returns the admitting decision or raises an `ApiError` that
names the limit and when to retry. The tier is read from the tenant row the request
already loaded, so a tier change takes effect on the next request.
"""
import threading
from collections.abc import Callable
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
    at = (settings.REDIS_URL, settings.LIMITS_REDIS_TIMEOUT_S, settings.LIMITS_FALLBACK_SHARE,
          settings.LIMITS_REDIS_CONFIRM_S)
    with _limiters_lock:
        found = _limiters.get(at)
        if found is None:
            found = _limiters[at] = FallbackLimiter(
                Limiter(shared_redis.admission_client()), Limiter(shared_redis.client()), settings.LIMITS_FALLBACK_SHARE,
                confirm=Limiter(shared_redis.confirm_client()), confirm_s=settings.LIMITS_REDIS_CONFIRM_S)
        return found


def forget_local_limits() -> None:
    """Drop what every limiter of this process counted on its own (tests: between cases)."""
    with _limiters_lock:
        for found in _limiters.values():
            found.forget()


def _scope(tenant: Tenant) -> str:
    return f"tenant:{tenant.pk}"


def _key_bucket(api_key: ApiKey, kind: str) -> str:
    """A key's own bucket of `kind`, kept in its tenant's scope: one atomic check takes both."""
    return f"{kind}@key{api_key.pk}"


def _key_limits(api_key: ApiKey | None, kind: str, cost: int) -> dict[str, tuple[int, int]]:
    """The key's own bucket of `kind` at `cost`, if it has a limit of its own."""
    limit = getattr(api_key, f"{kind}_per_minute", None) if api_key is not None else None
    return {} if limit is None else {_key_bucket(api_key, kind): (limit, cost)}


def _minute_buckets(tenant: Tenant, requests: int, api_key: ApiKey | None = None) -> Decision:
    """Charge `requests` to requests/min and report both minute buckets (tokens uncharged),
    the key's own beside the tenant's where it has them.
    A limit of 0 is reported as an empty bucket without asking Redis (it cannot drain)."""
    tier = tenant.tier
    limits = {"requests": (tier.requests_per_minute, requests), "tokens": (tier.tokens_per_minute, 0),
              **_key_limits(api_key, "requests", requests), **_key_limits(api_key, "tokens", 0)}
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


def _refuse_zero_for_key(api_key: ApiKey | None, field: str, what: str) -> None:
    if api_key is not None and getattr(api_key, field) == 0:
        raise errors.ApiError(
            403, f"This API key allows no {what}: its own {field} is 0.", type="permission_error",
            code="limit_is_zero")


def admit_request(tenant: Tenant, api_key: ApiKey | None = None) -> Decision:
    """Count one request against requests/min (the tenant's, and the key's own if it has one);
    also report tokens/min (without charging)."""
    _refuse_zero(tenant.tier, "requests_per_minute", "requests")
    _refuse_zero_for_key(api_key, "requests_per_minute", "requests")
    decision = _minute_buckets(tenant, 1, api_key)
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
    how many tokens/min units it reserved and in which buckets (name, limit), and its holds
    on the monthly budgets: the tenant's, and the key's own if it has one."""

    decision: Decision | None
    reserved: int
    budget: Reservation
    key_budget: Reservation | None = None
    buckets: tuple[tuple[str, int], ...] = ()

    @property
    def holds(self) -> tuple[Reservation, ...]:
        return (self.budget,) if self.key_budget is None else (self.budget, self.key_budget)


def admit_tokens(tenant: Tenant, prompt_tokens: int, max_tokens: int, choices: int = 1,
                 api_key: ApiKey | None = None) -> TokenAdmission:
    """Admit a generation of up to `prompt_tokens + max_tokens * choices` tokens.

    Tokens/min and the monthly budget are both reserved up front for the most the request
    can use (as OpenAI does for tokens/min), so a burst of parallel requests cannot overrun
    either; `settle` gives back what it did not use once it ends. A key's own limits are
    reserved beside its tenant's, all or none.
    """
    tier = tenant.tier
    _check_max_tokens(tier, max_tokens)
    _refuse_zero(tier, "tokens_per_minute", "tokens")
    _refuse_zero_for_key(api_key, "tokens_per_minute", "tokens")
    cost = prompt_tokens + max_tokens * choices
    key_tpm = api_key.tokens_per_minute if api_key is not None else None
    if cost > tier.tokens_per_minute or (key_tpm is not None and cost > key_tpm):
        whose, limit = ("this API key's", key_tpm) if key_tpm is not None and key_tpm < tier.tokens_per_minute \
            else ("this tier's", tier.tokens_per_minute)
        raise errors.ApiError(
            400,
            f"This request may use {cost} tokens, more than {whose} {limit} tokens per minute.",
            code="tokens_exceed_rate_limit",
            param="max_tokens",
        )
    costs = {"tokens": (tier.tokens_per_minute, cost), **_key_limits(api_key, "tokens", cost)}
    holds = _reserve_budgets(tenant, api_key, cost)
    try:
        decision = limiter().admit(_scope(tenant), MINUTE_S, costs)
    except BaseException:
        _release(holds)
        raise
    if not decision.allowed:
        _release(holds)
        raise errors.rate_limited(decision)
    return TokenAdmission(decision, cost, *holds, buckets=tuple((name, limit) for name, (limit, _) in costs.items()))


def admit_unmetered_tokens(tenant: Tenant, prompt_tokens: int, max_tokens: int, choices: int = 1,
                           api_key: ApiKey | None = None) -> TokenAdmission:
    """Batch work: outside tokens/min (it runs at the engine's pace in its own lane), but
    within the tier's per-request limit and its monthly budget, reserved up front too."""
    _check_max_tokens(tenant.tier, max_tokens)
    return TokenAdmission(None, 0, *_reserve_budgets(tenant, api_key, prompt_tokens + max_tokens * choices))


def _reserve_budgets(tenant: Tenant, api_key: ApiKey | None, tokens: int) -> tuple[Reservation, Reservation | None]:
    """The tenant's hold, then the key's own (if it has a budget): both or neither."""
    budget = reserve_budget(tenant, tokens)
    if api_key is None or api_key.monthly_token_budget is None:
        return budget, None
    try:
        return budget, reserve_key_budget(api_key, tokens)
    except BaseException:
        release_budget(budget)
        raise


def _release(holds: tuple[Reservation, Reservation | None]) -> None:
    for hold in holds:
        if hold is not None:
            release_budget(hold)


def _check_max_tokens(tier: QuotaTier, max_tokens: int) -> None:
    if max_tokens > tier.max_tokens_per_request:
        raise errors.ApiError(
            400,
            f"max_tokens is {max_tokens}, above this tier's limit of {tier.max_tokens_per_request}.",
            code="max_tokens_exceeded",
            param="max_tokens",
        )


def settle_tokens(tenant: Tenant, reserved: int, used: int, local: bool = False,
                  buckets: tuple[tuple[str, int], ...] = ()) -> None:
    """Give back the part of a tokens/min reservation a finished request did not use, to each
    bucket it was taken from (the tenant's, and the key's own)."""
    if reserved > used:
        for name, limit in buckets or (("tokens", tenant.tier.tokens_per_minute),):
            limiter().refund(_scope(tenant), name, limit, MINUTE_S, reserved - used, local=local)


def settle(tenant: Tenant, admission: TokenAdmission, used: int, done: set[str] | None = None) -> None:
    """A generation ended having used `used` tokens: refund tokens/min, settle the budgets.
    `done` carries what an earlier attempt settled, so a retry does no part twice."""
    done = set() if done is None else done
    if "tokens" not in done:
        local = admission.decision is not None and admission.decision.local
        settle_tokens(tenant, admission.reserved, used, local=local, buckets=admission.buckets)
        done.add("tokens")
    if "budget" not in done:
        settle_budget(tenant, admission.budget, used)
        done.add("budget")
    if admission.key_budget is not None and "key_budget" not in done:
        settle_key_budget(admission.key_budget, used)
        done.add("key_budget")


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


def _used_in_database(tenant: Tenant, now: datetime, api_key: ApiKey | None = None) -> int:
    """The month's tokens in the usage records: the tenant's, or one of its keys'."""
    start, end = _month_bounds(now)
    rows = UsageRecord.objects.filter(tenant=tenant, created__gte=start, created__lt=end)
    if api_key is not None:
        rows = rows.filter(api_key=api_key)
    total = rows.aggregate(total=Sum(F("prompt_tokens") + F("completion_tokens")))["total"]
    return int(total or 0)


def _key_scope(api_key: ApiKey) -> str:
    return f"key:{api_key.pk}"


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


def _reserve(scope: str, budget: int, tokens: int, used: Callable[[], int], now: datetime,
             of_key: bool = False) -> Reservation:
    """Hold `tokens` against a month's budget while a generation runs (see
    `Limiter.reserve_budget`); `used` counts the month in the usage records when Redis lost
    the counter (or is away). The hold lasts STREAM_LEASE_TTL_S unless renewed."""
    name, ttl_s = _month_counter(now)
    hold_s = settings.STREAM_LEASE_TTL_S
    state = limiter().reserve_budget(scope, name, budget, tokens, hold_s, ttl_s, used)
    if state.status == "missing":
        limiter().counter_seed(scope, name, used(), ttl_s)
        state = limiter().reserve_budget(scope, name, budget, tokens, hold_s, ttl_s, used)
    if state.status == "reserved":
        return state.reservation
    if state.status == "held":
        raise errors.budget_held(budget, state.used, state.reserved, of_key=of_key)
    _, end = _month_bounds(now)
    raise errors.quota_exhausted(budget, (end - now).total_seconds(), of_key=of_key)


def reserve_budget(tenant: Tenant, tokens: int, now: datetime | None = None) -> Reservation:
    """Hold `tokens` against the tenant's budget this month."""
    now = now or timezone.now()
    return _reserve(_scope(tenant), tenant.tier.monthly_token_budget, tokens,
                    lambda: _used_in_database(tenant, now), now)


def reserve_key_budget(api_key: ApiKey, tokens: int, now: datetime | None = None) -> Reservation:
    """Hold `tokens` against the key's own budget this month (it has one)."""
    now = now or timezone.now()
    return _reserve(_key_scope(api_key), api_key.monthly_token_budget, tokens,
                    lambda: _used_in_database(api_key.tenant, now, api_key), now, of_key=True)


def renew_budget(reservation: Reservation) -> bool:
    return limiter().renew_reservation(reservation)


def release_budget(reservation: Reservation) -> None:
    """Drop a reservation whose generation never ran."""
    limiter().settle_budget(reservation, 0)


def _settle(scope: str, reservation: Reservation, used: int, used_in_database: Callable[[datetime], int]) -> None:
    if limiter().settle_budget(reservation, used) is None:
        # Redis lost the counter: rebuild it from the usage records, then count this use.
        now = timezone.now()
        limiter().counter_seed(scope, reservation.month, used_in_database(now), _month_counter(now)[1])
        limiter().counter_add(scope, reservation.month, used)


def settle_budget(tenant: Tenant, reservation: Reservation, used: int) -> None:
    """Drop the reservation and count what the generation used in its month's counter."""
    _settle(_scope(tenant), reservation, used, lambda now: _used_in_database(tenant, now))


def settle_key_budget(reservation: Reservation, used: int) -> None:
    """As `settle_budget`, for a key's own budget (the reservation names the key's scope)."""
    def used_in_database(now: datetime) -> int:  # only when Redis lost the counter
        api_key = ApiKey.objects.select_related("tenant").get(pk=int(reservation.scope.removeprefix("key:")))
        return _used_in_database(api_key.tenant, now, api_key)

    _settle(reservation.scope, reservation, used, used_in_database)


def charge_monthly_tokens(tenant: Tenant, tokens: int, now: datetime | None = None,
                          api_key: ApiKey | None = None) -> None:
    """Add used tokens to this month's counter, and to the key's own if it has a budget
    (called after the usage record is written, so a seed from the database already includes
    them). `tokens` may be negative."""
    now = now or timezone.now()
    name, ttl_s = _month_counter(now)
    if limiter().counter_add(_scope(tenant), name, tokens) is None:
        limiter().counter_seed(_scope(tenant), name, _used_in_database(tenant, now), ttl_s)
    if api_key is not None and api_key.monthly_token_budget is not None:
        if limiter().counter_add(_key_scope(api_key), name, tokens) is None:
            limiter().counter_seed(_key_scope(api_key), name, _used_in_database(tenant, now, api_key), ttl_s)
