"""Limits that hold while Redis stalls: each process stands in for it with what it knows.

Admission asks Redis under a short deadline (the fast client, LIMITS_REDIS_TIMEOUT_S, no
retries). A call that misses it or fails opens the breaker: from then on this process
decides alone, from memory and without waiting on Redis, until a background write probe
gets an answer. Then what it admitted meanwhile goes into Redis (the slots of generations
still running, their budget holds), releases that failed are done, and Redis decides again.
Measured in bench/isolation.py: a 1.5 s write pause made another tenant's first token wait
the whole pause (and a 2 s timeout past it) when admission failed closed.

What a process allows alone is `share` of each limit (LIMITS_FALLBACK_SHARE: 1 for one
process, 1/N for N replicas; 0 fails closed with 503 as before), counted against what this
process itself admitted: every Redis admission is mirrored here, so a stall does not hand a
tenant a fresh allowance on top of its running generations. A monthly budget: a process
that has reserved for the tenant this month knows the room left at that answer (budget -
used - everyone's holds) and spends `share` of it; for a tenant it has not reserved for this
month it starts from the month's use in the usage records (the caller's `used_so_far`; other
processes' holds unknown, which `share` bounds), and refuses with 503 only without one. A
false trip under load (a deadline missed by a busy process, not by Redis) so costs nobody
their service: on a loaded box a deadline of 0.05 s tripped 12 times in one run of the
two-replica kill test, and before this each trip refused the tenants that replica had not
served yet.

What it admitted alone is carried into Redis when it answers again: the slots of generations
still running, their budget holds, and the requests/min and tokens/min charged meanwhile, so
a false trip (a deadline missed by a busy process, not by Redis) lets no tenant spend a
limit twice. That is what lets the deadline be short: at 0.02 s (one process) a write pause
costs another tenant's first token 0.02 s, not the 0.05-0.1 s it cost before (bench/isolation.py).

Imports no Django.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import redis

from tenants.limits import BucketState, BudgetState, Decision, Lease, Limiter, Reservation

log = logging.getLogger(__name__)

PROBE_S = 0.1  # between write probes while the breaker is open
PRUNE_EVERY = 4096  # admissions between sweeps of drained buckets (every Redis admission is mirrored)
RETRY_LOCAL_S = 1.0  # a slot refused locally: it frees when one of this process's generations ends


class LimitsUnavailable(redis.RedisError):
    """Redis is away and this process cannot decide alone (fallback off, or a budget it cannot learn)."""


@dataclass
class _Room:
    """A month's budget as this process last heard it from Redis, and what it spent since."""

    allowance: int  # share of (budget - used - every hold) at that answer
    ours: dict[str, int] = field(default_factory=dict)  # this process's live holds: id -> tokens
    spent: int = 0  # since that answer: holds taken, plus used - held of holds settled


