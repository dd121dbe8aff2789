"""Limit mechanisms in Redis: rate buckets, concurrent-stream leases, monthly counters.

Each check is one Lua script, so it is atomic across every process that shares the Redis,
and it reads the clock from Redis (`TIME`) so processes on different hosts agree on it.
This module knows nothing about tenants or tiers (see `tenants.quota` for the policy);
it imports no Django, so tests and tools can drive it against any Redis.
"""
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import redis

# Token buckets over several limits at once, all or nothing. A bucket stores its level
# (units used and not yet drained) and when it was written; it drains at limit/period.
# Storing units rather than a theoretical arrival time (GCRA) lets a tier change apply at
# once: the level is still the tenant's recent use, measured against the new limit.
# KEYS: the buckets. ARGV: period_ms, then (limit, cost) per bucket; a cost of 0 only reads.
# Returns: admitted, then per bucket (remaining, retry_after_ms, reset_ms);
# retry_after_ms is -1 when the cost can never fit.
_TOKEN_BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local period = tonumber(ARGV[1])
local admitted = 1
local rows = {}
for i = 1, #KEYS do
  local limit = tonumber(ARGV[2 * i])
  local cost = tonumber(ARGV[2 * i + 1])
  local rate = limit / period
  local level = 0
  local stored = redis.call('GET', KEYS[i])
  if stored then
    local sep = string.find(stored, ' ')
    local old, at = tonumber(string.sub(stored, 1, sep - 1)), tonumber(string.sub(stored, sep + 1))
    -- Clamped so a downgrade never makes a tenant wait longer than one period.
    level = math.min(limit, math.max(0, old - (now - at) * rate))
  end
  local retry = 0
  if cost > limit then
    retry = -1
  elseif level + cost - limit > 1e-9 then
    retry = math.ceil((level + cost - limit) / rate)
  end
  if retry ~= 0 then admitted = 0 end
  rows[i] = {level, cost, rate, retry}
end
local out = {admitted}
for i = 1, #KEYS do
  local level, cost, rate, retry = rows[i][1], rows[i][2], rows[i][3], rows[i][4]
  local limit = tonumber(ARGV[2 * i])
  if admitted == 1 and cost > 0 then
    level = level + cost
    redis.call('SET', KEYS[i], string.format('%.17g %.17g', level, now), 'PX', math.ceil(level / rate) + 1)
  end
  table.insert(out, math.max(0, math.floor(limit - level + 1e-9)))
  table.insert(out, retry)
  table.insert(out, math.ceil(level / rate))
end
return out
"""

# Concurrent leases: a sorted set of lease member -> expiry. A lease of `count` slots (a
# generation with n choices) is `count` members, taken all or none. Expired members are
# dropped before counting, so a lease whose holder died without releasing frees itself
# after its TTL. KEYS: the set. ARGV: limit, ttl_ms, lease id, count.
# Returns: admitted, members held, retry_after_ms (-1 when count can never fit the limit).
_LEASE_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local limit, ttl, count = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held + count > limit then
  if count > limit then return {0, held, -1} end
  -- The (held + count - limit)-th expiry frees enough slots.
  local nth = redis.call('ZRANGE', KEYS[1], held + count - limit - 1, held + count - limit - 1, 'WITHSCORES')
  return {0, held, math.ceil(tonumber(nth[2]) - now)}
end
for i = 0, count - 1 do
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[3] .. ':' .. i)
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(last[2]) - now) + 1)
return {1, held + count, 0}
"""

# Renewal puts the lease's members back whether or not they had expired: the generation
# they count is still running, so it must be counted. (A Redis outage longer than the TTL
# would otherwise leave it uncounted and let the tenant start more than its limit; if
# someone took the freed slots meanwhile, the tenant is over its limit until one of its
# generations ends, and new ones are refused until then.)
# KEYS: the set. ARGV: ttl_ms, lease id, count. Returns 1 if every member was live, else 0.
_LEASE_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local ttl, count = tonumber(ARGV[1]), tonumber(ARGV[3])
local live = 1
for i = 0, count - 1 do
  local member = ARGV[2] .. ':' .. i
  local expiry = redis.call('ZSCORE', KEYS[1], member)
  if not expiry or tonumber(expiry) <= now then live = 0 end
  redis.call('ZADD', KEYS[1], now + ttl, member)
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(last[2]) - now) + 1)
return live
"""

# Move a bucket's level by signed units: a refund gives back what a reservation left unused;
# a charge adds what a process admitted alone while Redis was away. KEYS: the bucket.
# ARGV: period_ms, limit, units (> 0 gives back). The level drains first, then moves, and
# stays within [0, limit].
_TOKEN_ADJUST = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local period, limit, units = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local rate = limit / period
local level = 0
local stored = redis.call('GET', KEYS[1])
if stored then
  local sep = string.find(stored, ' ')
  local old, at = tonumber(string.sub(stored, 1, sep - 1)), tonumber(string.sub(stored, sep + 1))
  level = math.max(0, math.min(limit, old - (now - at) * rate))
elseif units >= 0 then
  return 0
end
level = math.min(limit, math.max(0, level - units))
if level <= 0 then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], string.format('%.17g %.17g', level, now), 'PX', math.ceil(level / rate) + 1)
end
return 1
"""

