"""Every write to tenants, tiers, keys and usage goes through here.

Views, admin pages and management commands parse their input and call one of these;
keeping writes in one place keeps their invariants (no plaintext key stored, usage
charged to the budget) in one place too.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import IntegrityError, OperationalError, connection, transaction
from django.utils import timezone

from tenants import keys, quota
from tenants.models import ApiKey, AuditEntry, Lane, PromptCapture, QuotaTier, Scope, Tenant, UsageRecord

if TYPE_CHECKING:
    from tenants.ledger import UsageEntry

log = logging.getLogger(__name__)

# last_used is advisory: writing it on every request would turn each read into a write.
LAST_USED_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True)
class IssuedKey:
    """A new key and its plaintext, which exists only here: show it once, then drop it."""

    api_key: ApiKey
    plaintext: str


def _tier_state(tier: QuotaTier) -> dict:
    return {"name": tier.name, "lane": tier.lane, "requests_per_minute": tier.requests_per_minute,
            "tokens_per_minute": tier.tokens_per_minute, "concurrent_streams": tier.concurrent_streams,
            "max_tokens_per_request": tier.max_tokens_per_request, "monthly_token_budget": tier.monthly_token_budget,
            "allow_batch": tier.allow_batch, "share_prefix_cache": tier.share_prefix_cache}


def _tenant_state(tenant: Tenant) -> dict:
    return {"name": tenant.name, "tier": tenant.tier.name, "is_active": tenant.is_active}


def _key_state(api_key: ApiKey) -> dict:
    def when(value: datetime | None) -> str | None:
        return value.isoformat() if value is not None else None
    return {"tenant": api_key.tenant_id, "name": api_key.name, "prefix": api_key.prefix, "scopes": list(api_key.scopes),
            "requests_per_minute": api_key.requests_per_minute, "tokens_per_minute": api_key.tokens_per_minute,
            "monthly_token_budget": api_key.monthly_token_budget, "expires": when(api_key.expires),
            "revoked": when(api_key.revoked)}


def _audit(actor: str | None, action: str, target: str, before: dict | None, after: dict | None) -> None:
    """Record a staff write (in the caller's transaction); `actor` None: not a staff write (tests, seeding)."""
    if actor is not None and before != after:
        AuditEntry.objects.create(actor=actor[:150], action=action, target=target[:200], before=before, after=after)


def save_tier(
    name: str,
    *,
    lane: int,
    requests_per_minute: int,
    tokens_per_minute: int,
    concurrent_streams: int,
    max_tokens_per_request: int,
    monthly_token_budget: int,
    allow_batch: bool = False,
    share_prefix_cache: bool = False,
    actor: str | None = None,
) -> tuple[QuotaTier, bool]:
    """Create the tier or update it in place; returns (tier, created)."""
    with transaction.atomic():
        existing = QuotaTier.objects.select_for_update().filter(name=name).first()
        before = _tier_state(existing) if existing is not None else None
        tier, created = QuotaTier.objects.update_or_create(
            name=name,
            defaults={
                "lane": Lane(lane),
                "requests_per_minute": requests_per_minute,
                "tokens_per_minute": tokens_per_minute,
                "concurrent_streams": concurrent_streams,
                "max_tokens_per_request": max_tokens_per_request,
                "monthly_token_budget": monthly_token_budget,
                "allow_batch": allow_batch,
                "share_prefix_cache": share_prefix_cache,
            },
        )
        _audit(actor, "tier.create" if created else "tier.update", f"tier:{tier.name}", before, _tier_state(tier))
    return tier, created


def create_tenant(name: str, tier: QuotaTier, actor: str | None = None) -> Tenant:
    with transaction.atomic():
        tenant = Tenant.objects.create(name=name, tier=tier)
        _audit(actor, "tenant.create", f"tenant:{tenant.pk}", None, _tenant_state(tenant))
    return tenant


def change_tier(tenant: Tenant, tier: QuotaTier, actor: str | None = None) -> Tenant:
    """Move a tenant to another tier. Limits are read per request, so this applies at once."""
    return update_tenant(tenant, name=tenant.name, tier=tier, is_active=tenant.is_active, actor=actor)


def set_active(tenant: Tenant, is_active: bool, actor: str | None = None) -> Tenant:
    """Deactivate (its keys are refused, its open sockets closed at their next re-check) or reactivate."""
    return update_tenant(tenant, name=tenant.name, tier=tenant.tier, is_active=is_active, actor=actor)


def set_debug_capture(tenant: Tenant, on: bool, actor: str | None = None) -> Tenant:
    """Start or stop storing the tenant's prompts (off by default). Stopping deletes what was
    captured, in the same transaction: a capture lives only as long as the operator wants it."""
    with transaction.atomic():
        before = Tenant.objects.select_for_update().filter(pk=tenant.pk).values_list("debug_capture", flat=True).first()
        tenant.debug_capture = on
        tenant.save(update_fields=["debug_capture"])
        deleted = 0 if on else PromptCapture.objects.filter(tenant=tenant).delete()[0]
        _audit(actor, f"tenant.debug_capture_{'on' if on else 'off'}", f"tenant:{tenant.pk}",
               {"debug_capture": before}, {"debug_capture": on, **({"captures_deleted": deleted} if not on else {})})
    return tenant


CAPTURE_MAX_CHARS = 20_000  # a prompt's JSON beyond this is cut: enough to debug, bounded per row


def capture_prompt(tenant_id: int, request_id: str, prompt_json: str) -> None:
    """Store a request's prompt while its tenant's capture is on (checked again here, in the
    database, so a request admitted just after capture was turned off stores nothing), and
    delete the tenant's captures past its newest DEBUG_CAPTURES_KEPT."""
    if not Tenant.objects.filter(pk=tenant_id, debug_capture=True).exists():
        return
    PromptCapture.objects.create(tenant_id=tenant_id, request_id=request_id[:64], prompt=prompt_json[:CAPTURE_MAX_CHARS])
    kept = max(1, settings.DEBUG_CAPTURES_KEPT)
    oldest_kept = list(PromptCapture.objects.filter(tenant_id=tenant_id).order_by("-pk")
                       .values_list("pk", flat=True)[kept - 1 : kept])
    if oldest_kept:
        PromptCapture.objects.filter(tenant_id=tenant_id, pk__lt=oldest_kept[0]).delete()


def update_tenant(tenant: Tenant, *, name: str, tier: QuotaTier, is_active: bool, actor: str | None = None) -> Tenant:
    """Save all of a tenant's editable fields (the admin hands over an instance its form
    already changed, so comparing against it would miss the change: the row is read again)."""
    with transaction.atomic():
        stored = Tenant.objects.select_related("tier").select_for_update().filter(pk=tenant.pk).first()
        before = _tenant_state(stored) if stored is not None else None
        tenant.name, tenant.tier, tenant.is_active = name, tier, is_active
        tenant.save(update_fields=["name", "tier", "is_active"])
        after = _tenant_state(tenant)
        action = "tenant.change_tier" if before and before["tier"] != after["tier"] else (
            "tenant.deactivate" if before and before["is_active"] and not is_active else
            "tenant.reactivate" if before and not before["is_active"] and is_active else "tenant.update")
        _audit(actor, action, f"tenant:{tenant.pk}", before, after)
    return tenant


def check_scopes(scopes: list[str]) -> list[str]:
    """The scopes, validated and deduplicated in a stable order; ValueError names a wrong one."""
    known = [choice.value for choice in Scope]
    for scope in scopes:
        if scope not in known:
            raise ValueError(f"unknown scope {scope!r}: use {', '.join(known)}")
    return [scope for scope in known if scope in scopes]


def issue_key(tenant: Tenant, name: str = "", expires: datetime | None = None, *, scopes: list[str] | None = None,
              requests_per_minute: int | None = None, tokens_per_minute: int | None = None,
              monthly_token_budget: int | None = None, actor: str | None = None) -> IssuedKey:
    """Create a key; only its prefix and digest are stored. Its own limits (None: the
    tenant's) apply beside the tenant's, so a key never exceeds its tenant."""
    scopes = check_scopes(scopes or [])
    for _ in range(5):
        new = keys.generate()
        try:
            with transaction.atomic():
                api_key = ApiKey.objects.create(
                    tenant=tenant, name=name, prefix=new.prefix, digest=keys.digest(new.plaintext), expires=expires,
                    scopes=scopes, requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute,
                    monthly_token_budget=monthly_token_budget,
                )
                _audit(actor, "key.issue", f"key:{api_key.prefix}", None, _key_state(api_key))
        except IntegrityError:
            continue  # prefix collision (48 random bits): draw again
        return IssuedKey(api_key=api_key, plaintext=new.plaintext)
    raise RuntimeError("could not draw a unique key prefix")


def revoke_key(api_key: ApiKey, now: datetime | None = None, actor: str | None = None) -> ApiKey:
    """Refuse the key from now on. Revoking twice keeps the first time."""
    if api_key.revoked is None:
        with transaction.atomic():
            before = _key_state(api_key)
            api_key.revoked = now or timezone.now()
            api_key.save(update_fields=["revoked"])
            _audit(actor, "key.revoke", f"key:{api_key.prefix}", before, _key_state(api_key))
    return api_key


def rotate_key(api_key: ApiKey, grace: timedelta, actor: str | None = None, now: datetime | None = None) -> IssuedKey:
    """A new key with the old one's name, scopes and limits; the old one keeps working for
    `grace` (or until its own expiry, if sooner), then is refused as expired. Rotating a key
    already rotated refuses: rotate the key that replaced it."""
    now = now or timezone.now()
    if api_key.revoked is not None or not api_key.is_usable(now):
        raise ValueError("only a live key can be rotated")
    if api_key.replaced_by_id is not None:
        raise ValueError("this key was already rotated: rotate the key that replaced it")
    with transaction.atomic():
        issued = issue_key(api_key.tenant, api_key.name, api_key.expires, scopes=list(api_key.scopes),
                           requests_per_minute=api_key.requests_per_minute, tokens_per_minute=api_key.tokens_per_minute,
                           monthly_token_budget=api_key.monthly_token_budget)
        before = _key_state(api_key)
        ends = now + grace
        api_key.expires = ends if api_key.expires is None else min(api_key.expires, ends)
        api_key.replaced_by = issued.api_key
        api_key.save(update_fields=["expires", "replaced_by"])
        _audit(actor, "key.rotate", f"key:{api_key.prefix}", before,
               {**_key_state(api_key), "replaced_by": issued.api_key.prefix})
    return issued


def key_use_is_news(api_key: ApiKey, now: datetime) -> bool:
    """Whether `last_used` is due a write (it is kept to LAST_USED_RESOLUTION)."""
    return api_key.last_used is None or now - api_key.last_used >= LAST_USED_RESOLUTION


def mark_key_used(api_key: ApiKey, now: datetime) -> None:
    """Record that the key was used, at most once per LAST_USED_RESOLUTION: here and now on
    the synchronous views, unless the row or the file is locked; then, as on the streaming
    paths, `tenants.ledger`'s writer records it once the lock is gone."""
    if not key_use_is_news(api_key, now):
        return
    if touch_key(api_key.pk, now):
        api_key.last_used = now
        return
    from tenants.ledger import ledger

    ledger().touch_key(api_key.pk, now)


def touch_key(api_key_id: int, now: datetime) -> bool:
    """Write `last_used`, unless another transaction holds the key's row locked, or on SQLite
    the file's one write lock (False: try again later). Waiting on the lock would hold up
    whoever waits for this write: a request on a synchronous view waited out SQLite's busy
    timeout (20 s) behind a batch worker's write and then answered 503."""
    if connection.vendor == "sqlite" and not connection.in_atomic_block:
        with _sqlite_busy_timeout(0):
            try:
                return _touch(api_key_id, now)
            except OperationalError as exc:
                if "locked" not in str(exc):  # "database is locked": another connection writes
                    raise
                return False
    return _touch(api_key_id, now)


@contextmanager
def _sqlite_busy_timeout(ms: int):
    """SQLite's wait for a lock on this connection, `ms` meanwhile."""
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA busy_timeout")
        before = int(cursor.fetchone()[0])
        cursor.execute(f"PRAGMA busy_timeout = {int(ms)}")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"PRAGMA busy_timeout = {before}")


