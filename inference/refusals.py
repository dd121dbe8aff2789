"""Refused API requests, kept for the console's requests tail.

An admitted generation leaves a usage row (tenants.ledger); a refused request (a bad key, a
limit, a bound, a dependency away) leaves none, yet an operator chasing a tenant's 429s expects
them beside its requests. Each refusal on a tenant-facing path is noted here on the event loop,
into a bounded buffer of this process; a thread moves the buffer into one capped Redis list
that every replica shares (the newest REFUSALS_KEPT), off the request path and under the
limits' short Redis deadline. A flood of refusals costs the event loop a small object and an
append each; past the buffer's bound the oldest unsent ones are dropped (and counted).

What is kept: the time, the tenant id once a key authenticated, the key's public prefix, the
path, the status, the error's type and code, its message cut to MESSAGE_CHARS, and how long the
answer took. Never a body, a prompt or a secret.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

from django.conf import settings

from config import redis as shared_redis
from tenants import keys
from tenants.authentication import bearer_token

log = logging.getLogger(__name__)

REDIS_KEY = "console:refusals"
BUFFER = 2000  # refusals waiting for the flusher; a burst past it loses its oldest
FLUSH_S = 0.5
MESSAGE_CHARS = 200
BODY_BYTES = 4096  # an error body longer than this is not read for its code
# The paths tenants call with their keys; the service endpoints (batch items' internal calls,
# which retry on 429 by design), probes, the console and the admin are left out.
TENANT_PATHS = ("/v1/", "/api/v1/inference/", "/ws/v1/", "/tokenize", "/detokenize")


@dataclass(frozen=True)
class Refusal:
    at: float  # Unix time of the answer
    tenant_id: int | None  # None when no key authenticated (a 401, a malformed request before it)
    key_prefix: str  # the presented key's public prefix, "" when none had a key's shape
    endpoint: str
    status: int
    type: str
    code: str
    message: str
    duration_ms: int | None
    replica: str

    refused = True  # the tail's rows: a usage row has no such attribute set

    def as_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Refusal | None:
        try:
            return cls(**json.loads(raw))
        except (ValueError, TypeError):
            return None


def tenant_facing(path: str) -> bool:
    return path.startswith(TENANT_PATHS)


def key_prefix(authorization: str | None) -> str:
    parsed = keys.parse(bearer_token(authorization) or "")
    return parsed.prefix if parsed else ""


def error_fields(body: bytes) -> tuple[str, str, str]:
    """(type, code, message) of an OpenAI-shaped error body; empty strings where it is not one."""
    if len(body) > BODY_BYTES:
        return "", "", ""
    try:
        error = json.loads(body)["error"]
        return (str(error.get("type") or ""), str(error.get("code") or ""),
                str(error.get("message") or "")[:MESSAGE_CHARS])
    except (ValueError, KeyError, TypeError, AttributeError):
        return "", "", ""


class _Outbox:
    """Refusals of this process on their way to Redis."""

    def __init__(self) -> None:
        self._entries: deque[Refusal] = deque(maxlen=BUFFER)
        self.dropped = 0
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failing = False

    def add(self, refusal: Refusal) -> None:
        if len(self._entries) == BUFFER:
            self.dropped += 1
        self._entries.append(refusal)
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="refusals", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(FLUSH_S)
            self.flush()

    def flush(self) -> None:
        batch = []
        while self._entries:
            try:
                batch.append(self._entries.popleft())
            except IndexError:
                break
        if not batch:
            return
        try:
            with shared_redis.admission_client().pipeline(transaction=False) as pipe:
                pipe.lpush(REDIS_KEY, *(r.as_json() for r in batch))  # oldest first: the newest ends at the head
                pipe.ltrim(REDIS_KEY, 0, settings.REFUSALS_KEPT - 1)
                pipe.execute()
        except Exception as exc:  # diagnostics, not billing: keep them for the next try, within the bound
            self._entries.extendleft(reversed(batch[-(BUFFER - len(self._entries)):]))
            if not self._failing:
                log.warning("refusals: cannot write to Redis (%s: %s); keeping up to %d here", type(exc).__name__,
                            exc, BUFFER)
            self._failing = True
            return
        self._failing = False


_outbox = _Outbox()


def note(*, tenant_id: str | int | None, key: str, endpoint: str, status: int, body: bytes = b"",
         error: dict | None = None, started: float | None = None) -> None:
    """Keep one refusal: its error from `body` (an HTTP response) or `error` (a WebSocket frame's,
    the OpenAI error object); `key` is the presented key's prefix (`key_prefix`)."""
    from inference import fleet  # reads the engine host's settings

    if error is not None:
        type_, code, message = (str(error.get("type") or ""), str(error.get("code") or ""),
                                str(error.get("message") or "")[:MESSAGE_CHARS])
    else:
        type_, code, message = error_fields(body)
    try:
        tenant = int(tenant_id) if tenant_id is not None else None
    except ValueError:  # "none": no key authenticated
        tenant = None
    _outbox.add(Refusal(
        at=time.time(), tenant_id=tenant, key_prefix=key[:32], endpoint=endpoint[:200], status=status,
        type=type_, code=code, message=message, replica=fleet.instance(),
        duration_ms=None if started is None else round((time.monotonic() - started) * 1000),
    ))


def flush() -> None:
    """Write what this process holds now (tests; the thread does it every FLUSH_S)."""
    _outbox.flush()


def newest(limit: int) -> list[Refusal]:
    """The newest refusals of every replica, newest first. Raises redis.RedisError."""
    raw = shared_redis.client().lrange(REDIS_KEY, 0, max(0, limit - 1))
    return [r for r in (Refusal.from_json(item) for item in raw) if r is not None]