# A monthly counter holds the tokens used (settled); a missing one must be seeded from the
# database first (Redis may have lost it). KEYS: the counter. ARGV: amount (may be negative:
# a replaced batch attempt's usage given back). Returns the new total, or nil when missing.
_COUNTER_ADD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local total = redis.call('INCRBY', KEYS[1], ARGV[1])
if total < 0 then redis.call('SET', KEYS[1], 0, 'KEEPTTL') return 0 end
return total
"""

# Budget reservations: while a generation runs, the most it can still use is held against
# the budget, so parallel requests cannot each pass the check and together overspend it.
# A sorted set (id -> expiry, renewed while the generation runs, so a dead holder's hold
# lapses) and a hash (id -> tokens) beside the settled counter.
# KEYS: counter, reservation expiries, reservation amounts.
# ARGV: budget, tokens, id, ttl_ms, keys_ttl_ms.
# Returns {status, used, reserved}: status 1 admitted, 0 the budget is used up, 2 the rest
# is reserved by generations in flight, -1 the counter is missing (seed it, then retry).
_BUDGET_RESERVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0, 0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local budget, tokens, ttl, keys_ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4]), tonumber(ARGV[5])
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('HDEL', KEYS[3], gone)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local used = tonumber(redis.call('GET', KEYS[1]))
local reserved = 0
for _, amount in ipairs(redis.call('HVALS', KEYS[3])) do reserved = reserved + tonumber(amount) end
if used >= budget then return {0, used, reserved} end
if used + reserved >= budget then return {2, used, reserved} end
redis.call('ZADD', KEYS[2], now + ttl, ARGV[3])
redis.call('HSET', KEYS[3], ARGV[3], tokens)
redis.call('PEXPIRE', KEYS[2], keys_ttl)
redis.call('PEXPIRE', KEYS[3], keys_ttl)
return {1, used, reserved + tokens}
"""

# A hold taken while Redis was away, put back unchecked (its generation runs). KEYS:
# reservation expiries, amounts. ARGV: id, tokens, ttl_ms. Keys keep a longer TTL they have.
_BUDGET_RESTORE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local ttl = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
for i = 1, 2 do
  local left = redis.call('PTTL', KEYS[i])
  if left >= 0 and left < ttl then redis.call('PEXPIRE', KEYS[i], ttl) end
end
return 1
"""

# KEYS: reservation expiries. ARGV: id, ttl_ms. Extends a live reservation only.
_BUDGET_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
return redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
"""

# The generation ended: drop its reservation and add what it used to the counter.
# KEYS: counter, reservation expiries, reservation amounts. ARGV: id, tokens used.
# Returns the new total, or nil when the counter is missing (seed it from the database).
_BUDGET_SETTLE = """
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
return redis.call('INCRBY', KEYS[1], ARGV[2])
"""


@dataclass(frozen=True)
class BucketState:
    """One limit's state after a check, enough for the `x-ratelimit-*` headers."""

    name: str
    limit: int
    remaining: int
    reset_s: float  # until the bucket is back to its full limit
    retry_after_s: float  # 0 when admitted; math.inf when the cost can never fit

    @property
    def allowed(self) -> bool:
        return self.retry_after_s == 0

    @property
    def kind(self) -> str:
        """"requests" for both a tenant's bucket and a key's own ("requests@key12")."""
        return self.name.partition("@")[0]

    @property
    def of_key(self) -> bool:
        return "@" in self.name


