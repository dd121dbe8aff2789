"""Prometheus metrics of the web process: responses, refusals, batch items, Celery queues, the usage outbox.

| name | type | labels | meaning |
|---|---|---|---|
| `llm_http_responses_total` | counter | endpoint, status, tenant | HTTP responses, and WebSocket handshakes (101 accepted, 403 refused) |
| `llm_rate_limited_total` | counter | kind | 429s, HTTP and WebSocket, by the limit that refused |
| `llm_batch_items` | gauge | state | batch items in the database by state (every replica reports the same) |
| `llm_celery_queue_length` | gauge | queue | messages waiting in the broker's list of each Celery queue (the same) |
| `llm_usage_outbox_pending` | gauge | | usage entries this process journaled that the database has not taken yet |
| `llm_usage_dead_letters` | gauge | | usage entries in the outbox folder's dead-letter file: refused for a day, unbilled until `manage.py replay_usage_dead_letters` |

`endpoint` is the route pattern that served the request (`v1/batches/<str:batch_id>`), or
`unmatched`: never the raw path, whose ids would make a series per request. `tenant` is the
tenant id once a key authenticated (`none` before: a 401, an anonymous probe, a WebSocket
that sends its key in its first message). Refusal kinds: `requests`, `tokens`, `streams`,
`sockets`, `budget` (the monthly budget, spent or reserved), `lane` (the engine's lane is
full), `uploads` (uploads in progress), `other`.

Who labels what: `ResponseMetrics`, the outermost ASGI layer, puts a `Seen` in the scope and
counts each response as its status goes out. The layers below fill the `Seen` in:
`labelled_routes` for the Channels routes, `route_labels` (Django middleware) for Django's,
`note_tenant` where a key or a service token names the tenant. An HTTP 429's kind is read from
its body, which every path writes in the OpenAI error shape; a WebSocket's refusals are frames
on an open socket, so the consumer counts them (`count_refusal`). What is answered before the
application sees the request is counted where it is answered (`count_response`): uploads the
upload gate refuses, the flood gate's refusals, and bodies over the limit (config.daphne_hooks).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from inspect import iscoroutinefunction
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import Count
from django.urls import URLPattern
from django.utils.decorators import sync_and_async_middleware
from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily

from batches.models import BatchItem
from config import redis as shared_redis
from config.celery import app as celery_app
from inference import refusals
from tenants import ledger
from tenants.errors import ApiError
from tenants.models import ApiKey

log = logging.getLogger(__name__)

SCOPE_KEY = "llm_metrics"
UNMATCHED = "unmatched"
NO_TENANT = "none"
# Reading batch items and queue lengths costs a GROUP BY over the items table and a Redis call:
# once per this many seconds per process, however many scrapers and dashboards ask.
BACKLOG_CACHE_S = 10.0

disable_created_metrics()  # as the engine's registry does (inference/engine/metrics.py)
REGISTRY = CollectorRegistry()
RESPONSES = Counter("llm_http_responses", "HTTP responses and WebSocket handshakes",
                    ["endpoint", "status", "tenant"], registry=REGISTRY)
RATE_LIMITED = Counter("llm_rate_limited", "429 refusals by the limit that refused", ["kind"], registry=REGISTRY)
NAMED_BY_TYPE = ("requests", "tokens", "streams", "sockets")  # a rate limit's error type is its kind
LIMIT_KINDS = NAMED_BY_TYPE + ("budget", "lane", "uploads", "other")
for _kind in LIMIT_KINDS:
    RATE_LIMITED.labels(kind=_kind)  # export zeros, so rate() sees every kind from the start


class Seen:
    """What the layers below `ResponseMetrics` learn about one request."""

    __slots__ = ("endpoint", "tenant", "billed")

    def __init__(self) -> None:
        self.endpoint = UNMATCHED
        self.tenant = NO_TENANT
        self.billed = False  # a generation ran for it: its usage row shows it, whatever the status


def note_tenant(scope: dict, tenant_id: str) -> None:
    seen = scope.get(SCOPE_KEY)
    if seen is not None:
        seen.tenant = tenant_id


def note_billed(scope: dict) -> None:
    """The request has a usage row: an error it ends with is not also a refusal (inference.refusals)."""
    seen = scope.get(SCOPE_KEY)
    if seen is not None:
        seen.billed = True


def limit_kind(type_: str | None, code: str | None) -> str:
    """The limit a 429 names, from its error's `type` and `code` (tenants.errors)."""
    if type_ == "insufficient_quota":
        return "budget"
    if code == "lane_full":
        return "lane"
    if code == "too_many_uploads":
        return "uploads"
    return type_ if type_ in NAMED_BY_TYPE else "other"