def _touch(api_key_id: int, now: datetime) -> bool:
    with transaction.atomic():
        rows = ApiKey.objects.filter(pk=api_key_id)
        if connection.features.has_select_for_update_skip_locked:
            free = list(rows.select_for_update(skip_locked=True).values_list("pk", flat=True))
            if not free and rows.exists():
                return False
        rows.update(last_used=now)
    return True


def record_usage(
    tenant: Tenant,
    *,
    lane: int,
    prompt_tokens: int,
    completion_tokens: int,
    api_key: ApiKey | None = None,
    request_id: str = "",
    model: str = "",
    ttft_ms: int | None = None,
    latency_ms: int | None = None,
    finish_reason: str = "",
    endpoint: str = "",
    cached_tokens: int = 0,
) -> UsageRecord:
    """Store one request's usage (aborted ones too) and charge it to the monthly budget.

    The budget is charged right away rather than on commit: if the surrounding transaction
    rolls back, the tenant is over-counted until the month ends, never under-counted.
    """
    record = UsageRecord.objects.create(
        tenant=tenant,
        api_key=api_key,
        request_id=request_id,
        model=model,
        lane=Lane(lane),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        endpoint=endpoint,
        ttft_ms=ttft_ms,
        latency_ms=latency_ms,
        finish_reason=finish_reason,
    )
    quota.charge_monthly_tokens(tenant, record.total_tokens, record.created, api_key)
    return record


