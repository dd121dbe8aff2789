"""Tenants, their quota tiers, API keys and usage.

Models hold state only; every write goes through `tenants.actions`.
"""
from django.db import models
from django.utils import timezone

from inference.engine import api


class Lane(models.IntegerChoices):
    """The engine's lanes (`inference.engine.api.Lane`) with their labels for forms and the admin."""

    REALTIME = api.Lane.REALTIME, "P0 realtime"
    NEAR_REALTIME = api.Lane.NEAR_REALTIME, "P1 near-realtime"
    BATCH = api.Lane.BATCH, "P2 batch"


class QuotaTier(models.Model):
    """What a tenant may use: its best lane and the limits enforced in Redis."""

    name = models.SlugField(max_length=64, unique=True)
    lane = models.PositiveSmallIntegerField(
        choices=Lane.choices, help_text="The best lane this tier's tenants may use; they may ask for a lower one."
    )
    requests_per_minute = models.PositiveIntegerField()
    tokens_per_minute = models.PositiveIntegerField()
    concurrent_streams = models.PositiveIntegerField()
    max_tokens_per_request = models.PositiveIntegerField()
    monthly_token_budget = models.PositiveBigIntegerField()
    allow_batch = models.BooleanField(default=False, help_text="May submit Batch API jobs.")
    share_prefix_cache = models.BooleanField(
        default=False,
        help_text="The tier's tenants reuse each other's cached prompt prefixes, which saves prefill compute. "
        "Only for tenants that trust each other: cached_tokens never reveals another tenant's prompt, "
        "but a faster first token can. Off: each tenant's cache is its own.",
    )

    class Meta:
        ordering = ["lane", "name"]

    def __str__(self) -> str:
        return f"{self.name} (P{self.lane})"


class Tenant(models.Model):
    """A customer: a company or team. Our equivalent of Zulip's Realm."""

    name = models.CharField(max_length=128, unique=True)
    tier = models.ForeignKey(QuotaTier, on_delete=models.PROTECT, related_name="tenants")
    is_active = models.BooleanField(default=True, help_text="An inactive tenant's keys are refused.")
    debug_capture = models.BooleanField(
        default=False, editable=False,
        help_text="Store each request's messages or prompt for debugging (the console's requests page shows them). "
        "Off by default: nothing of a prompt is stored. Turning it off deletes what it captured.")
    created = models.DateTimeField(default=timezone.now)

    # DRF puts the authenticated caller in request.user and asks it this question.
    is_authenticated = True

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def engine_id(self) -> str:
        """The tenant id the engine sees: a string, never an ORM object."""
        return str(self.pk)


class Scope(models.TextChoices):
    """What a key may do; a key with no scopes may do everything its tenant may."""

    INFERENCE = "inference", "inference: chat, completions, WebSocket, tokenize"
    BATCH = "batch", "batch: upload files, create and cancel batches"
    READ = "read", "read: files, batches and usage"


class ApiKey(models.Model):
    """A tenant's API key, stored as a public prefix and a SHA-256 digest of the whole key.

    The plaintext `sk-<prefix>_<secret>` exists only in the response that issued it. Its own
    limits (empty: the tenant's) apply on top of the tenant's: a key never exceeds its tenant.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=128, blank=True)
    prefix = models.CharField(max_length=32, unique=True, editable=False)
    digest = models.CharField(max_length=64, editable=False)
    created = models.DateTimeField(default=timezone.now, editable=False)
    last_used = models.DateTimeField(null=True, blank=True, editable=False)
    expires = models.DateTimeField(null=True, blank=True, help_text="Empty: never expires.")
    revoked = models.DateTimeField(null=True, blank=True, editable=False)
    scopes = models.JSONField(default=list, blank=True,
                              help_text='A list of "inference", "batch", "read"; empty: all of them.')
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: the tenant's.")
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: the tenant's.")
    monthly_token_budget = models.PositiveBigIntegerField(null=True, blank=True, help_text="Empty: the tenant's.")
    # Set when the key was rotated: the key that replaced it (this one lapses at `expires`).
    replaced_by = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True, editable=False,
                                    related_name="replaces")

    class Meta:
        ordering = ["-created"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"sk-{self.prefix}_… ({self.name or 'unnamed'})"

    def is_usable(self, now) -> bool:
        return self.revoked is None and (self.expires is None or now < self.expires)

    def allows(self, scope: str) -> bool:
        return not self.scopes or scope in self.scopes


class UsageRecord(models.Model):
    """One request's token usage (aborted ones too): the billing source of truth.

    A generation's row is written when it is admitted (`closed` False: its prompt) and
    completed when it ends, both through `tenants.ledger`, keyed by `key` so that a write
    retried from the ledger's outbox lands once. A batch item has one row whatever its
    attempts: each attempt replaces the last one's (`attempt`), so an item is billed once.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage_records")
    api_key = models.ForeignKey(ApiKey, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    # Empty for rows written directly (record_usage), which nothing retries.
    key = models.CharField(max_length=128, null=True, blank=True, unique=True, editable=False)
    attempt = models.PositiveIntegerField(default=0, editable=False)
    closed = models.BooleanField(default=True, help_text="False while the request runs (or if its server died).")
    # The web process serving the request (inference.fleet.instance()): when it leaves the fleet
    # with the row open, another replica completes the row (inference.sweep).
    replica = models.CharField(max_length=100, blank=True, editable=False)
    request_id = models.CharField(max_length=64, blank=True)
    model = models.CharField(max_length=128, blank=True)
    lane = models.PositiveSmallIntegerField(choices=Lane.choices)
    endpoint = models.CharField(max_length=64, blank=True, help_text="The API path, or \"batch\" for batch items.")
    batch = models.CharField(max_length=40, blank=True, help_text="The batch of a batch item's row.")
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0, help_text="Prompt tokens served from the prefix cache.")
    completion_tokens = models.PositiveIntegerField(default=0)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    latency_ms = models.PositiveIntegerField(null=True, blank=True)
    finish_reason = models.CharField(max_length=32, blank=True)
    created = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created"]
        indexes = [
            models.Index(fields=["tenant", "created"]),
            models.Index(fields=["api_key", "created"]),
            models.Index(fields=["batch"], condition=~models.Q(batch=""), name="usage_by_batch"),
            models.Index(fields=["replica"], condition=models.Q(closed=False), name="usage_open_by_replica"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id}: {self.total_tokens} tokens"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class PromptCapture(models.Model):
    """One request's prompt, kept only while its tenant's `debug_capture` is on (tenants.actions)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="prompt_captures")
    request_id = models.CharField(max_length=64, db_index=True)
    created = models.DateTimeField(default=timezone.now)
    prompt = models.TextField(help_text="The request's messages (chat) or prompts (completions) as JSON, cut short.")

    class Meta:
        ordering = ["-created"]


class AuditEntry(models.Model):
    """One staff write (admin API, console, management command): who, what, when, before/after.

    Written in the same transaction as the change it records; never edited."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.CharField(max_length=150, help_text="The staff user's name, \"service-token\" or \"manage.py\".")
    action = models.CharField(max_length=64)  # e.g. "tenant.change_tier", "key.revoke"
    target = models.CharField(max_length=200)  # e.g. "tenant:3", "key:sk-ab12cd34ef56"
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-at", "-pk"]
        verbose_name = "audit entry"
        verbose_name_plural = "audit log"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"
