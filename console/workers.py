"""What the workers panel reads: the Celery workers that answer, the broker's queue depths,
the items running per worker host, and the batch sweep's last pass.

Each source is bounded in time and may be away: the page renders what answered and says
what did not. A worker counts as online when it answers the `active` broadcast within
INSPECT_TIMEOUT_S; that one broadcast also lists what each one runs now.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
from collections import Counter
from dataclasses import dataclass, field

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from batches import actions as batch_actions
from batches.models import Batch, BatchItem
from config import redis as shared_redis

log = logging.getLogger(__name__)

# A worker busy with items still answers a broadcast within milliseconds on this machine;
# one second also bounds the page when none answers (the broadcast waits that long).
INSPECT_TIMEOUT_S = 1.0
REDIS_TIMEOUT_S = 0.5  # the broker answers LLEN in well under a millisecond when it is up
# kombu's Redis transport keeps a queue's prioritized messages in lists named after it
# with these suffixes (kombu.transport.redis, PRIORITY_STEPS 0, 3, 6, 9; 0 is the bare name).
PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")

_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="console-inspect")


@dataclass
class Workers:
    online: dict[str, int] | None  # worker name -> tasks it runs now; None: the broadcast failed
    queues: dict[str, int] | None  # queue -> messages waiting; None: Redis did not answer
    running_by_host: dict[str, int]  # host:pid of the run that holds them -> running items (the database)
    queued_items: int  # items waiting in in-progress batches (the database)
    last_sweep: dict | None
    alerts: list[str] = field(default_factory=list)


def _active() -> dict[str, int]:
    from config.celery import app

    replies = app.control.inspect(timeout=INSPECT_TIMEOUT_S).active() or {}
    return {name: len(tasks or []) for name, tasks in sorted(replies.items())}


def online_workers() -> dict[str, int] | None:
    """Broadcast in a thread and wait at most a little longer than its own timeout: with the
    broker away, kombu's connect can retry past any timeout of the broadcast itself."""
    future = _pool.submit(_active)
    try:
        return future.result(timeout=INSPECT_TIMEOUT_S + 1.5)
    except Exception as exc:  # the broker away, or the broadcast still stuck connecting
        log.warning("console: no answer to the workers' broadcast: %s", exc)
        return None


def queue_depths() -> dict[str, int] | None:
    from config.celery import app

    names = sorted(app.amqp.queues.keys()) or [app.conf.task_default_queue]
    try:
        client = redis.Redis.from_url(app.conf.broker_url, socket_connect_timeout=REDIS_TIMEOUT_S,
                                      socket_timeout=REDIS_TIMEOUT_S, retry=Retry(NoBackoff(), 0))
        pipe = client.pipeline(transaction=False)
        for name in names:
            for suffix in PRIORITY_SUFFIXES:
                pipe.llen(name + suffix)
        lengths = pipe.execute()
        client.close()
    except redis.RedisError as exc:
        log.warning("console: queue depths unreadable: %s", exc)
        return None
    step = len(PRIORITY_SUFFIXES)
    return {name: sum(lengths[i * step:(i + 1) * step]) for i, name in enumerate(names)}


def last_sweep() -> dict | None:
    try:
        raw = shared_redis.admission_client().get(batch_actions.LAST_SWEEP_KEY)
    except redis.RedisError:
        return None
    return json.loads(raw) if raw else None


def running_by_host() -> dict[str, int]:
    """A run's claim is `host:pid:run`: the host and process that hold the item now."""
    claims = BatchItem.objects.filter(state=BatchItem.State.RUNNING).values_list("claim", flat=True)
    return dict(Counter(":".join(claim.split(":")[:2]) for claim in claims if claim))


def read() -> Workers:
    state = Workers(online=online_workers(), queues=queue_depths(), running_by_host=running_by_host(),
                    queued_items=BatchItem.objects.filter(state=BatchItem.State.QUEUED,
                                                          batch__status=Batch.Status.IN_PROGRESS).count(),
                    last_sweep=last_sweep())
    if state.queues is None:
        state.alerts.append("Redis (the broker) does not answer: no queue depth, and no worker can get new items.")
    if not state.online and state.queued_items:
        state.alerts.append(f"No worker answers while {state.queued_items} batch items are queued: start a worker "
                            "(make run starts one; `celery -A config worker`).")
    return state
