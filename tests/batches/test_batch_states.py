"""The item state machine of `batches.actions`, without a server or a worker: each step
is one conditional UPDATE, and these tests drive the races a worker, a duplicate message,
the sweep and a cancel can run into, one step at a time, against the real database and a
real Redis. What they protect: every item ends with exactly one result.
"""
from __future__ import annotations

import json
import uuid
from datetime import timedelta

import kombu.pools
import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from batches import actions as batch_actions
from batches.models import Batch, BatchItem, File
from config.celery import app as celery_app
from tenants import actions
from tenants.models import Tenant

State, Status = BatchItem.State, Batch.Status
CHAT_URL = "/v1/chat/completions"
QUEUE = "celery"  # the list Celery's Redis transport keeps the default queue's messages in


# --- fixtures and helpers -----------------------------------------------------------------


def _point_celery_at(broker_url: str, backend_url: str) -> None:
    """Send through these from now on (send_task may also subscribe to a task's result on
    the result backend), forgetting the connections made to the old ones."""
    celery_app.conf.broker_url = broker_url
    celery_app.conf.result_backend = backend_url
    consumer = getattr(celery_app._backend, "result_consumer", None)
    if consumer is not None:
        consumer.stop()  # its pub/sub connection, if a send opened one
    kombu.pools.reset()  # closes the broker connections and forgets their pools
    celery_app._pool = None
    celery_app.amqp._producer_pool = None
    celery_app._backend_cache = None
    celery_app._local.__dict__.pop("backend", None)


@pytest.fixture(autouse=True)
def broker(redis, redis_server):
    """The test Redis, with Celery's app sending through it (never the machine's own Redis)."""
    previous = celery_app.conf.broker_url, celery_app.conf.result_backend
    _point_celery_at(redis_server, redis_server)
    port = int(redis_server.rsplit(":", 1)[1].split("/")[0])
    assert celery_app.connection_for_write().port == port
    assert celery_app.backend.client.connection_pool.connection_kwargs["port"] == port
    yield redis
    _point_celery_at(*previous)


@pytest.fixture
def tenant(db) -> Tenant:
    tier, _ = actions.save_tier("batch", lane=2, requests_per_minute=1000, tokens_per_minute=10**6,
                                concurrent_streams=10, max_tokens_per_request=512, monthly_token_budget=10**9,
                                allow_batch=True)
    return actions.create_tenant("acme", tier)