@dataclass(frozen=True)
class Decision:
    """The outcome of one check over one or more buckets."""

    allowed: bool
    buckets: tuple[BucketState, ...]
    local: bool = False  # decided by this process's stand-in while Redis was away (tenants.fallback)

    def bucket(self, kind: str) -> BucketState | None:
        """The tightest bucket of `kind` (a key's own limit may be below its tenant's)."""
        return min((b for b in self.buckets if b.kind == kind), key=lambda b: b.remaining, default=None)

    @property
    def refused_by(self) -> BucketState | None:
        """The bucket that refused, the one with the longest wait if several did."""
        refused = [b for b in self.buckets if not b.allowed]
        return max(refused, key=lambda b: b.retry_after_s) if refused else None

    @property
    def retry_after_s(self) -> float:
        refused = self.refused_by
        return refused.retry_after_s if refused else 0.0


@dataclass(frozen=True)
class Lease:
    """A held concurrency slot. Renew it more often than its TTL, release it when done."""

    key: str
    lease_id: str
    ttl_s: float
    count: int = 1  # slots held: one per choice of the generation


@dataclass(frozen=True)
class Reservation:
    """Tokens held against a monthly budget while one generation runs."""

    scope: str
    month: str  # the counter's name: the month the generation started in
    reservation_id: str
    tokens: int
    ttl_s: float


@dataclass(frozen=True)
class BudgetState:
    """A reservation attempt: `status` "reserved", "exhausted" (the budget is used up) or
    "held" (what is left is reserved by generations in flight), or "missing" (seed first)."""

    status: str
    used: int
    reserved: int
    reservation: Reservation | None = None


_BUDGET_STATUS = {1: "reserved", 0: "exhausted", 2: "held", -1: "missing"}


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def _seconds(ms: int) -> float:
    return math.inf if ms < 0 else ms / 1000