class LocalLimits:
    """Buckets, leases and budget rooms in memory, the same shapes `Limiter` keeps in Redis.

    `share` scales every limit. Thread-safe: admission runs on a pool of threads."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (level, at)
        self._leases: dict[str, dict[str, tuple[int, float]]] = {}  # key -> lease id -> (count, expiry)
        self._rooms: dict[str, _Room] = {}  # budget key -> room
        self._admits = 0

    def _limit(self, limit: int) -> int:
        return max(1, math.floor(limit * self.share + 1e-9))

    # --- rate buckets

    def _level(self, key: str, limit: int, period_s: float, now: float) -> float:
        level, at = self._buckets.get(key, (0.0, now))
        return min(limit, max(0.0, level - (now - at) * limit / period_s))

    def admit(self, keys: Mapping[str, tuple[str, int, int]], period_s: float, check: bool = True) -> Decision:
        """`keys` maps a bucket name to (key, limit, cost). With `check` False the costs are
        only recorded (Redis admitted them)."""
        now = self._clock()
        with self._lock:
            levels = {name: self._level(key, limit, period_s, now) for name, (key, limit, _) in keys.items()}
            retries = {}
            for name, (_, limit, cost) in keys.items():
                local, over = self._limit(limit), levels[name] + cost - self._limit(limit)
                # Over the local share but within the limit: it fits once Redis is back.
                retries[name] = 0.0 if over <= 1e-9 or not check else (
                    period_s if cost > local else over * period_s / local)
            allowed = not any(retries.values())
            self._admits += 1
            if self._admits % PRUNE_EVERY == 0:  # a bucket untouched for a period has drained
                self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < period_s}
            states = []
            for name, (key, limit, cost) in keys.items():
                if allowed and cost > 0:
                    levels[name] = min(limit, levels[name] + cost)
                    self._buckets[key] = (levels[name], now)
                local = self._limit(limit)
                states.append(BucketState(name, limit, max(0, math.floor(local - levels[name] + 1e-9)),
                                          levels[name] * period_s / limit, retries[name]))
            return Decision(allowed, tuple(states), local=True)

    def refund(self, key: str, limit: int, period_s: float, units: int) -> None:
        now = self._clock()
        with self._lock:
            if key in self._buckets:
                self._buckets[key] = (max(0.0, self._level(key, limit, period_s, now) - units), now)

    # --- concurrent leases

    def _held(self, key: str, now: float) -> int:
        leases = self._leases.get(key, {})
        for lease_id in [i for i, (_, expiry) in leases.items() if expiry <= now]:
            del leases[lease_id]
        return sum(count for count, _ in leases.values())

    def acquire(self, lease: Lease, limit: int, check: bool = True) -> Decision:
        now = self._clock()
        with self._lock:
            held, local = self._held(lease.key, now), self._limit(limit)
            allowed = not check or held + lease.count <= local
            if allowed:
                self._leases.setdefault(lease.key, {})[lease.lease_id] = (lease.count, now + lease.ttl_s)
                held += lease.count
            retry = 0.0 if allowed else (math.inf if lease.count > limit else RETRY_LOCAL_S)
            name = lease.key.rsplit(":", 1)[-1]
            return Decision(allowed, (BucketState(name, limit, max(0, local - held), 0.0, retry),), local=True)

    def renew(self, lease: Lease) -> None:
        with self._lock:
            self._leases.setdefault(lease.key, {})[lease.lease_id] = (lease.count, self._clock() + lease.ttl_s)

    def release(self, lease: Lease) -> None:
        with self._lock:
            leases = self._leases.get(lease.key)
            if leases is not None:
                leases.pop(lease.lease_id, None)
                if not leases:
                    del self._leases[lease.key]

    def held(self, key: str) -> int:
        with self._lock:
            return self._held(key, self._clock())

    def live_leases(self) -> list[Lease]:
        now = self._clock()
        with self._lock:
            return [Lease(key, lease_id, max(0.001, expiry - now), count)
                    for key, leases in self._leases.items() for lease_id, (count, expiry) in leases.items()
                    if expiry > now]

    # --- monthly budgets

    def heard(self, key: str, budget: int, state: BudgetState, tokens: int, reservation_id: str) -> None:
        """Redis answered a reservation: remember the room it left (and the hold, if taken)."""
        with self._lock:
            room = self._rooms.get(key) or _Room(0)
            if state.status == "reserved":
                room.ours[reservation_id] = tokens
            others = max(0, state.reserved - sum(room.ours.values()))
            room.allowance = math.floor(max(0, budget - state.used - others) * self.share)
            room.spent = sum(room.ours.values())
            self._rooms[key] = room

    def learn(self, key: str, budget: int, used: int) -> None:
        """A month this process never heard Redis on: start from `used` (the usage records).
        Other processes' holds are not known here; `share` of the room is what bounds them."""
        with self._lock:
            self._rooms.setdefault(key, _Room(math.floor(max(0, budget - used) * self.share)))

    def reserve(self, key: str, reservation: Reservation) -> tuple[bool, int, int, int] | None:
        """Hold locally: (taken, what this process may spend, what it has spent, what of that
        is still held), or None when it has not heard of the month's budget. Taken while
        anything is left, as Redis does: the budget is overrun by at most the last request's use."""
        with self._lock:
            room = self._rooms.get(key)
            if room is None:
                return None
            taken = room.spent < room.allowance
            if taken:
                room.ours[reservation.reservation_id] = reservation.tokens
                room.spent += reservation.tokens
            return taken, room.allowance, room.spent, sum(room.ours.values())

    def settle(self, key: str, reservation_id: str, used: int) -> None:
        """A hold ended having used `used` (once: a settle retried later changes nothing)."""
        with self._lock:
            room = self._rooms.get(key)
            if room is not None and reservation_id in room.ours:
                room.spent += used - room.ours.pop(reservation_id)