# The finish reason of a usage row completed by the sweep (inference.sweep), not by its replica.
LOST_REPLICA = "replica_lost"


def apply_usage(entry: UsageEntry) -> None:
    """Write one ledger entry to its usage row; idempotent, so the ledger may retry it.

    `open` creates the row (prompt tokens, not closed); `close` completes it; `void` removes
    it (nothing ran). A batch item's later attempt replaces an earlier attempt's row and
    gives that attempt's tokens back to the monthly counter: the item is billed once.
    Entries of an attempt older than the row's are stale and change nothing. A row the sweep
    completed (its replica had left the fleet: `LOST_REPLICA`) takes the attempt's own close
    if that arrives after all, and gives back what the sweep had counted.
    """
    apply_usage_batch([entry])


def apply_usage_batch(entries: Sequence[UsageEntry]) -> None:
    """Entries in order, in one transaction: the rows `apply_usage` of each in turn leaves,
    written with one query per kind of change instead of a transaction per entry. On local
    PostgreSQL one entry at a time took ~1.6 ms (600 entries a second, 300 requests: a
    replica's ledger fell behind past that); bench/ledger.py measures the batch against it.
    All or nothing: where the database refuses one entry it refuses the batch, and the ledger
    then applies them one by one, so the others land."""
    keys = list(dict.fromkeys(entry.key for entry in entries))
    replaced: list[tuple[str, int, int | None, int, datetime]] = []
    with transaction.atomic():
        stored = {row.key: row for row in UsageRecord.objects.select_for_update().filter(key__in=keys)}
        rows: dict[str, UsageRecord | None] = dict(stored)
        changed: set[str] = set()
        for entry in entries:
            row, change, gave_back = _next_row(rows.get(entry.key), entry)
            rows[entry.key] = row
            if change:
                changed.add(entry.key)
            if gave_back is not None:
                replaced.append(gave_back)
        created, updated, deleted = [], [], []
        for key in keys:
            before, after = stored.get(key), rows.get(key)
            if key not in changed:
                continue
            if after is None:
                if before is not None:
                    deleted.append(before.pk)
            elif before is None:
                created.append(after)
            else:
                updated.append(after)
        if deleted:
            UsageRecord.objects.filter(pk__in=deleted).delete()
        if created:  # a key another process wrote meanwhile fails the batch: the ledger retries its entries one by one
            UsageRecord.objects.bulk_create(created)
        if updated:
            # Rows this transaction holds (select_for_update), rewritten whole by key: one INSERT ...
            # ON CONFLICT (key) DO UPDATE, where bulk_update's CASE per field and row took 1 s for 200.
            for row in updated:
                row.pk = None
            UsageRecord.objects.bulk_create(updated, update_conflicts=True, unique_fields=["key"],
                                            update_fields=USAGE_FIELDS)
    for key, tenant_id, api_key_id, tokens, created_at in replaced:
        try:
            api_key = ApiKey.objects.filter(pk=api_key_id).first() if api_key_id is not None else None
            quota.charge_monthly_tokens(Tenant.objects.get(pk=tenant_id), -tokens, created_at, api_key)
        except Exception as exc:  # over-counts the budget until the month ends, never the bill
            log.warning("usage %s: could not give back a replaced attempt's %d tokens: %s", key, tokens, exc)