def count_refusal(error: ApiError) -> None:
    """A refusal sent where no HTTP status passes `ResponseMetrics`."""
    if error.status == 429:
        RATE_LIMITED.labels(kind=limit_kind(error.type, error.code)).inc()


def count_response(endpoint: str, status: int, tenant_id: str | None) -> None:
    """A response written to the socket before the application saw the request."""
    RESPONSES.labels(endpoint=endpoint, status=str(status), tenant=tenant_id or NO_TENANT).inc()


def endpoint_of_path(path: str) -> str:
    """The `endpoint` label of a request answered before any application saw it: the pattern of
    the route that would have served it (a streaming route's or Django's), else `unmatched`."""
    from django.urls import Resolver404, resolve

    from inference.routing import http_routes

    bare = path.split("?", 1)[0]
    for route in http_routes:
        if route.pattern.match(bare.lstrip("/")):
            return str(route.pattern)
    try:
        return resolve(bare).route or UNMATCHED
    except Resolver404:
        return UNMATCHED


def _count_429_body(body: bytes) -> None:
    try:
        error = json.loads(body)["error"]
        kind = limit_kind(error.get("type"), error.get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        kind = "other"
    RATE_LIMITED.labels(kind=kind).inc()


class ResponseMetrics:
    """ASGI: counts each HTTP response when its status goes out, each WebSocket handshake when it
    is answered, and a 500 for a request whose application raised before either. An error
    answered on a tenant-facing path to a request without a usage row is kept for the console's
    requests tail (inference.refusals)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        seen = Seen()
        answered = False
        error_status = 0  # of an HTTP error answer whose body comes next
        started = time.monotonic()
        watched = scope["type"] == "http" and refusals.tenant_facing(scope.get("path", ""))

        def count(status: int) -> None:
            nonlocal answered
            answered = True
            RESPONSES.labels(endpoint=seen.endpoint, status=str(status), tenant=seen.tenant).inc()

        def refused(status: int, body: bytes) -> None:
            if not seen.billed:
                refusals.note(tenant_id=seen.tenant, key=refusals.key_prefix(_authorization(scope)),
                              endpoint=scope["path"], status=status, body=body, started=started)

        async def observed(message: dict) -> None:
            nonlocal error_status
            kind = message["type"]
            if kind == "http.response.start":
                count(message["status"])
                error_status = message["status"] if message["status"] >= 400 else 0
            elif kind == "http.response.body" and error_status:
                # Every error writes its small JSON body in one message.
                body, status, error_status = message.get("body", b""), error_status, 0
                if status == 429:
                    _count_429_body(body)
                if watched:
                    refused(status, body)
            elif not answered and kind in ("websocket.accept", "websocket.close"):
                count(101 if kind == "websocket.accept" else 403)
            await send(message)

        try:
            await self.app({**scope, SCOPE_KEY: seen}, receive, observed)
        except Exception:
            if not answered:
                count(500)
                if watched:
                    refused(500, b"")
            raise


def _authorization(scope: dict) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == b"authorization":
            return value.decode("latin-1")
    return None


class _Named:
    """Names the Channels route in front of `app` for `ResponseMetrics`."""

    def __init__(self, endpoint: str, app: Any) -> None:
        self.endpoint = endpoint
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        seen = scope.get(SCOPE_KEY)
        if seen is not None:
            seen.endpoint = self.endpoint
        return await self.app(scope, receive, send)


def labelled_routes(routes: list[URLPattern]) -> list[URLPattern]:
    """Channels routes whose requests are counted under their route pattern."""
    return [URLPattern(r.pattern, _Named(str(r.pattern), r.callback), r.default_args, r.name) for r in routes]


def _label_django_request(request: Any) -> None:
    seen = getattr(request, "scope", {}).get(SCOPE_KEY)
    if seen is None:  # not served over ASGI (Django's test client)
        return
    if request.resolver_match is not None:
        seen.endpoint = request.resolver_match.route
    auth = getattr(request, "auth", None)  # DRF's authentication leaves the ApiKey here
    if isinstance(auth, ApiKey):
        seen.tenant = str(auth.tenant_id)


@sync_and_async_middleware
def route_labels(get_response):
    """Django middleware: the route pattern and the key's tenant of what Django served. Async
    where the handler is, so it adds no thread hop to an async view."""
    if iscoroutinefunction(get_response):
        async def middleware(request):
            response = await get_response(request)
            _label_django_request(request)
            return response
    else:
        def middleware(request):
            response = get_response(request)
            _label_django_request(request)
            return response
    return middleware


class _Backlog:
    """Batch items by state and Celery queue lengths, read at most every BACKLOG_CACHE_S. A
    source that fails is left out of that scrape (logged), never failing the others."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._families: list = []

    def describe(self) -> list:
        return []  # registering must not query the database

    def collect(self) -> list:
        with self._lock:
            if time.monotonic() - self._read_at >= BACKLOG_CACHE_S:
                self._families = [f for f in (self._batch_items(), self._queue_lengths()) if f is not None]
                self._read_at = time.monotonic()
            return self._families

    @staticmethod
    def _batch_items() -> GaugeMetricFamily | None:
        try:
            counts = dict(BatchItem.objects.order_by().values_list("state").annotate(n=Count("pk")))
        except Exception as exc:
            log.warning("metrics: batch items unreadable: %s: %s", type(exc).__name__, exc)
            return None
        family = GaugeMetricFamily("llm_batch_items", "Batch items by state", labels=["state"])
        for state in BatchItem.State.values:
            family.add_metric([state], counts.get(state, 0))
        return family

    @staticmethod
    def _queue_lengths() -> GaugeMetricFamily | None:
        queues = sorted(celery_app.amqp.queues)
        try:
            # The broker is REDIS_URL (config.settings); a message sent without a priority, as every
            # one of ours is, waits in the list named after its queue (Celery's monitoring guide).
            # The short-deadline client: a scrape must not wait on a Redis that does not answer.
            with shared_redis.admission_client().pipeline(transaction=False) as pipe:
                for queue in queues:
                    pipe.llen(queue)
                lengths = pipe.execute()
        except Exception as exc:
            log.warning("metrics: Celery queue lengths unreadable: %s: %s", type(exc).__name__, exc)
            return None
        family = GaugeMetricFamily("llm_celery_queue_length", "Messages waiting in each Celery queue", labels=["queue"])
        for queue, length in zip(queues, lengths):
            family.add_metric([queue], length)
        return family


REGISTRY.register(_Backlog())


class _UsageOutbox:
    """The usage ledger's backlog (tenants.ledger), read at every scrape: an alert on dead
    letters is an alert on tokens served and not billed."""

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        pending = GaugeMetricFamily("llm_usage_outbox_pending", "Usage entries journaled here and not yet in the database")
        pending.add_metric([], ledger.pending())
        dead = GaugeMetricFamily("llm_usage_dead_letters", "Usage entries refused for a day, waiting in the dead-letter file")
        dead.add_metric([], ledger.dead_letters(Path(settings.USAGE_OUTBOX_DIR)))
        return [pending, dead]


REGISTRY.register(_UsageOutbox())


def render() -> bytes:
    """Prometheus text for /metrics."""
    return generate_latest(REGISTRY)
