"""Every write to tenants, tiers, keys and usage goes through here.

Views, admin pages and management commands parse their input and call one of these;
keeping writes in one place keeps their invariants (no plaintext key stored, usage
charged to the budget) in one place too.
"""
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from tenants import keys, quota
from tenants.models import ApiKey, Lane, QuotaTier, Tenant, UsageRecord

# last_used is advisory: writing it on every request would turn each read into a write.
LAST_USED_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True)
class IssuedKey:
    """A new key and its plaintext, which exists only here: show it once, then drop it."""

    api_key: ApiKey
    plaintext: str


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
) -> tuple[QuotaTier, bool]:
    """Create the tier or update it in place; returns (tier, created)."""
    return QuotaTier.objects.update_or_create(
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


def create_tenant(name: str, tier: QuotaTier) -> Tenant:
    return Tenant.objects.create(name=name, tier=tier)


def change_tier(tenant: Tenant, tier: QuotaTier) -> Tenant:
    """Move a tenant to another tier. Limits are read per request, so this applies at once."""
    tenant.tier = tier
    tenant.save(update_fields=["tier"])
    return tenant


def update_tenant(tenant: Tenant, *, name: str, tier: QuotaTier, is_active: bool) -> Tenant:
    """Save all of a tenant's editable fields (the admin hands over an instance its form
    already changed, so comparing against it would miss the change)."""
    tenant.name, tenant.tier, tenant.is_active = name, tier, is_active
    tenant.save(update_fields=["name", "tier", "is_active"])
    return tenant


def issue_key(tenant: Tenant, name: str = "", expires: datetime | None = None) -> IssuedKey:
    """Create a key; only its prefix and digest are stored."""
    for _ in range(5):
        new = keys.generate()
        try:
            with transaction.atomic():
                api_key = ApiKey.objects.create(
                    tenant=tenant, name=name, prefix=new.prefix, digest=keys.digest(new.plaintext), expires=expires
                )
        except IntegrityError:
            continue  # prefix collision (48 random bits): draw again
        return IssuedKey(api_key=api_key, plaintext=new.plaintext)
    raise RuntimeError("could not draw a unique key prefix")


def revoke_key(api_key: ApiKey, now: datetime | None = None) -> ApiKey:
    """Refuse the key from now on. Revoking twice keeps the first time."""
    if api_key.revoked is None:
        api_key.revoked = now or timezone.now()
        api_key.save(update_fields=["revoked"])
    return api_key


def mark_key_used(api_key: ApiKey, now: datetime) -> None:
    """Record that the key was used, at most once per LAST_USED_RESOLUTION."""
    if api_key.last_used is not None and now - api_key.last_used < LAST_USED_RESOLUTION:
        return
    ApiKey.objects.filter(pk=api_key.pk).update(last_used=now)
    api_key.last_used = now


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
        ttft_ms=ttft_ms,
        latency_ms=latency_ms,
        finish_reason=finish_reason,
    )
    quota.charge_monthly_tokens(tenant, record.total_tokens, record.created)
    return record
