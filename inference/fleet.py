"""One fleet of replicas: each web process with an engine reports itself to Redis, and any
of them answers for all (GET /api/v1/engine/fleet).

A replica writes `fleet:replica:<id>` (its id, host, pid, url, state and the same stats as
/api/v1/engine/stats) every FLEET_HEARTBEAT_S with a TTL of three heartbeats, and keeps its
id in the `fleet:replicas` set. A replica that dies stops writing, so its entry expires: it
leaves the fleet within three heartbeats. One that stops cleanly deletes its entry at once.
Redis away: the heartbeat logs once and keeps trying; the fleet view answers 503.

Each beat also reports the process's open usage rows and their tokens so far
(`fleet:progress:<instance>`), and every SWEEP_EVERY_BEATS beats the heartbeat thread
completes the rows of processes that left the fleet without closing them (inference.sweep).
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from numbers import Number

import redis
from django import db
from django.conf import settings

from config import redis as shared_redis
from config.daphne_hooks import stream_buffers
from inference import drain
from inference.host import EngineUnavailable, host

log = logging.getLogger(__name__)

MEMBERS = "fleet:replicas"
MISSED_BEATS = 3  # an entry lives this many heartbeats unless renewed
SWEEP_EVERY_BEATS = 5  # how often a replica looks for usage rows of dead ones (inference.sweep)
PROGRESS_TTL_MS = 24 * 3600 * 1000  # a dead replica's last progress report waits this long for a sweep


def local_stats() -> dict:
    """This replica's engine in the shape operators, the console and the fleet read
    (GET /api/v1/engine/stats)."""
    state = "draining" if drain.draining() else host.state
    try:
        stats = host.engine().stats()
    except EngineUnavailable:
        return {"state": state, "ready": False, "error": host.error or None}
    lanes = {str(int(lane)): dataclasses.asdict(counts) for lane, counts in stats.lanes.items()}
    return {
        "state": state,
        "ready": stats.ready,
        # An engine several web processes share (INFERENCE_ENGINE_SOCKET) has one id in each
        # one's report; null: this process's own.
        "engine": getattr(host.engine(), "engine_id", None),
        "kv_blocks_total": stats.blocks_total,
        "kv_blocks_free": stats.blocks_free,
        "kv_blocks_cached": stats.blocks_cached,
        "kv_blocks_used": stats.blocks_used,
        "kv_block_size": stats.block_size,
        "swap_blocks_total": stats.swap_blocks_total,
        "swap_blocks_used": stats.swap_blocks_used,
        "requests_running": stats.running,
        "requests_swapped": stats.swapped,
        "requests_paused": stats.paused,
        "requests_waiting": {lane: counts["waiting"] for lane, counts in lanes.items()},
        "lanes": lanes,
        "requests_in_flight": stats.in_flight,
        "preemptions": stats.preemptions,
        "preemptions_by_mode": {"recompute": stats.preemptions_recompute, "swap": stats.preemptions_swap},
        "tokens_per_s": stats.tokens_per_s,
        "steps": stats.steps,
        "prompt_tokens": stats.prompt_tokens,
        "computed_tokens": stats.computed_tokens,
        "prefix_hit_tokens": stats.prefix_hit_tokens,
        "generated_tokens": stats.generated_tokens,
        "finished_requests": stats.finished_requests,
        "aborted_requests": stats.aborted_requests,
        "speculative": {"passes": stats.spec_passes, "draft_tokens": stats.spec_draft_tokens,
                        "accepted_tokens": stats.spec_accepted_tokens, "acceptance_rate": stats.spec_acceptance_rate,
                        "tokens_per_pass": stats.spec_tokens_per_pass},
        "step_errors": stats.step_errors,
        "restarts": stats.restarts,
        # Not the engine's, but what its streams cost this process: bytes their clients have
        # not taken, and clients disconnected for taking nothing (STREAM_STALL_S).
        "streams": stream_buffers(),
    }


def _entry_key(replica_id: str) -> str:
    return f"fleet:replica:{replica_id}"


def progress_key(instance: str) -> str:
    """Where a replica process reports its open usage rows' tokens so far (inference.sweep)."""
    return f"fleet:progress:{instance}"


def replica_id() -> str:
    """REPLICA_ID, else this host and process (unique while the process lives)."""
    return settings.REPLICA_ID or f"{socket.gethostname()}-{os.getpid()}"