class Breaker:
    """Closed: ask Redis. Open: decide locally while a thread probes Redis with a write; on
    an answer it runs `recover` (which may fail: then it keeps probing), closes, and runs
    `flush` (what is best done once callers ask Redis again)."""

    def __init__(self, probe: Callable[[], None], recover: Callable[[], None], flush: Callable[[], None],
                 confirm: Callable[[], None] | None = None) -> None:
        self._probe, self._recover, self._flush = probe, recover, flush
        self._confirm = confirm  # the first probe after a trip, under a longer deadline
        self._lock = threading.Lock()
        self.open = False
        self.verdict = threading.Event()  # set once the first probe after the trip answered or failed
        self.verdict.set()
        self.confirmed = True  # the outage that opened it is no false trip (a busy box): the first probe failed too
        self.trips = 0

    def trip(self, exc: Exception) -> None:
        with self._lock:
            if self.open:
                return
            self.open = True
            self.confirmed = self._confirm is None
            if not self.confirmed:
                self.verdict.clear()
            self.trips += 1
        log.warning("limits store unanswered (%s: %s): limits are decided by this process until it answers",
                    type(exc).__name__, exc)
        threading.Thread(target=self._probing, name="limits-probe", daemon=True).start()

    def _probing(self) -> None:
        started = time.monotonic()
        first = self._confirm is not None
        while True:
            if not first:
                time.sleep(PROBE_S)
            try:
                (self._confirm if first else self._probe)()
                self._recover()
            except (redis.ConnectionError, redis.TimeoutError):
                self.confirmed, first = True, False
                self.verdict.set()
                continue
            except Exception:  # a bug in recovery must not leave the breaker open for good
                log.exception("limits store recovery failed; closing the breaker anyway")
            with self._lock:
                self.open = False
            self.verdict.set()
            log.warning("limits store answers again after %.1f s: limits are shared again", time.monotonic() - started)
            try:
                self._flush()
            except redis.RedisError as exc:  # what is left expires by its TTL
                log.warning("limits store: could not release slots after it came back: %s", exc)
            return

    def answered_after_all(self, timeout: float) -> bool:
        """Whether Redis answered the first probe after the trip, waiting for it at most
        `timeout`: a missed deadline that was the box's, not Redis's. At once when no longer
        in doubt."""
        self.verdict.wait(timeout)
        return not self.open


