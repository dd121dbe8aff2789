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

# Concurrent leases: a sorted set of lease id -> expiry. Expired leases are dropped before
# counting, so a lease whose holder died without releasing frees itself after its TTL.
# KEYS: the set. ARGV: limit, ttl_ms, lease id.
# Returns: admitted, leases held, retry_after_ms (-1 when the limit is 0).
_LEASE_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local limit, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held >= limit then
  if held == 0 then return {0, 0, -1} end
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, held, math.ceil(tonumber(first[2]) - now)}
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[3])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(last[2]) - now) + 1)
return {1, held + 1, 0}
"""

# Renewal succeeds only for a lease that has not expired: an expired lease's slot may
# already belong to someone else. KEYS: the set. ARGV: ttl_ms, lease id. Returns 1 or 0.
_LEASE_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local ttl = tonumber(ARGV[1])
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[2])
if not expiry or tonumber(expiry) <= now then
  redis.call('ZREM', KEYS[1], ARGV[2])
  return 0
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[2])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(last[2]) - now) + 1)
return 1
"""

# Give units back to a bucket (a reservation that was not used up). KEYS: the bucket.
# ARGV: period_ms, limit, units. The level drains first, then loses the units, never below 0.
_TOKEN_REFUND = """
local stored = redis.call('GET', KEYS[1])
if not stored then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local period, limit, units = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local rate = limit / period
local sep = string.find(stored, ' ')
local old, at = tonumber(string.sub(stored, 1, sep - 1)), tonumber(string.sub(stored, sep + 1))
local level = math.max(0, math.min(limit, old - (now - at) * rate) - units)
if level <= 0 then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], string.format('%.17g %.17g', level, now), 'PX', math.ceil(level / rate) + 1)
end
return 1
"""

# A monthly counter only grows while it exists; a missing one must be seeded from the
# database first (Redis may have lost it). KEYS: the counter. ARGV: amount.
# Returns the new total, or nil when the counter is missing.
_COUNTER_ADD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
return redis.call('INCRBY', KEYS[1], ARGV[1])
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


@dataclass(frozen=True)
class Decision:
    """The outcome of one check over one or more buckets."""

    allowed: bool
    buckets: tuple[BucketState, ...]

    def bucket(self, name: str) -> BucketState | None:
        return next((b for b in self.buckets if b.name == name), None)

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
        self._refund = client.register_script(_TOKEN_REFUND)

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
            self._refund(keys=[self.key(scope, name)], args=[_ms(period_s), limit, units])

    def acquire_lease(self, scope: str, name: str, limit: int, ttl_s: float) -> tuple[Lease | None, Decision]:
        """Take one of `limit` slots for `ttl_s`; the Lease is None when all are held."""
        lease = Lease(key=self.key(scope, name), lease_id=uuid.uuid4().hex, ttl_s=ttl_s)
        admitted, held, retry_ms = self._lease_acquire(keys=[lease.key], args=[limit, _ms(ttl_s), lease.lease_id])
        state = BucketState(
            name=name,
            limit=limit,
            remaining=max(0, limit - int(held)),
            reset_s=0.0,
            retry_after_s=0.0 if admitted else _seconds(int(retry_ms)),
        )
        return (lease if admitted else None), Decision(allowed=bool(admitted), buckets=(state,))

    def renew_lease(self, lease: Lease) -> bool:
        """Extend a lease by its TTL; False when it had already expired (and is gone)."""
        return bool(self._lease_renew(keys=[lease.key], args=[_ms(lease.ttl_s), lease.lease_id]))

    def release_lease(self, lease: Lease) -> None:
        self.client.zrem(lease.key, lease.lease_id)

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
        """Add to an existing counter; None when it is missing and needs seeding."""
        total = self._counter_add(keys=[self.key(scope, name)], args=[amount])
        return None if total is None else int(total)
