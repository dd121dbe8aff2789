"""What a Celery worker does with a batch item: claim it, send it to an engine replica's
internal endpoint in lane P2, store the one result, and keep the batch moving.

The worker runs tasks on a thread pool. Each task thread owns its database connection
and polls: every `POLL_S` it checks that its item is still wanted (not cancelled, not
expired, not given to another run) and, now and then, renews its heartbeat. The HTTP
calls of all threads run on one event loop in a background thread of the process, so a
task can cancel its call from its own thread; the engine sees the connection close and
aborts the request at once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import httpx2 as httpx
from django.conf import settings
from django.db import close_old_connections

from batches import actions
from batches.models import Batch, BatchItem
from inference import public_errors

log = logging.getLogger(__name__)

POLL_S = 0.5
INTERNAL_PATHS = {"/v1/chat/completions": "/internal/v1/chat/completions", "/v1/completions": "/internal/v1/completions"}

# Set when the worker begins a warm shutdown (SIGTERM): running items are handed back at
# once, so a restarted or another worker resumes them without waiting for any timeout.
shutting_down = threading.Event()


class _Loop:
    """One event loop thread per process for the HTTP calls of every task thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="batch-http", daemon=True).start()
        self.client = self.run(self._make_client()).result()

    @staticmethod
    async def _make_client() -> httpx.AsyncClient:
        timeout = httpx.Timeout(settings.BATCH_REQUEST_TIMEOUT_S, connect=10.0)
        return httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))

    def run(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)


_http_lock = threading.Lock()
_http_loop: _Loop | None = None


def _http() -> _Loop:
    global _http_loop
    with _http_lock:  # the first tasks of a worker start together
        if _http_loop is None:
            _http_loop = _Loop()
        return _http_loop


@dataclass(frozen=True)
class Answer:
    status_code: int
    request_id: str
    body: dict
    retry_after_s: float | None


async def _post(client: httpx.AsyncClient, item: BatchItem, request_id: str) -> Answer:
    url = settings.BATCH_ENGINE_URL.rstrip("/") + INTERNAL_PATHS[item.url]
    # The item and its attempt make the engine's usage row one per item (tenants.actions.apply_usage).
    headers = {"Authorization": f"Bearer {settings.BATCH_WORKER_TOKEN}", "X-Tenant-Id": str(item.batch.tenant_id),
               "X-Request-Id": request_id, "X-Batch-Item": str(item.pk), "X-Batch-Attempt": str(item.runs),
               "X-Batch-Id": item.batch_id}
    if item.batch.api_key_id is not None:  # its budget holds the request, and its revocation refuses it
        headers["X-Api-Key-Id"] = str(item.batch.api_key_id)
    response = await client.post(url, json=item.body, headers=headers)
    try:
        body = public_errors.response_body(response.json(), response.status_code)
    except ValueError:  # a balancer's or proxy's page, never shown to the tenant
        log.warning("engine endpoint answered %d with a non-JSON body: %.200r", response.status_code, response.text)
        body = {"error": public_errors.upstream_error(response.status_code)}
    retry_after = response.headers.get("retry-after")
    return Answer(response.status_code, response.headers.get("x-request-id", request_id), body,
                  float(retry_after) if retry_after and retry_after.isdigit() else None)


def _error_code(answer: Answer) -> str | None:
    error = answer.body.get("error") if isinstance(answer.body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def run_item(item_id: int) -> str:
    """One delivery of one item; returns what happened (for logs and tests)."""
    close_old_connections()
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
    item = actions.claim(item_id, token)
    if item is None:
        return "skipped"
    request_id = f"batchreq-{item.batch_id.removeprefix('batch_')}-{item.line}-{item.attempts}"
    http = _http()
    call = http.run(_post(http.client, item, request_id))
    try:
        outcome = _wait(item, token, call)
    except BaseException:
        call.cancel()
        actions.release(item, token, actions.backoff_s(item.attempts), counted=False)
        raise
    return outcome


def _wait(item: BatchItem, token: str, call: concurrent.futures.Future) -> str:
    beat_every = max(POLL_S, settings.BATCH_ITEM_LEASE_S / 4)
    last_beat = time.monotonic()
    while True:
        try:
            answer = call.result(timeout=POLL_S)
        except concurrent.futures.TimeoutError:
            pass
        except httpx.ConnectError as exc:  # no replica answered: not the item's fault
            actions.release(item, token, actions.backoff_s(item.attempts), counted=False, error=_transport_error(exc))
            return "engine-unreachable"
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            actions.release(item, token, actions.backoff_s(item.attempts), counted=True, error=_transport_error(exc))
            return "transport-error"
        else:
            return _settle(item, token, answer)
        if shutting_down.is_set():
            call.cancel()
            actions.release(item, token, 0, counted=False)
            return "released-for-shutdown"
        if time.monotonic() - last_beat >= beat_every or _stopped(item, token):
            last_beat = time.monotonic()
            if not actions.heartbeat(item, token):
                call.cancel()  # the connection closes; the engine aborts the request
                actions.stop(item, token)
                return "stopped"


def _stopped(item: BatchItem, token: str) -> bool:
    """Cheap check between heartbeats: is the item's batch stopping?"""
    return Batch.objects.filter(pk=item.batch_id).exclude(stop_reason="").exists()


def _transport_error(exc: Exception) -> dict:
    log.warning("engine endpoint unreachable: %s: %s", type(exc).__name__, exc)
    return public_errors.transport_error(exc)


def _settle(item: BatchItem, token: str, answer: Answer) -> str:
    """Store a final answer, or put the item back for a later attempt."""
    code = _error_code(answer)
    if (answer.status_code, code) in ((429, "lane_full"), (429, "budget_reserved"), (404, "tenant_not_found")) \
            or answer.status_code == 503:
        # Engine back-pressure, the rest of a budget held by requests in flight (most of it comes
        # back as they end), the tenant deactivated (its items wait for it to be reactivated or
        # the batch to expire), or a platform dependency away: retry later, never drop.
        delay = max(answer.retry_after_s or 0, actions.backoff_s(1))
        actions.release(item, token, delay, counted=False, error=answer.body.get("error"))
        return "backpressure"
    if answer.status_code >= 500:
        actions.release(item, token, actions.backoff_s(item.attempts), counted=True, error=answer.body.get("error"))
        return "server-error"
    if code == "api_key_revoked":  # the batch stops now, not at the next sweep: this item with it
        actions.cancel(item.batch, "key_revoked")
        actions.stop(item, token)
        return "stopped"
    actions.finish(item, token, answer.status_code, answer.request_id, answer.body)
    log.info("batch %s: item line %d -> %d", item.batch_id, item.line, answer.status_code)
    return "finished"


# --- the sweep, on the worker's own schedule ------------------------------------------------


def start_sweeper(stop: threading.Event) -> threading.Thread:
    """Sweep every BATCH_SWEEP_INTERVAL_S until `stop` is set (see `actions.sweep`)."""

    def loop() -> None:
        while not stop.wait(settings.BATCH_SWEEP_INTERVAL_S):
            close_old_connections()
            try:
                report = actions.sweep()
            except Exception:
                log.exception("batch sweep failed; next pass in %.0f s", settings.BATCH_SWEEP_INTERVAL_S)
                continue
            if any(report.values()):
                log.info("batch sweep: %s", json.dumps(report))

    thread = threading.Thread(target=loop, name="batch-sweep", daemon=True)
    thread.start()
    return thread
