"""Operator endpoints: the engine's live state as JSON, and Prometheus metrics.

    GET /api/v1/engine/stats   staff session, or Authorization: Bearer <OPERATOR_API_TOKEN>
    GET /metrics               Bearer <METRICS_TOKEN> (or the operators'); open from loopback
                               only where METRICS_ALLOW_LOOPBACK (not in production)
"""
from __future__ import annotations

import functools

import redis

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt

from inference import fleet, heap, http_metrics
from inference.host import EngineUnavailable, host
from inference.service_tokens import is_metrics_token, is_operator_token
from tenants import errors, quota
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


def _json_error(error: ApiError) -> JsonResponse:
    response = JsonResponse(error.body(), status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    return response


def _refusal(request: HttpRequest, token: str) -> JsonResponse:
    if request.META.get("HTTP_AUTHORIZATION"):
        error = ApiError(403, "This token may not read operator endpoints.", type="permission_error", code="forbidden")
    else:
        error = ApiError(401, f"This endpoint needs 'Authorization: Bearer <{token}>'.",
                         code="unauthenticated", headers={"WWW-Authenticate": "Bearer"})
    return _json_error(error)


def _operators_only(view):
    """A staff session or the operator token; csrf_exempt since these views only read
    (_get_only), so a POST gets 405 rather than a CSRF page."""
    @csrf_exempt
    @never_cache
    @_get_only
    @functools.wraps(view)
    def wrapped(request: HttpRequest) -> HttpResponse:
        if not ((request.user.is_authenticated and request.user.is_staff)
                or is_operator_token(request.META.get("HTTP_AUTHORIZATION"))):
            return _refusal(request, "OPERATOR_API_TOKEN")
        return view(request)
    return wrapped


@_operators_only
def engine_stats(request: HttpRequest) -> JsonResponse:
    return JsonResponse(fleet.local_stats())


@_operators_only
def engine_fleet(request: HttpRequest) -> JsonResponse:
    """Every replica's last report and their totals (inference.fleet)."""
    try:
        reports = fleet.replicas()
    except redis.RedisError as exc:
        return _json_error(errors.limits_unavailable(exc))
    return JsonResponse({"replicas": reports, "totals": fleet.totals(reports)})


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
             b"# TYPE llm_limits_fallbacks_total counter\n" + f"llm_limits_fallbacks_total {breaker.trips}\n".encode()
             + heap.render() + http_metrics.render())
    return HttpResponse(body, content_type="text/plain; version=0.0.4; charset=utf-8")
