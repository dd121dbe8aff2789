"""Operator endpoints: the engine's live state as JSON, and Prometheus metrics.

    GET /api/v1/engine/stats   staff session, or Authorization: Bearer <OPERATOR_API_TOKEN>
    GET /metrics               Bearer <METRICS_TOKEN> (or the operators'); open from loopback
                               only where METRICS_ALLOW_LOOPBACK (not in production)
"""
from __future__ import annotations

import dataclasses
import functools

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt

from config.daphne_hooks import stream_buffers
from inference.host import EngineUnavailable, host
from inference.service_tokens import is_metrics_token, is_operator_token
from tenants import quota
from tenants.errors import ApiError

LOOPBACK = ("127.0.0.1", "::1")


def _get_only(view):
    """Django's require_GET, answering in the OpenAI error shape like the rest of the API."""
    @functools.wraps(view)
    def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if request.method != "GET":
            error = ApiError(405, f"Method {request.method} not allowed; use GET.", code="method_not_allowed")
            response = JsonResponse(error.body(), status=405)
            response["Allow"] = "GET"
            return response
        return view(request, *args, **kwargs)
    return wrapped


def _is_loopback(request: HttpRequest) -> bool:
    # Behind a proxy on the same host every request arrives from loopback, and not every proxy
    # adds X-Forwarded-For: so loopback is trusted only where a setting says so.
    return (settings.METRICS_ALLOW_LOOPBACK and request.META.get("REMOTE_ADDR") in LOOPBACK
            and "HTTP_X_FORWARDED_FOR" not in request.META)


def _refusal(request: HttpRequest, token: str) -> JsonResponse:
    if request.META.get("HTTP_AUTHORIZATION"):
        error = ApiError(403, "This token may not read operator endpoints.", type="permission_error", code="forbidden")
    else:
        error = ApiError(401, f"This endpoint needs 'Authorization: Bearer <{token}>'.",
                         code="unauthenticated", headers={"WWW-Authenticate": "Bearer"})
    response = JsonResponse(error.body(), status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    return response


def engine_stats_payload() -> dict:
    """The engine's state in the shape operators and the console read (GET /api/v1/engine/stats)."""
    state = host.state
    try:
        stats = host.engine().stats()
    except EngineUnavailable:
        return {"state": state, "ready": False, "error": host.error or None}
    lanes = {str(int(lane)): dataclasses.asdict(counts) for lane, counts in stats.lanes.items()}
    return {
        "state": state,
        "ready": stats.ready,
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
        "step_errors": stats.step_errors,
        "restarts": stats.restarts,
        # Not the engine's, but what its streams cost this process: bytes their clients have
        # not taken, and clients disconnected for taking nothing (STREAM_STALL_S).
        "streams": stream_buffers(),
    }


# csrf_exempt: both views only read (_get_only), so a POST gets 405 rather than a CSRF page.
@csrf_exempt
@never_cache
@_get_only
def engine_stats(request: HttpRequest) -> JsonResponse:
    if not ((request.user.is_authenticated and request.user.is_staff)
            or is_operator_token(request.META.get("HTTP_AUTHORIZATION"))):
        return _refusal(request, "OPERATOR_API_TOKEN")
    return JsonResponse(engine_stats_payload())


@csrf_exempt
@never_cache
@_get_only
def metrics(request: HttpRequest) -> HttpResponse:
    if not (_is_loopback(request) or is_metrics_token(request.META.get("HTTP_AUTHORIZATION"))):
        return _refusal(request, "METRICS_TOKEN")
    try:
        body = host.engine().metrics.render()
        ready = 1
    except EngineUnavailable:
        body, ready = b"", 0
    breaker = quota.limiter().breaker
    body += (b"# HELP llm_engine_ready Whether this process's engine serves requests\n"
             b"# TYPE llm_engine_ready gauge\n" + f"llm_engine_ready {ready}\n".encode()
             + b"# HELP llm_limits_local Whether this process decides limits alone (Redis not answering)\n"
             b"# TYPE llm_limits_local gauge\n" + f"llm_limits_local {int(breaker.open)}\n".encode()
             + b"# HELP llm_limits_fallbacks_total Times this process began deciding limits alone\n"
             b"# TYPE llm_limits_fallbacks_total counter\n" + f"llm_limits_fallbacks_total {breaker.trips}\n".encode())
    return HttpResponse(body, content_type="text/plain; version=0.0.4; charset=utf-8")