def input_file(n: int) -> bytes:
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": CHAT_URL,
              "body": {"messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 5}} for i in range(n)]
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


def start_batch(tenant: Tenant, n: int) -> Batch:
    file = batch_actions.upload_file(tenant, "in.jsonl", input_file(n), "batch")
    batch, created = batch_actions.create_batch(tenant, batch_actions.BatchSpec(file.id, CHAT_URL, "24h", None))
    assert created and batch.status == Status.IN_PROGRESS
    return batch


def items(batch: Batch) -> list[BatchItem]:
    return list(batch.items.order_by("line"))


def item_at(batch: Batch, line: int) -> BatchItem:
    return batch.items.get(line=line)


def claim(item: BatchItem) -> tuple[BatchItem, str]:
    """One delivery's claim of the item, which must succeed."""
    token = f"run-{uuid.uuid4().hex[:8]}"
    claimed = batch_actions.claim(item.pk, token)
    assert claimed is not None, f"item on line {item.line} could not be claimed"
    return claimed, token


def succeed(item: BatchItem, token: str) -> bool:
    return batch_actions.finish(item, token, 200, f"req-{token}", {"object": "chat.completion", "run": token})


def results(batch: Batch) -> tuple[list[dict], list[dict]]:
    """The lines of the batch's output and error files."""
    batch.refresh_from_db()

    def read(file: File | None) -> list[dict]:
        return [] if file is None else [json.loads(line) for line in bytes(file.content).decode().splitlines()]

    return read(batch.output_file), read(batch.error_file)


def assert_each_custom_id_once(batch: Batch, outputs: list[dict], errors: list[dict]) -> None:
    ids = [line["custom_id"] for line in outputs + errors]
    assert sorted(ids) == sorted(batch.items.values_list("custom_id", flat=True))


def queued_messages(redis) -> list[int]:
    """The item ids of the run messages waiting in the test Redis."""
    sent = [json.loads(raw) for raw in redis.lrange(QUEUE, 0, -1)]
    assert all(message["headers"]["task"] == batch_actions.RUN_TASK for message in sent)
    return sorted(json.loads(message["headers"]["argsrepr"])[0] for message in sent)


def lapse_heartbeat(item: BatchItem) -> None:
    """As if the item's worker was killed: no heartbeat for longer than the lease."""
    past = timezone.now() - timedelta(seconds=django_settings.BATCH_ITEM_LEASE_S + 1)
    BatchItem.objects.filter(pk=item.pk).update(heartbeat_at=past)


def batch_underway(tenant: Tenant, n: int, finished: int, running: int) -> tuple[Batch, list[tuple[BatchItem, str]]]:
    """A batch of `n` items: the first `finished` succeeded, the next `running` are claimed
    (returned with their runs' tokens), the rest queued."""
    batch = start_batch(tenant, n)
    for line in range(1, finished + 1):
        assert succeed(*claim(item_at(batch, line)))
    return batch, [claim(item_at(batch, line)) for line in range(finished + 1, finished + running + 1)]


def stop_batch(batch: Batch, reason: str) -> None:
    """Cancel the batch, or let the sweep expire it."""
    if reason == "cancelled":
        batch_actions.cancel(batch)
    else:
        Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
        assert batch_actions.sweep()["expired"] == 1


def states(batch: Batch) -> dict[int, str]:
    return dict(batch.items.values_list("line", "state"))


def dispatched(batch: Batch) -> list[int]:
    """The ids of the batch's items with a message in flight."""
    return sorted(batch.items.filter(state=State.QUEUED, dispatched_at__isnull=False).values_list("pk", flat=True))


# --- one result per item: claims -------------------------------------------------------------


def test_a_duplicate_delivery_finds_its_item_taken_and_does_nothing(tenant):
    batch = start_batch(tenant, 2)
    item, token = claim(item_at(batch, 1))
    assert (item.state, item.attempts) == (State.RUNNING, 1)

    assert batch_actions.claim(item.pk, "run-duplicate") is None
    item.refresh_from_db()
    assert (item.state, item.claim, item.attempts) == (State.RUNNING, token, 1)

    assert succeed(item, token)
    assert batch_actions.claim(item.pk, "run-late") is None  # delivered again after it finished
    item.refresh_from_db()
    assert (item.state, item.attempts, item.response["run"]) == (State.SUCCEEDED, 1, token)


def test_a_run_that_lost_its_claim_to_the_sweep_cannot_write_its_result(tenant):
    batch = start_batch(tenant, 1)
    item, old = claim(item_at(batch, 1))
    lapse_heartbeat(item)
    assert batch_actions.sweep()["requeued"] == 1

    # The run was only stalled, not killed: it wakes up to find the item gone.
    assert not batch_actions.heartbeat(item, old)
    assert not succeed(item, old)
    requeued = item_at(batch, 1)
    assert (requeued.state, requeued.status_code, requeued.response, requeued.claim) == (State.QUEUED, None, None, "")

    current, new = claim(requeued)
    assert current.attempts == 2  # the lost run's attempt stays counted
    assert batch_actions.heartbeat(current, new) and not batch_actions.heartbeat(item, old)
    assert not succeed(item, old)
    batch_actions.release(item, old, 0, counted=False)  # nor can it hand back what is no longer its own
    assert (item_at(batch, 1).state, item_at(batch, 1).claim) == (State.RUNNING, new)

    assert succeed(current, new)
    outputs, errors = results(batch)
    assert batch.status == Status.COMPLETED and errors == []
    assert [line["response"]["body"]["run"] for line in outputs] == [new]


# --- releases and retries ----------------------------------------------------------------


def test_an_uncounted_release_gives_the_attempt_back_and_waits_out_its_delay(tenant, settings):
    settings.BATCH_MAX_ATTEMPTS = 1
    batch = start_batch(tenant, 1)
    item, token = claim(item_at(batch, 1))
    busy = {"code": "lane_full", "message": "The lane is full."}
    batch_actions.release(item, token, 3600, counted=False, error=busy)

    released = item_at(batch, 1)  # at the attempt limit, yet not failed: it was not the item's fault
    assert (released.state, released.attempts, released.claim, released.error) == (State.QUEUED, 0, "", busy)
    assert batch_actions.claim(released.pk, "run-early") is None  # its backoff is not over
    BatchItem.objects.filter(pk=released.pk).update(not_before=timezone.now())  # ... and now it is
    again, _ = claim(released)
    assert again.attempts == 1


def test_a_counted_release_at_the_attempt_limit_fails_the_item(tenant, settings):
    settings.BATCH_MAX_ATTEMPTS = 2
    batch = start_batch(tenant, 1)
    item, token = claim(item_at(batch, 1))
    batch_actions.release(item, token, 0, counted=True, error={"code": "server_error", "message": "boom 1"})
    assert (item_at(batch, 1).state, item_at(batch, 1).attempts) == (State.QUEUED, 1)

    item, token = claim(item_at(batch, 1))
    assert item.attempts == 2
    batch_actions.release(item, token, 0, counted=True, error={"code": "server_error", "message": "boom 2"})
    failed = item_at(batch, 1)
    assert failed.state == State.FAILED
    assert failed.error["code"] == "attempts_exhausted" and "boom 2" in failed.error["message"]
    assert batch_actions.claim(failed.pk, "run-after") is None

    outputs, errors = results(batch)
    assert batch.status == Status.COMPLETED and outputs == []
    assert [(line["custom_id"], line["error"]["code"]) for line in errors] == [("req-0", "attempts_exhausted")]


def test_backoff_grows_with_attempts_is_jittered_and_capped(settings):
    settings.BATCH_RETRY_BASE_S, settings.BATCH_RETRY_MAX_S = 1.0, 60.0
    draws = {attempts: [batch_actions.backoff_s(attempts) for _ in range(200)] for attempts in range(1, 41)}
    for attempts in range(1, 6):  # below the cap, each attempt waits at least as long as any before
        assert min(draws[attempts + 1]) >= max(draws[attempts]), attempts
    assert all(0 < delay <= 60.0 for values in draws.values() for delay in values)
    assert max(draws[40]) > 30.0  # the cap is reached, not merely respected
    assert all(len(set(values)) > 100 for values in draws.values()), "retries must not all wait alike"


# --- cancel and expiry ---------------------------------------------------------------------


def test_cancel_stops_queued_items_at_once_and_running_ones_through_their_worker(tenant):
    batch, [(aborted, aborted_token), (answered, answered_token)] = batch_underway(tenant, 5, finished=1, running=2)
    assert batch_actions.cancel(batch).status == Status.CANCELLING
    assert states(batch) == {1: State.SUCCEEDED, 2: State.RUNNING, 3: State.RUNNING, 4: State.CANCELLED,
                             5: State.CANCELLED}
    assert batch_actions.claim(item_at(batch, 4).pk, "run-late") is None  # its message arrives after the cancel

    assert not batch_actions.heartbeat(aborted, aborted_token)  # the worker polls, aborts, and says so
    batch_actions.stop(aborted, aborted_token)
    assert succeed(answered, answered_token)  # this one's answer came before its worker noticed

    outputs, errors = results(batch)
    assert batch.status == Status.CANCELLED and batch.cancelled_at is not None
    assert [line["custom_id"] for line in outputs] == ["req-0", "req-2"]
    assert [(line["custom_id"], line["response"], line["error"]["code"]) for line in errors] == [
        ("req-1", None, "batch_cancelled"), ("req-3", None, "batch_cancelled"), ("req-4", None, "batch_cancelled")]
    assert_each_custom_id_once(batch, outputs, errors)


def test_a_batch_past_its_window_is_expired_by_the_sweep_keeping_what_finished(tenant):
    batch, [(running, running_token), (killed, _)] = batch_underway(tenant, 4, finished=1, running=2)
    lapse_heartbeat(killed)
    stop_batch(batch, "expired")
    assert states(batch) == {1: State.SUCCEEDED, 2: State.RUNNING, 3: State.EXPIRED, 4: State.EXPIRED}
    assert not batch_actions.heartbeat(running, running_token)
    batch_actions.stop(running, running_token)

    outputs, errors = results(batch)
    assert batch.status == Status.EXPIRED and batch.expired_at is not None
    assert [line["custom_id"] for line in outputs] == ["req-0"]
    assert [(line["custom_id"], line["error"]["code"]) for line in errors] == [
        ("req-1", "batch_expired"), ("req-2", "batch_expired"), ("req-3", "batch_expired")]
    assert_each_custom_id_once(batch, outputs, errors)


@pytest.mark.parametrize("reason", ["cancelled", "expired"])
def test_an_item_handed_back_after_its_batch_stopped_still_ends_with_one_result(tenant, reason):
    batch, [(item, token)] = batch_underway(tenant, 2, finished=0, running=1)
    stop_batch(batch, reason)
    # The engine answered "busy" (or the worker began shutting down) before the worker saw
    # the stop: it hands the item back instead of stopping it.
    batch_actions.release(item, token, 0, counted=False, error={"code": "lane_full", "message": "The lane is full."})
    batch_actions.sweep()

    outputs, errors = results(batch)
    assert states(batch) == {1: batch_actions.STOP_STATES[reason], 2: batch_actions.STOP_STATES[reason]}
    assert batch.status == {"cancelled": Status.CANCELLED, "expired": Status.EXPIRED}[reason]
    assert outputs == [] and [line["error"]["code"] for line in errors] == [f"batch_{reason}"] * 2


# --- finalizing ----------------------------------------------------------------------------


def test_a_batch_is_finalized_once_whoever_calls_finalize(tenant):
    batch, [(first, first_token), (second, second_token)] = batch_underway(tenant, 2, finished=0, running=2)
    assert succeed(first, first_token)
    assert not batch_actions.finalize(batch.id)  # an item still runs: nothing to write yet
    assert not File.objects.filter(purpose=File.Purpose.BATCH_OUTPUT).exists()

    assert succeed(second, second_token)  # the last result finalizes the batch
    batch.refresh_from_db()
    assert batch.status == Status.COMPLETED
    output_file_id = batch.output_file_id

    assert not batch_actions.finalize(batch.id)  # a second finalizer, the sweep, a late cancel: none rewrites
    batch_actions.sweep()
    assert batch_actions.cancel(batch).status == Status.COMPLETED
    assert list(File.objects.filter(purpose=File.Purpose.BATCH_OUTPUT).values_list("pk", flat=True)) == [output_file_id]
    outputs, errors = results(batch)
    assert batch.output_file_id == output_file_id and errors == []
    assert_each_custom_id_once(batch, outputs, errors)


# --- dispatch ------------------------------------------------------------------------------


def test_dispatch_keeps_a_window_of_items_in_flight_and_finishing_one_sends_the_next(tenant, broker, settings):
    settings.BATCH_DISPATCH_WINDOW = 2
    batch = start_batch(tenant, 5)
    ids = [item.pk for item in items(batch)]

    assert batch_actions.dispatch(batch.id) == 2
    assert dispatched(batch) == ids[:2] and queued_messages(broker) == ids[:2]
    assert batch_actions.dispatch(batch.id) == 0  # the window is full
    assert batch_actions.sweep()["sent"] == 0

    first, token = claim(item_at(batch, 1))  # (no worker here pops its message from the list)
    assert batch_actions.dispatch(batch.id) == 0  # a running item still holds its place in the window
    assert succeed(first, token)
    assert dispatched(batch) == ids[1:3] and queued_messages(broker) == ids[:3]


def test_after_redis_restarts_empty_the_sweep_resends_what_it_carried(tenant, broker, settings):
    settings.BATCH_DISPATCH_WINDOW = 2
    batch = start_batch(tenant, 4)
    ids = [item.pk for item in items(batch)]
    assert batch_actions.dispatch(batch.id) == 2
    old_epoch = batch_actions.current_epoch()
    assert batch_actions.sweep()["resent"] == 0  # the same Redis: nothing lost, nothing sent twice
    assert queued_messages(broker) == ids[:2]

    broker.flushall()  # Redis restarted with nothing in it: both messages are gone
    report = batch_actions.sweep()
    assert (report["resent"], report["sent"]) == (2, 2)
    new_epoch = batch_actions.current_epoch()
    assert new_epoch != old_epoch
    epochs = dict(batch.items.filter(pk__in=ids[:2]).values_list("pk", "dispatch_epoch"))
    assert epochs == dict.fromkeys(ids[:2], new_epoch)
    assert dispatched(batch) == ids[:2] and queued_messages(broker) == ids[:2]

    assert batch_actions.sweep()["resent"] == 0
    assert queued_messages(broker) == ids[:2]