# What an entry writes to its row (`key` aside, which never changes).
USAGE_FIELDS = ["tenant", "api_key", "request_id", "model", "lane", "attempt", "prompt_tokens",
                "completion_tokens", "cached_tokens", "endpoint", "batch", "ttft_ms", "latency_ms", "finish_reason",
                "created", "closed", "replica"]


def _next_row(row: UsageRecord | None, entry: UsageEntry):
    """The row after `entry` (None: no row), whether the entry changed it, and what to give
    back to the monthly counter for the attempt it replaces (key, tenant, API key, tokens and
    when they were charged; None when it replaces none)."""
    if entry.op == "void":
        if row is not None and row.attempt == entry.attempt and not row.closed:
            return None, True, None
        return row, False, None
    fields = {
        "tenant_id": entry.tenant_id, "api_key_id": entry.api_key_id, "request_id": entry.request_id[:64],
        "model": entry.model[:128], "lane": Lane(entry.lane), "attempt": entry.attempt,
        "prompt_tokens": entry.prompt_tokens, "completion_tokens": entry.completion_tokens,
        "cached_tokens": entry.cached_tokens, "endpoint": entry.endpoint[:64], "batch": entry.batch[:40],
        "ttft_ms": entry.ttft_ms, "latency_ms": entry.latency_ms, "finish_reason": entry.finish_reason[:32],
        "created": entry.created_at, "closed": entry.op == "close", "replica": entry.replica[:100],
    }
    if row is None:
        return UsageRecord(key=entry.key, **fields), True, None
    swept = row.closed and row.finish_reason == LOST_REPLICA and entry.op == "close"
    if entry.attempt < row.attempt or (entry.attempt == row.attempt and not swept
                                       and (row.closed or entry.op == "open")):
        return row, False, None  # stale, or already written (a retry of a write that had landed)
    gave_back = None
    if (entry.attempt > row.attempt and row.closed) or swept:
        gave_back = (row.key, row.tenant_id, row.api_key_id, row.total_tokens, row.created)
    for name, value in fields.items():
        setattr(row, name, value)
    return row, True, gave_back
