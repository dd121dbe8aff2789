"""Batch jobs: uploaded files, batches and their items (the OpenAI Files and Batch APIs).

The database is the source of truth for a batch: one `BatchItem` row per input line holds
its state and, once final, its result. Celery only carries "run item N" messages; losing
one (a killed worker, a Redis that restarted empty) loses nothing, because the sweep
(`batches.actions.sweep`) sends it again from these rows. Every write goes through
`batches.actions`.

The tables keep the names they had when these models were the inference app's
(`Meta.db_table`): moving the models into this app moved no row.
"""
import secrets

from django.db import models
from django.db.models import Q
from django.utils import timezone

from tenants.models import ApiKey, Tenant


def new_id(prefix: str) -> str:
    """An unguessable public id (`file-…`, `batch_…`): ids are never sequential, so a
    tenant cannot probe for another's objects."""
    return f"{prefix}{secrets.token_hex(12)}"


def _file_id() -> str:
    return new_id("file-")


def _batch_id() -> str:
    return new_id("batch_")


class File(models.Model):
    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    id = models.CharField(primary_key=True, max_length=40, default=_file_id, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="files")
    purpose = models.CharField(max_length=32, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    # Stored in the database so any worker on any machine reads the same bytes.
    content = models.BinaryField()
    bytes = models.PositiveBigIntegerField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "inference_file"
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"


class Batch(models.Model):
    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    FINAL = (Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED)
    # Items still run in these; the sweep and the workers look only at such batches.
    ACTIVE = (Status.IN_PROGRESS, Status.FINALIZING, Status.CANCELLING)

    id = models.CharField(primary_key=True, max_length=40, default=_batch_id, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="batches")
    # The key that created the batch: its requests are held to the key's own monthly budget and
    # billed to it, and revoking the key cancels the batch. Empty: created without a key.
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
                                editable=False)
    endpoint = models.CharField(max_length=64)
    model = models.CharField(max_length=128, blank=True)  # the model the batch's lines run on
    input_file_id = models.CharField(max_length=40)
    completion_window = models.CharField(max_length=16, default="24h")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.VALIDATING, db_index=True)
    metadata = models.JSONField(null=True, blank=True)
    errors = models.JSONField(null=True, blank=True)  # validation errors, OpenAI's `errors.data`
    output_file = models.ForeignKey(File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    error_file = models.ForeignKey(File, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    idempotency_key = models.CharField(max_length=255, blank=True)
    # Why items stopped before finishing: "", "cancelled", "expired" or "key_revoked". Workers poll it.
    stop_reason = models.CharField(max_length=16, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "inference_batch"
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "batches"
        constraints = [
            models.UniqueConstraint(fields=["tenant", "idempotency_key"], condition=~Q(idempotency_key=""),
                                    name="batch_idempotency_key_per_tenant"),
        ]

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"


class BatchItem(models.Model):
    class State(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        CANCELLED = "cancelled"
        EXPIRED = "expired"

    FINAL = (State.SUCCEEDED, State.FAILED, State.CANCELLED, State.EXPIRED)

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="items")
    line = models.PositiveIntegerField()  # 1-based line number in the input file
    custom_id = models.CharField(max_length=512)
    url = models.CharField(max_length=64)
    body = models.JSONField()
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    # Deliveries that started running it. Runs that ended through no fault of the item's
    # (engine back-pressure, a worker shutting down) give theirs back; the rest count, so
    # an item that keeps killing its worker fails after BATCH_MAX_ATTEMPTS instead of looping.
    attempts = models.PositiveIntegerField(default=0)
    # Every run of the item, counted or not (attempts gives uncounted ones back): the engine
    # keys the item's one usage row by it, so each run's bill replaces the last run's.
    runs = models.PositiveIntegerField(default=0)
    not_before = models.DateTimeField(null=True, blank=True)  # backoff: not sent before this
    dispatched_at = models.DateTimeField(null=True, blank=True)  # a message for it is in flight
    dispatch_epoch = models.CharField(max_length=32, blank=True)  # the Redis it was sent through
    claim = models.CharField(max_length=64, blank=True)  # the run that holds it while running
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    request_id = models.CharField(max_length=64, blank=True)
    response = models.JSONField(null=True, blank=True)  # the endpoint's response body
    error = models.JSONField(null=True, blank=True)  # {"code", "message"} when no response exists
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "inference_batchitem"
        ordering = ["batch", "line"]
        constraints = [models.UniqueConstraint(fields=["batch", "custom_id"], name="batch_item_custom_id_unique")]
        indexes = [models.Index(fields=["batch", "state"]), models.Index(fields=["state", "dispatched_at"])]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.custom_id} ({self.state})"