class Limiter:
    """Limit checks against one Redis. Keys are `<namespace>:{<scope>}:<name>`; the braces
    make one scope's keys a Redis Cluster hash tag, so a multi-key script stays legal."""

    def __init__(self, client: redis.Redis, namespace: str = "limits") -> None:
        self.client = client
        self.namespace = namespace
        self._bucket = client.register_script(_TOKEN_BUCKET)
        self._lease_acquire = client.register_script(_LEASE_ACQUIRE)
        self._lease_renew = client.register_script(_LEASE_RENEW)
        self._counter_add = client.register_script(_COUNTER_ADD)
        self._budget_reserve = client.register_script(_BUDGET_RESERVE)
        self._budget_renew = client.register_script(_BUDGET_RENEW)
        self._budget_restore = client.register_script(_BUDGET_RESTORE)
        self._budget_settle = client.register_script(_BUDGET_SETTLE)
        self._adjust = client.register_script(_TOKEN_ADJUST)

    def key(self, scope: str, name: str) -> str:
        return f"{self.namespace}:{{{scope}}}:{name}"

    def admit(self, scope: str, period_s: float, costs: Mapping[str, tuple[int, int]]) -> Decision:
        """Charge `cost` against each named bucket of `limit` per `period_s`, all or none.

        `costs` maps a bucket name to (limit, cost); a cost of 0 only reads the bucket.
        """
        names = list(costs)
        args: list[int] = [_ms(period_s)]
        for name in names:
            limit, cost = costs[name]
            if limit <= 0:
                raise ValueError(f"limit for {name!r} must be positive, got {limit}")
            args += [limit, cost]
        reply = self._bucket(keys=[self.key(scope, n) for n in names], args=args)
        buckets = tuple(
            BucketState(
                name=name,
                limit=costs[name][0],
                remaining=int(reply[1 + 3 * i]),
                retry_after_s=_seconds(int(reply[2 + 3 * i])),
                reset_s=int(reply[3 + 3 * i]) / 1000,
            )
            for i, name in enumerate(names)
        )
        return Decision(allowed=bool(reply[0]), buckets=buckets)

    def refund(self, scope: str, name: str, limit: int, period_s: float, units: int) -> None:
        """Give `units` back to a bucket that `admit` charged (a reservation left unused)."""
        if units > 0:
            self._adjust(keys=[self.key(scope, name)], args=[_ms(period_s), limit, units])

    def charge(self, scope: str, name: str, limit: int, period_s: float, units: int) -> None:
        """Add `units` to a bucket without checking it (what a process admitted alone)."""
        if units > 0:
            self._adjust(keys=[self.key(scope, name)], args=[_ms(period_s), limit, -units])

    def acquire_lease(self, scope: str, name: str, limit: int, ttl_s: float,
                      count: int = 1, lease_id: str | None = None) -> tuple[Lease | None, Decision]:
        """Take `count` of `limit` slots for `ttl_s`, all or none; the Lease is None when they
        do not fit (retry_after_s is math.inf when `count` exceeds the limit itself)."""
        if count < 1:
            raise ValueError(f"a lease takes at least one slot, not {count}")
        lease = Lease(key=self.key(scope, name), lease_id=lease_id or uuid.uuid4().hex, ttl_s=ttl_s, count=count)
        admitted, held, retry_ms = self._lease_acquire(keys=[lease.key], args=[limit, _ms(ttl_s), lease.lease_id, count])
        state = BucketState(
            name=name,
            limit=limit,
            remaining=max(0, limit - int(held)),
            reset_s=0.0,
            retry_after_s=0.0 if admitted else _seconds(int(retry_ms)),
        )
        return (lease if admitted else None), Decision(allowed=bool(admitted), buckets=(state,))

    def renew_lease(self, lease: Lease) -> bool:
        """Extend a lease by its TTL, putting back any of its slots that had expired; False
        when some had (a Redis outage outlasted the TTL)."""
        return bool(self._lease_renew(keys=[lease.key], args=[_ms(lease.ttl_s), lease.lease_id, lease.count]))

    def release_lease(self, lease: Lease) -> None:
        self.client.zrem(lease.key, *(f"{lease.lease_id}:{i}" for i in range(lease.count)))

    def leases_held(self, scope: str, name: str) -> int:
        """Live leases (expired ones are not counted)."""
        now_s, now_us = self.client.time()
        return int(self.client.zcount(self.key(scope, name), f"({now_s * 1000 + now_us / 1000}", "+inf"))

    def counter_get(self, scope: str, name: str) -> int | None:
        value = self.client.get(self.key(scope, name))
        return None if value is None else int(value)

    def counter_seed(self, scope: str, name: str, value: int, ttl_s: float) -> int:
        """Set a missing counter (another process may have just set it: keep theirs)."""
        key = self.key(scope, name)
        self.client.set(key, value, nx=True, px=_ms(ttl_s))
        return int(self.client.get(key) or value)

    def counter_add(self, scope: str, name: str, amount: int) -> int | None:
        """Add to an existing counter (never below 0); None when it is missing and needs seeding."""
        total = self._counter_add(keys=[self.key(scope, name)], args=[amount])
        return None if total is None else int(total)

    def _budget_keys(self, scope: str, month: str) -> list[str]:
        return [self.key(scope, month), self.key(scope, f"{month}:reserved_until"), self.key(scope, f"{month}:reserved")]

    def reserve_budget(self, scope: str, month: str, budget: int, tokens: int, ttl_s: float,
                       keys_ttl_s: float, reservation_id: str | None = None) -> BudgetState:
        """Hold `tokens` against `budget` while a generation runs: refused once the settled
        total reaches the budget, or while reservations in flight cover what is left."""
        reservation = Reservation(scope, month, reservation_id or uuid.uuid4().hex, tokens, ttl_s)
        status, used, reserved = self._budget_reserve(
            keys=self._budget_keys(scope, month),
            args=[budget, tokens, reservation.reservation_id, _ms(ttl_s), _ms(keys_ttl_s)])
        status = _BUDGET_STATUS[int(status)]
        return BudgetState(status, int(used), int(reserved), reservation if status == "reserved" else None)

    def restore_reservation(self, reservation: Reservation) -> None:
        """Put a hold taken while Redis was away into Redis, unchecked: its generation runs."""
        self._budget_restore(keys=self._budget_keys(reservation.scope, reservation.month)[1:],
                             args=[reservation.reservation_id, reservation.tokens, _ms(reservation.ttl_s)])

    def renew_reservation(self, reservation: Reservation) -> bool:
        keys = self._budget_keys(reservation.scope, reservation.month)
        return bool(self._budget_renew(keys=[keys[1]], args=[reservation.reservation_id, _ms(reservation.ttl_s)]))

    def settle_budget(self, reservation: Reservation, used: int) -> int | None:
        """Drop the reservation and count `used`; None when the counter is missing (seed it)."""
        total = self._budget_settle(keys=self._budget_keys(reservation.scope, reservation.month),
                                    args=[reservation.reservation_id, used])
        return None if total is None else int(total)
