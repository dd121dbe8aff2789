"""Every write to files, batches and batch items; the sweep that keeps batches moving.

The item life cycle, each step one conditional UPDATE so that two workers, a sweep and a
cancel racing over one row never both win:

    queued --claim--> running --finish--> succeeded | failed
      ^                 |  \\--stop-----> cancelled | expired   (the batch was cancelled or expired)
      |                 |
      +----release------+   (engine back-pressure, a transient error, a worker shutting down)
      +----sweep--------+   (its worker stopped heartbeating: killed)

A queued item is sent to Celery at most once at a time (`dispatched_at`), at most
`BATCH_DISPATCH_WINDOW` per batch. The sweep sends again what Celery lost: a message whose
Redis restarted empty (the Redis "epoch" changed) or one never picked up within
`BATCH_DISPATCH_STALE_S`. A duplicate delivery finds its item not queued and does nothing,
so every item ends with exactly one result.
"""
from __future__ import annotations

import json
import logging
import random
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import BinaryIO

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, F, Q, Sum
from django.utils import timezone

from config import redis as shared_redis
from batches import jsonl
from batches.models import Batch, BatchItem, File
from inference import catalog
from tenants.errors import ApiError
from tenants.models import ApiKey, Tenant, UsageRecord

log = logging.getLogger(__name__)

Status, State = Batch.Status, BatchItem.State
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
EPOCH_KEY = "batches:epoch"
# Named before batch jobs left the inference app; queued messages carry the name (see tasks).
RUN_TASK = "inference.run_batch_item"
STOP_STATES = {"cancelled": State.CANCELLED, "expired": State.EXPIRED, "key_revoked": State.CANCELLED}
STOP_ERRORS = {
    "cancelled": {"code": "batch_cancelled", "message": "The batch was cancelled before this request finished."},
    "expired": {"code": "batch_expired", "message": "The batch expired before this request finished."},
    "key_revoked": {"code": "api_key_revoked",
                    "message": "The API key that created the batch was revoked before this request finished."},
}
# What a batch stopped for ends it as: cancelled (by its tenant, or by its key's revocation) or expired.
STOP_STATUSES = {"cancelled": Status.CANCELLED, "expired": Status.EXPIRED, "key_revoked": Status.CANCELLED}


def _now() -> datetime:
    return timezone.now()


# --- files --------------------------------------------------------------------------------


def require_batch_tier(tenant: Tenant) -> None:
    if not tenant.tier.allow_batch:
        raise ApiError(403, f"This organization's tier ({tenant.tier.name}) does not allow batch jobs.",
                       type="permission_error", code="batch_not_allowed")


def upload_file(tenant: Tenant, filename: str, content: bytes | BinaryIO, purpose: str) -> File:
    """Store an input file after checking every line (`jsonl.parse_input`).

    `content` may be an uploaded file (Django spools large ones to disk): its lines are
    checked straight from it, and its bytes read into memory once, for the row."""
    if purpose != File.Purpose.BATCH:
        raise ApiError(400, f"'purpose' must be \"batch\" (got {purpose!r}).", code="invalid_value", param="purpose")
    require_batch_tier(tenant)
    size = len(content) if isinstance(content, bytes) else content.size
    if size > settings.FILES_MAX_BYTES:
        raise ApiError(413, f"The file is larger than this server's limit of {settings.FILES_MAX_BYTES} bytes.",
                       code="file_too_large", param="file")
    if not isinstance(content, bytes):
        content.seek(0)
        jsonl.parse_input(content, settings.BATCH_MAX_LINES)
        content.seek(0)
        content = content.read()
    else:
        jsonl.parse_input(content, settings.BATCH_MAX_LINES)
    return File.objects.create(tenant=tenant, purpose=purpose, filename=filename[:255] or "upload.jsonl",
                               content=content, bytes=len(content))


def delete_file(file: File) -> None:
    """Batches keep their items (the input was copied into them), so any file may go."""
    Batch.objects.filter(output_file=file).update(output_file=None)
    Batch.objects.filter(error_file=file).update(error_file=None)
    file.delete()