class Heartbeat:
    """Reports `report()` (this replica's stats) to Redis every `period_s`, from a thread."""

    def __init__(self, report: Callable[[], dict], period_s: float, ident: str | None = None,
                 url: str | None = None, client: Callable[[], redis.Redis] = shared_redis.client,
                 progress: Callable[[], dict[str, str]] = dict,
                 sweep: Callable[[redis.Redis], object] | None = None) -> None:
        self.report, self.period_s, self.progress, self.sweep = report, period_s, progress, sweep
        self.id = ident or replica_id()
        # This process, as its usage rows name it: a replica restarted under the same id is
        # another instance, whose predecessor's open rows the sweep completes.
        self.instance = f"{self.id}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.url = url if url is not None else settings.REPLICA_URL
        self._client = client
        self._stop = threading.Event()
        # Held around each write to Redis: stop() takes it to remove the entry, so a beat whose
        # report or sweep outlasted stop()'s join cannot write the entry back after the removal
        # (the drain test saw a drained replica listed for three more beats).
        self._writing = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fleet-heartbeat", daemon=True)
            self._thread.start()

    def beat(self) -> None:
        """One report, now (raises RedisError)."""
        stats = self.report()
        entry = {"id": self.id, "instance": self.instance, "host": socket.gethostname(), "pid": os.getpid(),
                 "url": self.url, "state": stats.get("state", "unknown"), "last_seen": time.time(), "stats": stats}
        progress = self.progress()
        client = self._client()
        pipe = client.pipeline()
        pipe.set(_entry_key(self.id), json.dumps(entry), px=round(self.period_s * MISSED_BEATS * 1000))
        pipe.sadd(MEMBERS, self.id)
        pipe.delete(progress_key(self.instance))
        if progress:
            pipe.hset(progress_key(self.instance), mapping=progress)
            pipe.pexpire(progress_key(self.instance), PROGRESS_TTL_MS)
        with self._writing:
            if self._stop.is_set():  # the replica left while this beat gathered its report
                return
            pipe.execute()

    def _run(self) -> None:
        beats = 0
        while not self._stop.is_set():
            try:
                self.beat()
            except Exception as exc:  # Redis away, or a report that failed: try again next beat
                if not self._failing:
                    log.warning("fleet heartbeat of %s failed: %s", self.id, exc)
                self._failing = True
            else:
                if self._failing:
                    log.info("fleet heartbeat of %s is back", self.id)
                self._failing = False
                beats += 1
                if self.sweep is not None and beats % SWEEP_EVERY_BEATS == 0:
                    try:
                        self.sweep(self._client())
                    except Exception:  # the database or Redis away: the next pass tries again
                        log.exception("usage sweep of %s failed", self.id)
                    finally:
                        db.connections.close_all()  # this thread's own: each pass connects anew
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        """Stop reporting and leave the fleet at once (a clean exit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.period_s + 1)
        with self._writing:  # a beat past its check has written; any later one writes nothing
            try:
                client = self._client()
                client.delete(_entry_key(self.id), progress_key(self.instance))
                client.srem(MEMBERS, self.id)
            except redis.RedisError as exc:  # it expires by itself
                log.warning("replica %s could not leave the fleet: %s", self.id, exc)


def instance() -> str:
    """This process's instance in the fleet ("" until it joins: its usage rows are then never swept)."""
    return _heartbeat.instance if _heartbeat is not None else ""


def replicas(client: redis.Redis | None = None) -> list[dict]:
    """Every live replica's last report, by id; ids whose entries expired are dropped."""
    client = client or shared_redis.client()
    ids = sorted(member.decode() for member in client.smembers(MEMBERS))
    if not ids:
        return []
    found = client.mget([_entry_key(i) for i in ids])
    gone = [i for i, raw in zip(ids, found) if raw is None]
    if gone:
        client.srem(MEMBERS, *gone)
    return [json.loads(raw) for raw in found if raw is not None]


def _add(total: dict, stats: dict) -> None:
    for name, value in stats.items():
        if isinstance(value, bool) or name in ("state", "error", "kv_block_size"):
            continue
        if isinstance(value, Number):
            total[name] = total.get(name, 0) + value
        elif isinstance(value, dict):
            _add(total.setdefault(name, {}), value)


# What each web process reports of its own even where it shares its engine with others.
OWN_NUMBERS = ("requests_in_flight", "streams")


def totals(reports: list[dict]) -> dict:
    """The numbers of every replica's stats summed (lanes and the like key by key), with how
    many replicas there are, how many are ready, and how many engines serve them: an engine
    that several replicas share is counted once."""
    total: dict = {"replicas": len(reports), "replicas_ready": sum(1 for r in reports if r["stats"].get("ready"))}
    shared: set[str] = set()
    engines = 0
    for report in reports:
        stats, engine = report["stats"], report["stats"].get("engine")
        if engine in shared:
            stats = {name: value for name, value in stats.items() if name in OWN_NUMBERS}
        else:
            engines += 1
            if engine is not None:
                shared.add(engine)
        _add(total, stats)
    total["engines"] = engines
    return total


_heartbeat: Heartbeat | None = None
_heartbeat_lock = threading.Lock()


def join() -> None:
    """Start this process's heartbeat (once; the server calls it when it starts serving)."""
    global _heartbeat
    if _heartbeat is not None:
        return
    from inference import billing, sweep  # both read this module

    with _heartbeat_lock:
        if _heartbeat is None:
            heartbeat = Heartbeat(local_stats, settings.FLEET_HEARTBEAT_S, progress=billing.open_rows_progress)
            heartbeat.sweep = sweep.Sweeper(heartbeat.instance, settings.FLEET_HEARTBEAT_S)
            _heartbeat = heartbeat
            _heartbeat.start()
            atexit.register(_heartbeat.stop)  # daphne sends no lifespan shutdown; SIGTERM exits


def leave() -> None:
    """Stop reporting and leave the fleet now (blocks up to a beat): a drained replica leaves
    before it stops listening, so no balancer reads it listed after it is gone. atexit's
    later call finds nothing left to remove."""
    if _heartbeat is not None:
        _heartbeat.stop()