class FallbackLimiter:
    """The `Limiter` calls quota makes, with this process standing in while Redis is away.

    `fast` (short deadline, no retries) serves admission and settlements (billing retries
    those in the background); `steady` (the shared client) the monthly counters, which are
    read and seeded off the request's path or rebuilt from the database."""

    def __init__(self, fast: Limiter, steady: Limiter, share: float, confirm: Limiter | None = None,
                 confirm_s: float = 0.0) -> None:
        self.fast, self.steady, self.confirm = fast, steady, confirm
        self.confirm_s = confirm_s
        self.local = LocalLimits(share)
        # Below a whole share a refusal decided alone is confirmed first: the first probe after a
        # trip (under `confirm`'s longer deadline, `confirm_s`) tells a busy box from a Redis away.
        self.breaker = Breaker(self._probe, self._recover, self._flush,
                               confirm=self._confirm_probe if confirm is not None and share < 1 else None)
        self._restore: dict[str, Reservation] = {}  # holds taken locally, to put into Redis
        self._unreleased: dict[str, Lease] = {}  # releases Redis missed
        self._charges: dict[tuple[str, str], tuple[int, float, int]] = {}  # (scope, name) -> (limit, period_s, units) admitted alone
        self._pending_lock = threading.Lock()
        self._probe_key = fast.key(f"probe:{uuid.uuid4().hex}", "write")

    def key(self, scope: str, name: str) -> str:
        return self.fast.key(scope, name)

    def forget(self) -> None:
        """Drop what this process counted alone (the breaker keeps its state)."""
        self.local = LocalLimits(self.local.share)
        with self._pending_lock:
            self._restore.clear()
            self._unreleased.clear()
            self._charges.clear()

    def _ask(self, call: Callable[[], object]) -> object:
        """`call` on Redis, or raise LimitsUnavailable when this process must decide alone."""
        if self.breaker.open:
            raise LimitsUnavailable("the limits store is not answering")
        try:
            return call()
        except redis.RedisError as exc:
            self.breaker.trip(exc)
            raise LimitsUnavailable(str(exc)) from exc

    def _standing_in(self, exc: LimitsUnavailable) -> None:
        if self.local.share <= 0:
            raise exc

    def _ask_again(self, again: bool) -> bool:
        """After a refusal decided alone: whether to ask Redis again, which answered after all
        (the probe takes `confirm_s` at most, and recovering after it a few fast calls)."""
        return not again and self.breaker.answered_after_all(2 * self.confirm_s + 0.1)

    # --- rate buckets

    def admit(self, scope: str, period_s: float, costs: Mapping[str, tuple[int, int]], again: bool = False) -> Decision:
        keys = {name: (self.key(scope, name), limit, cost) for name, (limit, cost) in costs.items()}
        try:
            decision = self._ask(lambda: self.fast.admit(scope, period_s, costs))
        except LimitsUnavailable as exc:
            self._standing_in(exc)
            decision = self.local.admit(keys, period_s)
            if not decision.allowed and self._ask_again(again):
                # The call that missed its deadline may have been charged in Redis too: then
                # this one is charged twice (over, never under).
                return self.admit(scope, period_s, costs, again=True)
            if decision.allowed:
                with self._pending_lock:
                    for name, (limit, cost) in costs.items():
                        if cost > 0:
                            units = self._charges.get((scope, name), (0, 0.0, 0))[2]
                            self._charges[(scope, name)] = (limit, period_s, units + cost)
            return decision
        if decision.allowed:
            self.local.admit(keys, period_s, check=False)
        return decision

    def refund(self, scope: str, name: str, limit: int, period_s: float, units: int, local: bool = False) -> None:
        """`local`: the units were admitted alone, so they come off what is still to be carried
        into Redis, and off Redis only where they were carried already."""
        left = self._uncharge(scope, name, units) if local else units
        if left:  # first: a refund Redis missed is retried whole, the local one included
            self._ask(lambda: self.fast.refund(scope, name, limit, period_s, left))
        self.local.refund(self.key(scope, name), limit, period_s, units)

    def _uncharge(self, scope: str, name: str, units: int) -> int:
        """Take up to `units` off the charge not yet carried into Redis; returns the rest."""
        with self._pending_lock:
            limit, period_s, pending = self._charges.pop((scope, name), (0, 0.0, 0))
            if pending > units:
                self._charges[(scope, name)] = (limit, period_s, pending - units)
            return max(0, units - pending)

    # --- concurrent leases

    def acquire_lease(self, scope: str, name: str, limit: int, ttl_s: float,
                      count: int = 1, lease_id: str | None = None) -> tuple[Lease | None, Decision]:
        lease = Lease(self.key(scope, name), lease_id or uuid.uuid4().hex, ttl_s, count)
        try:
            taken, decision = self._ask(
                lambda: self.fast.acquire_lease(scope, name, limit, ttl_s, count, lease_id=lease.lease_id))
        except LimitsUnavailable as exc:
            self._standing_in(exc)
            # Redis may still run the call that missed its deadline: the same id makes the
            # release (or the recovery, or asking again) take those members back too.
            decision = self.local.acquire(lease, limit)
            if not decision.allowed and self._ask_again(lease_id is not None):
                return self.acquire_lease(scope, name, limit, ttl_s, count, lease_id=lease.lease_id)
            return (lease if decision.allowed else None), decision
        if taken is not None:
            self.local.acquire(taken, limit, check=False)
        return taken, decision

    def renew_lease(self, lease: Lease) -> bool:
        self.local.renew(lease)
        try:
            return bool(self._ask(lambda: self.fast.renew_lease(lease)))
        except LimitsUnavailable:
            return True  # held here; the recovery puts it back into Redis

    def release_lease(self, lease: Lease) -> None:
        self.local.release(lease)
        try:
            self._ask(lambda: self.fast.release_lease(lease))
        except LimitsUnavailable:
            with self._pending_lock:
                self._unreleased[lease.lease_id] = lease

    def leases_held(self, scope: str, name: str) -> int:
        try:
            return int(self._ask(lambda: self.fast.leases_held(scope, name)))
        except LimitsUnavailable as exc:
            self._standing_in(exc)
            return self.local.held(self.key(scope, name))

    # --- monthly budgets

    def reserve_budget(self, scope: str, month: str, budget: int, tokens: int, ttl_s: float,
                       keys_ttl_s: float, used_so_far: Callable[[], int] | None = None,
                       again: bool = False) -> BudgetState:
        """As `Limiter.reserve_budget`; alone, from the room last heard, else from `used_so_far()`."""
        state = self._reserve_budget(scope, month, budget, tokens, ttl_s, keys_ttl_s, used_so_far)
        if state is None or (state.status in ("exhausted", "held") and self.breaker.open):
            if self._ask_again(again):
                return self.reserve_budget(scope, month, budget, tokens, ttl_s, keys_ttl_s, used_so_far, again=True)
            if state is None:
                raise LimitsUnavailable(f"no budget state for {scope} this month while the limits store is away")
        return state

    def _reserve_budget(self, scope: str, month: str, budget: int, tokens: int, ttl_s: float,
                        keys_ttl_s: float, used_so_far: Callable[[], int] | None) -> BudgetState | None:
        reservation = Reservation(scope, month, uuid.uuid4().hex, tokens, ttl_s)
        key = self.key(scope, month)
        try:
            state = self._ask(lambda: self.fast.reserve_budget(scope, month, budget, tokens, ttl_s, keys_ttl_s,
                                                                reservation_id=reservation.reservation_id))
        except LimitsUnavailable as exc:
            self._standing_in(exc)
            answer = self.local.reserve(key, reservation)
            if answer is None and used_so_far is not None:
                self.local.learn(key, budget, used_so_far())
                answer = self.local.reserve(key, reservation)
            if answer is None:
                return None
            taken, allowance, spent, holding = answer
            if not taken and not holding:  # spent by generations that ended
                return BudgetState("exhausted", budget, 0)
            if not taken:  # reads as: `allowance` left, `spent` of it held
                return BudgetState("held", max(0, budget - allowance), spent)
            with self._pending_lock:
                self._restore[reservation.reservation_id] = reservation
            return BudgetState("reserved", 0, tokens, reservation)
        if state.status != "missing":
            self.local.heard(key, budget, state, tokens, reservation.reservation_id)
        return state

    def renew_reservation(self, reservation: Reservation) -> bool:
        try:
            return bool(self._ask(lambda: self.fast.renew_reservation(reservation)))
        except LimitsUnavailable:
            return True

    def settle_budget(self, reservation: Reservation, used: int) -> int | None:
        self.local.settle(self.key(reservation.scope, reservation.month), reservation.reservation_id, used)
        with self._pending_lock:
            self._restore.pop(reservation.reservation_id, None)
        return self._ask(lambda: self.fast.settle_budget(reservation, used))

    # --- counters: off the admission path, straight to Redis

    def counter_get(self, scope: str, name: str) -> int | None:
        return self.steady.counter_get(scope, name)

    def counter_seed(self, scope: str, name: str, value: int, ttl_s: float) -> int:
        return self.steady.counter_seed(scope, name, value, ttl_s)

    def counter_add(self, scope: str, name: str, amount: int) -> int | None:
        return self.steady.counter_add(scope, name, amount)

    # --- the breaker's side

    def _probe(self) -> None:
        self.fast.client.set(self._probe_key, 1, px=5000)

    def _confirm_probe(self) -> None:
        self.confirm.client.set(self._probe_key, 1, px=5000)

    def _recover(self) -> None:
        """Put this process's running generations back into Redis before it decides again."""
        for lease in self.local.live_leases():
            self.fast.renew_lease(lease)
        with self._pending_lock:
            restore = list(self._restore.values())
        for reservation in restore:
            self.fast.restore_reservation(reservation)
            with self._pending_lock:
                settled = self._restore.pop(reservation.reservation_id, None) is None
            if settled:  # it ended while being restored: take the hold back out
                self.fast.settle_budget(reservation, 0)
        with self._pending_lock:
            charges = list(self._charges.items())
        for (scope, name), (limit, period_s, units) in charges:
            self.fast.charge(scope, name, limit, period_s, units)
            with self._pending_lock:  # what was charged alone since the copy stays for the next probe
                limit_now, _, units_now = self._charges.pop((scope, name))
                if units_now > units:
                    self._charges[(scope, name)] = (limit_now, period_s, units_now - units)

    def _flush(self) -> None:
        """Releases Redis missed while it was away (after closing: later ones go to Redis)."""
        with self._pending_lock:
            unreleased, self._unreleased = list(self._unreleased.values()), {}
        for lease in unreleased:
            self.fast.release_lease(lease)