def file_object(file: File) -> dict:
    return {"id": file.id, "object": "file", "bytes": file.bytes, "created_at": int(file.created_at.timestamp()),
            "filename": file.filename, "purpose": file.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


# --- batches ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchSpec:
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict | None
    idempotency_key: str = ""


def create_batch(tenant: Tenant, spec: BatchSpec, api_key: ApiKey | None = None) -> tuple[Batch, bool]:
    """(batch, created). The same idempotency key with the same request returns the first batch.
    `api_key`: the key that creates it, whose budget and revocation the batch's requests keep."""
    require_batch_tier(tenant)
    if spec.idempotency_key:
        existing = Batch.objects.filter(tenant=tenant, idempotency_key=spec.idempotency_key).first()
        if existing is not None:
            return _replayed(existing, spec), False
    try:
        with transaction.atomic():
            return _create_batch(tenant, spec, api_key), True
    except IntegrityError:  # a concurrent request with the same key won the race
        existing = Batch.objects.filter(tenant=tenant, idempotency_key=spec.idempotency_key).first()
        if existing is None:
            raise
        return _replayed(existing, spec), False


def _replayed(batch: Batch, spec: BatchSpec) -> Batch:
    if (batch.input_file_id, batch.endpoint, batch.completion_window) != (spec.input_file_id, spec.endpoint, spec.completion_window):
        raise ApiError(409, "This Idempotency-Key was already used for a different batch request.",
                       code="idempotency_key_reused")
    return batch


def _create_batch(tenant: Tenant, spec: BatchSpec, api_key: ApiKey | None) -> Batch:
    if spec.endpoint not in jsonl.ENDPOINTS:
        raise ApiError(400, f"'endpoint' must be one of {', '.join(jsonl.ENDPOINTS)}.", code="invalid_value",
                       param="endpoint")
    window = COMPLETION_WINDOWS.get(spec.completion_window)
    if window is None:
        raise ApiError(400, f"'completion_window' must be one of {', '.join(COMPLETION_WINDOWS)}.",
                       code="invalid_value", param="completion_window")
    file = File.objects.filter(tenant=tenant, pk=spec.input_file_id, purpose=File.Purpose.BATCH).first()
    if file is None:
        raise ApiError(404, f"No file with id '{spec.input_file_id}' (purpose \"batch\") was found.",
                       code="file_not_found", param="input_file_id")
    now = _now()
    batch = Batch.objects.create(tenant=tenant, api_key=api_key, endpoint=spec.endpoint, model=catalog.served_model_id(),
                                 input_file_id=file.id,
                                 completion_window=spec.completion_window, metadata=spec.metadata,
                                 idempotency_key=spec.idempotency_key, created_at=now, expires_at=now + window)
    lines = jsonl.parse_stored(bytes(file.content))
    wrong = [(line.line, line.url) for line in lines if line.url != spec.endpoint]
    if wrong:
        batch.status, batch.failed_at = Status.FAILED, now
        batch.errors = {"object": "list", "data": [
            {"code": "mismatched_endpoint", "line": n, "param": "url",
             "message": f"The line's url {url} does not match the batch's endpoint {spec.endpoint}."}
            for n, url in wrong[:jsonl.MAX_REPORTED]]}
        batch.save(update_fields=["status", "failed_at", "errors"])
        return batch
    BatchItem.objects.bulk_create(
        [BatchItem(batch=batch, line=line.line, custom_id=line.custom_id, url=line.url, body=line.body) for line in lines],
        batch_size=1000,
    )
    batch.status, batch.in_progress_at = Status.IN_PROGRESS, now
    batch.save(update_fields=["status", "in_progress_at"])
    log.info("batch %s: tenant %s, %d items for %s", batch.id, tenant.pk, len(lines), spec.endpoint)
    return batch


def cancel(batch: Batch, reason: str = "cancelled") -> Batch:
    """Stop sending new items now; running ones are aborted by their workers, which poll.
    `reason`: "cancelled" (its tenant asked) or "key_revoked" (the key that created it was)."""
    now = _now()
    fields = {"status": Status.CANCELLING, "cancelling_at": now, "stop_reason": reason}
    if reason == "key_revoked":
        fields["errors"] = {"object": "list", "data": [{"line": None, "param": None, **STOP_ERRORS[reason]}]}
    with transaction.atomic():
        # A batch already expiring stays expired: it has stopped for a reason of its own.
        moved = Batch.objects.filter(pk=batch.pk, status__in=[Status.VALIDATING, Status.IN_PROGRESS],
                                     stop_reason="").update(**fields)
        if moved:
            _stop_queued(batch.pk, reason, now)
    if moved:
        log.info("batch %s: cancelling (%s)", batch.pk, reason)
        finalize(batch.pk)
    batch.refresh_from_db()
    return batch


def _cancel_revoked() -> int:
    """Cancel the running batches whose key was revoked: its holder loses with the key what it
    had queued (a leaked key's batch would otherwise spend for up to a day). Their finished
    requests keep their results; the rest end with `api_key_revoked`."""
    revoked = Batch.objects.filter(status__in=[Status.VALIDATING, Status.IN_PROGRESS], stop_reason="",
                                   api_key__revoked__isnull=False)
    return sum(cancel(batch, "key_revoked").stop_reason == "key_revoked" for batch in revoked)


def _stop_queued(batch_id: str, reason: str, now: datetime) -> None:
    BatchItem.objects.filter(batch_id=batch_id, state=State.QUEUED).update(
        state=STOP_STATES[reason], error=STOP_ERRORS[reason], finished_at=now, dispatched_at=None)


def request_counts(batch: Batch) -> dict[str, int]:
    return _counts(dict(batch.items.values_list("state").annotate(n=Count("id"))))


def _counts(by_state: dict[str, int]) -> dict[str, int]:
    return {"total": sum(by_state.values()), "completed": by_state.get(State.SUCCEEDED, 0),
            "failed": by_state.get(State.FAILED, 0)}


def batch_objects(batches: list[Batch]) -> list[dict]:
    """batch_object of each, with every batch's request counts in one query and their usage in
    another: a page of 100 batches took 200 queries one batch at a time."""
    ids = [batch.id for batch in batches]
    by_batch: dict[str, dict[str, int]] = {batch_id: {} for batch_id in ids}
    for batch_id, state, n in (BatchItem.objects.filter(batch_id__in=ids).values_list("batch_id", "state")
                               .annotate(n=Count("id")).order_by()):
        by_batch[batch_id][state] = n
    usage = usage_of(ids)
    return [batch_object(batch, _counts(by_batch[batch.id]), usage[batch.id]) for batch in batches]


def _ts(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def batch_object(batch: Batch, counts: dict[str, int] | None = None, usage: dict | None = None) -> dict:
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint, "errors": batch.errors,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window, "status": batch.status,
        "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": _ts(batch.created_at), "in_progress_at": _ts(batch.in_progress_at),
        "expires_at": _ts(batch.expires_at), "finalizing_at": _ts(batch.finalizing_at),
        "completed_at": _ts(batch.completed_at), "failed_at": _ts(batch.failed_at),
        "expired_at": _ts(batch.expired_at), "cancelling_at": _ts(batch.cancelling_at),
        "cancelled_at": _ts(batch.cancelled_at),
        "request_counts": counts if counts is not None else request_counts(batch),
        "metadata": batch.metadata, "model": batch.model or None,
        "usage": usage if usage is not None else batch_usage(batch),
    }


def batch_usage(batch: Batch) -> dict:
    """The tokens its items used so far, from their usage rows (one per item, whatever its attempts)."""
    return usage_of([batch.id])[batch.id]


def usage_of(batch_ids: list[str]) -> dict[str, dict]:
    """OpenAI's batch `usage` of each batch, in one query."""
    totals = {row["batch"]: row for row in UsageRecord.objects.filter(batch__in=batch_ids).values("batch").annotate(
        input=Sum("prompt_tokens"), cached=Sum("cached_tokens"), output=Sum("completion_tokens"))}
    usage = {}
    for batch_id in batch_ids:
        row = totals.get(batch_id, {})
        given, cached, made = row.get("input") or 0, row.get("cached") or 0, row.get("output") or 0
        usage[batch_id] = {"input_tokens": given, "input_tokens_details": {"cached_tokens": cached},
                           "output_tokens": made, "output_tokens_details": {"reasoning_tokens": 0},
                           "total_tokens": given + made}
    return usage


# --- the worker's side of an item ---------------------------------------------------------


def claim(item_id: int, token: str) -> BatchItem | None:
    """Take a queued item for one run, or None if it is not to run now (a duplicate
    message, a stopped batch, a backoff not over)."""
    now = _now()
    taken = BatchItem.objects.filter(
        Q(not_before__isnull=True) | Q(not_before__lte=now),
        pk=item_id, state=State.QUEUED, batch__status=Status.IN_PROGRESS, batch__stop_reason="",
        batch__tenant__is_active=True,
    ).update(state=State.RUNNING, claim=token, heartbeat_at=now, attempts=F("attempts") + 1, runs=F("runs") + 1,
             dispatched_at=None)
    if not taken:
        # Its tenant deactivated since it was sent: undispatched, the sweep sends it again once
        # the tenant is active (dispatch skips it until then).
        BatchItem.objects.filter(pk=item_id, state=State.QUEUED, batch__tenant__is_active=False).update(dispatched_at=None)
        return None
    return BatchItem.objects.select_related("batch__tenant").get(pk=item_id)


def heartbeat(item: BatchItem, token: str) -> bool:
    """Renew the run's hold on the item; False when it should stop (cancelled, expired,
    or the sweep gave the item to another run)."""
    return bool(BatchItem.objects.filter(pk=item.pk, state=State.RUNNING, claim=token, batch__stop_reason="").update(
        heartbeat_at=_now()))


def finish(item: BatchItem, token: str, status_code: int, request_id: str, response: dict) -> bool:
    """Store the endpoint's answer as the item's one result; False if the run lost its hold."""
    state = State.SUCCEEDED if status_code == 200 else State.FAILED
    done = BatchItem.objects.filter(pk=item.pk, state=State.RUNNING, claim=token).update(
        state=state, status_code=status_code, request_id=request_id, response=response, finished_at=_now(), claim="")
    if done:
        _after_item(item.batch_id)
    return bool(done)


def release(item: BatchItem, token: str, delay_s: float, counted: bool, error: dict | None = None) -> None:
    """Put the item back in the queue to run after `delay_s`. An uncounted release gives the
    attempt back (not the item's fault); a counted one past BATCH_MAX_ATTEMPTS fails it."""
    now = _now()
    mine = BatchItem.objects.filter(pk=item.pk, state=State.RUNNING, claim=token)
    if counted and item.attempts >= settings.BATCH_MAX_ATTEMPTS:
        exhausted = {"code": "attempts_exhausted",
                     "message": f"The request failed {item.attempts} times; last: {(error or {}).get('message', 'unknown error')}"}
        if mine.update(state=State.FAILED, error=exhausted, finished_at=now, claim=""):
            _after_item(item.batch_id)
        return
    requeued = mine.filter(batch__stop_reason="").update(
        state=State.QUEUED, claim="", not_before=now + timedelta(seconds=delay_s), error=error,
        attempts=F("attempts") - (0 if counted else 1))
    if not requeued:  # its batch was cancelled or expired meanwhile: nothing would ever run it
        stop(item, token)


def stop(item: BatchItem, token: str) -> None:
    """End a running item whose batch was cancelled or expired."""
    reason = Batch.objects.filter(pk=item.batch_id).values_list("stop_reason", flat=True).first()
    if reason not in STOP_STATES:  # the sweep gave it to another run: nothing of ours to stop
        return
    if BatchItem.objects.filter(pk=item.pk, state=State.RUNNING, claim=token).update(
            state=STOP_STATES[reason], error=STOP_ERRORS[reason], finished_at=_now(), claim=""):
        _after_item(item.batch_id)


def backoff_s(attempts: int) -> float:
    """Exponential backoff with jitter: half fixed, half random, so retries spread out."""
    ceiling = min(settings.BATCH_RETRY_MAX_S, settings.BATCH_RETRY_BASE_S * 2 ** max(0, attempts - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


def _after_item(batch_id: str) -> None:
    try:
        dispatch(batch_id)
    except Exception as exc:  # Redis away: the sweep sends it later
        log.warning("batch %s: could not send the next items: %s", batch_id, exc)
    finalize(batch_id)


# --- dispatch -----------------------------------------------------------------------------


def current_epoch() -> str:
    """An id of the Redis that carries the messages: a Redis restarted empty has a new one,
    which tells the sweep that every message sent through the old one is gone."""
    client = shared_redis.client()
    client.set(EPOCH_KEY, secrets.token_hex(8), nx=True)
    return client.get(EPOCH_KEY).decode()


def dispatch(batch_id: str, epoch: str | None = None) -> int:
    """Send messages for queued items of an in-progress batch, up to its window; returns how many."""
    from config.celery import app

    now = _now()
    # A deactivated tenant's items wait, queued, for its reactivation or the batch's expiry.
    items = BatchItem.objects.filter(batch_id=batch_id, batch__status=Status.IN_PROGRESS, batch__stop_reason="",
                                     batch__tenant__is_active=True)
    in_flight = items.filter(Q(state=State.RUNNING) | Q(state=State.QUEUED, dispatched_at__isnull=False)).count()
    room = settings.BATCH_DISPATCH_WINDOW - in_flight
    if room <= 0:
        return 0
    ready = items.filter(Q(not_before__isnull=True) | Q(not_before__lte=now), state=State.QUEUED,
                         dispatched_at__isnull=True).order_by("line").values_list("pk", flat=True)[:room]
    epoch = epoch or current_epoch()
    sent = 0
    for item_id in list(ready):
        # Mark first: of two dispatchers racing, only the one whose update lands sends.
        if not BatchItem.objects.filter(pk=item_id, state=State.QUEUED, dispatched_at__isnull=True).update(
                dispatched_at=now, dispatch_epoch=epoch):
            continue
        try:
            app.send_task(RUN_TASK, args=[item_id], retry=False)
        except Exception:
            BatchItem.objects.filter(pk=item_id, dispatched_at=now).update(dispatched_at=None)
            raise
        sent += 1
    return sent


# --- finalizing ---------------------------------------------------------------------------


def finalize(batch_id: str) -> bool:
    """When no item of the batch is left to run: write its output and error files and give
    it its final status. Only one caller wins the move to `finalizing`."""
    if BatchItem.objects.filter(batch_id=batch_id).exclude(state__in=BatchItem.FINAL).exists():
        return False
    now = _now()
    if not Batch.objects.filter(pk=batch_id, status__in=[Status.IN_PROGRESS, Status.CANCELLING]).update(
            status=Status.FINALIZING, finalizing_at=now):
        return False
    _write_results(Batch.objects.get(pk=batch_id), now)
    return True


def _write_results(batch: Batch, now: datetime) -> None:
    outputs: list[str] = []
    failures: list[str] = []
    prefix = f"batch_req_{batch.id.removeprefix('batch_')}"
    for item in batch.items.order_by("line").iterator(chunk_size=500):
        line = jsonl.output_line(f"{prefix}_{item.line}", item.custom_id, item.status_code, item.request_id,
                                       item.response, None if item.status_code is not None else item.error)
        (outputs if item.state == State.SUCCEEDED else failures).append(line)
    with transaction.atomic():
        batch.output_file = _result_file(batch, "output", outputs, now)
        batch.error_file = _result_file(batch, "errors", failures, now)
        final = STOP_STATUSES.get(batch.stop_reason, Status.COMPLETED)
        batch.status = final
        setattr(batch, {Status.CANCELLED: "cancelled_at", Status.EXPIRED: "expired_at"}.get(final, "completed_at"), now)
        batch.save()
    log.info("batch %s: %s, %d results and %d errors", batch.id, final, len(outputs), len(failures))


def _result_file(batch: Batch, kind: str, lines: list[str], now: datetime) -> File | None:
    if not lines:
        return None
    content = ("\n".join(lines) + "\n").encode()
    return File.objects.create(tenant_id=batch.tenant_id, purpose=File.Purpose.BATCH_OUTPUT,
                               filename=f"{batch.id}_{kind}.jsonl", content=content, bytes=len(content), created_at=now)


# --- the sweep ----------------------------------------------------------------------------


LAST_SWEEP_KEY = "batches:last-sweep"  # the console's workers panel shows it


def sweep() -> dict[str, int]:
    """One pass over unfinished batches; safe to run anywhere, any number of times at once."""
    now = _now()
    report = {"expired": _expire(now), "requeued": _requeue_abandoned(now)}
    report["refinalized"] = _refinalize_stuck(now)
    report["key_revoked"] = _cancel_revoked()
    try:
        epoch = current_epoch()
    except Exception as exc:
        log.warning("sweep: Redis unavailable, nothing sent: %s", exc)
        report.update(resent=0, sent=0)
        return report
    report["resent"] = _forget_lost_messages(now, epoch)
    report["sent"] = sum(dispatch(batch_id, epoch) for batch_id in _active_batch_ids())
    for batch_id, reason in Batch.objects.filter(status__in=[Status.IN_PROGRESS, Status.CANCELLING]).values_list(
            "pk", "stop_reason"):
        if reason:  # a queued item that slipped past the stop (handed back as it happened)
            _stop_queued(batch_id, reason, now)
        finalize(batch_id)
    _record_sweep(now, report)
    return report


def _record_sweep(now: datetime, report: dict[str, int]) -> None:
    """Only a pass that reached Redis is recorded (there), so with Redis away the panel's last
    sweep grows old rather than each pass waiting on a Redis that is gone once more."""
    try:
        shared_redis.client().set(LAST_SWEEP_KEY, json.dumps({"at": now.timestamp(), **report}))
    except Exception as exc:
        log.warning("sweep: could not record the pass: %s", exc)


def _active_batch_ids() -> list[str]:
    return list(Batch.objects.filter(status=Status.IN_PROGRESS).values_list("pk", flat=True))


def _expire(now: datetime) -> int:
    expired = 0
    for batch_id in Batch.objects.filter(status=Status.IN_PROGRESS, stop_reason="", expires_at__lte=now).values_list("pk", flat=True):
        with transaction.atomic():
            if Batch.objects.filter(pk=batch_id, stop_reason="").update(stop_reason="expired"):
                _stop_queued(batch_id, "expired", now)
                expired += 1
        log.info("batch %s: expired", batch_id)
    return expired


def _requeue_abandoned(now: datetime) -> int:
    """Running items whose worker stopped heartbeating (killed): queue them again, or end
    them if their batch stopped meanwhile. The attempt they used stays counted."""
    stale = now - timedelta(seconds=settings.BATCH_ITEM_LEASE_S)
    abandoned = BatchItem.objects.filter(state=State.RUNNING, heartbeat_at__lt=stale)
    moved = 0
    for item in abandoned.select_related("batch"):
        mine = BatchItem.objects.filter(pk=item.pk, state=State.RUNNING, claim=item.claim)
        reason = item.batch.stop_reason
        if reason in STOP_STATES:
            done = mine.update(state=STOP_STATES[reason], error=STOP_ERRORS[reason], finished_at=now, claim="")
        elif item.attempts >= settings.BATCH_MAX_ATTEMPTS:
            done = mine.update(state=State.FAILED, finished_at=now, claim="", error={
                "code": "attempts_exhausted", "message": f"The request's worker was lost {item.attempts} times."})
        else:
            done = mine.update(state=State.QUEUED, claim="", dispatched_at=None, not_before=None)
        if done:
            moved += 1
            log.warning("batch %s: item %s (line %d) lost its worker after attempt %d", item.batch_id, item.pk,
                        item.line, item.attempts)
    return moved


def _forget_lost_messages(now: datetime, epoch: str) -> int:
    """Queued items whose message went with a Redis that restarted empty, or that nobody
    picked up for BATCH_DISPATCH_STALE_S: mark them unsent, so dispatch sends them again."""
    stale = now - timedelta(seconds=settings.BATCH_DISPATCH_STALE_S)
    lost = BatchItem.objects.filter(state=State.QUEUED, dispatched_at__isnull=False).filter(
        ~Q(dispatch_epoch=epoch) | Q(dispatched_at__lt=stale))
    return lost.update(dispatched_at=None)


def _refinalize_stuck(now: datetime) -> int:
    """A batch whose finalizer died between `finalizing` and its final status."""
    stuck = Batch.objects.filter(status=Status.FINALIZING, finalizing_at__lt=now - timedelta(seconds=60))
    redone = 0
    for batch in stuck:
        # Take it over first, so that of two sweeps only one writes its files.
        if Batch.objects.filter(pk=batch.pk, status=Status.FINALIZING, finalizing_at=batch.finalizing_at).update(
                finalizing_at=now):
            _write_results(batch, now)
            redone += 1
    return redone
