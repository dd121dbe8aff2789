"""API errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Every refusal carries its HTTP status and the headers a client needs to retry well
(`Retry-After`, `x-ratelimit-*`). DRF views and Channels consumers render the same
`ApiError`, so a key or a limit is refused identically on every path.
"""
import logging
import math
from typing import Any

import redis
from django import db
from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response

from tenants.limits import Decision

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_api_key(message: str = "Incorrect API key provided.") -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def missing_api_key() -> ApiError:
    return ApiError(
        401,
        "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...'.",
        code="missing_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


# What Retry-After says for a wait that has no end (a cost above its limit, which a
# client learns from the message): an hour, which is at least not a busy loop.
NO_END_RETRY_S = 3600


def format_reset(seconds: float) -> str:
    """OpenAI's reset format: `120ms`, `1s`, `6m0s`, `1h2m3s`."""
    if not math.isfinite(seconds):
        seconds = NO_END_RETRY_S
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rate_limit_headers(decision: Decision) -> dict[str, str]:
    """`x-ratelimit-{limit,remaining,reset}-{requests,tokens}` for the buckets checked."""
    headers: dict[str, str] = {}
    for name in ("requests", "tokens"):
        bucket = decision.bucket(name)
        if bucket is not None:
            headers[f"x-ratelimit-limit-{name}"] = str(bucket.limit)
            headers[f"x-ratelimit-remaining-{name}"] = str(bucket.remaining)
            headers[f"x-ratelimit-reset-{name}"] = format_reset(bucket.reset_s)
    return headers


def retry_after(seconds: float) -> str:
    """Whole seconds, rounded up: retrying at that instant is never too early."""
    if not math.isfinite(seconds):
        return str(NO_END_RETRY_S)
    return str(max(1, math.ceil(seconds)))


_RATE_LIMIT_MESSAGES = {
    "requests": "Rate limit reached for requests per minute: limit {limit}. Try again in {wait}.",
    "tokens": "Rate limit reached for tokens per minute: limit {limit}, remaining {remaining}. Try again in {wait}.",
    "streams": "Too many concurrent generations (each choice of a request is one): limit {limit}. "
               "Try again in {wait}, or when one of yours ends.",
    "sockets": "Too many open WebSockets for this API key (WS_MAX_SOCKETS_PER_KEY): limit {limit}. "
               "Close one, or try again in {wait}.",
}


def rate_limited(decision: Decision) -> ApiError:
    """429 for a refused rate or concurrency check, naming the limit and when to retry."""
    bucket = decision.refused_by
    if bucket is None:
        raise ValueError("rate_limited() needs a refused decision")
    message = _RATE_LIMIT_MESSAGES[bucket.kind].format(
        limit=bucket.limit, remaining=bucket.remaining, wait=format_reset(bucket.retry_after_s)
    )
    if bucket.of_key:
        message = "This API key's own limit: " + message[0].lower() + message[1:]
    return ApiError(
        429,
        message,
        type=bucket.kind,
        code="rate_limit_exceeded",
        headers={"Retry-After": retry_after(bucket.retry_after_s), **rate_limit_headers(decision)},
    )


def slot_queue_full(limit: int, waiting: int) -> ApiError:
    """429 without a wait: all of a tenant's generations run and SLOT_WAITERS_PER_TENANT of its
    requests already wait for one of them to end."""
    return ApiError(
        429,
        f"Too many concurrent generations (each choice of a request is one): limit {limit}, and {waiting} of "
        "your requests already wait for one to end. Try again in 1s, or when one of yours ends.",
        type="streams",
        code="rate_limit_exceeded",
        headers={"Retry-After": "1"},
    )


def quota_exhausted(budget: int, seconds_to_reset: float, of_key: bool = False) -> ApiError:
    whose = "This API key exceeded its own" if of_key else "You exceeded your"
    return ApiError(
        429,
        f"{whose} monthly token budget of {budget}. It resets at the start of next month (UTC).",
        type="insufficient_quota",
        code="insufficient_quota",
        headers={"Retry-After": retry_after(seconds_to_reset)},
    )


# How soon to retry when the rest of a budget is held by generations in flight: most end
# within seconds, and each one ending gives back what it did not use.
BUDGET_HELD_RETRY_S = 2


def budget_held(budget: int, used: int, reserved: int, of_key: bool = False) -> ApiError:
    whose = "This API key's own" if of_key else "Your"
    return ApiError(
        429,
        f"{whose} monthly token budget of {budget} has {max(0, budget - used)} tokens left, all of them reserved by "
        f"your requests in flight ({reserved} tokens at most). Try again when one of them ends.",
        type="insufficient_quota",
        code="budget_reserved",
        headers={"Retry-After": str(BUDGET_HELD_RETRY_S)},
    )


def limits_unavailable(exc: Exception) -> ApiError:
    """Limits cannot be checked: refuse rather than serve unmetered traffic."""
    log.error("rate-limit store unavailable: %s", exc)
    return ApiError(
        503, "The service is temporarily unavailable.", type="server_error", code="service_unavailable",
        headers={"Retry-After": "1"},
    )


def database_unavailable(exc: Exception) -> ApiError:
    """The database refused or failed a read the request needs (locked, gone, restarting)."""
    log.error("database unavailable on a tenant path: %s: %s", type(exc).__name__, exc)
    return ApiError(
        503, "The service is temporarily unavailable.", type="server_error", code="service_unavailable",
        headers={"Retry-After": "2"},
    )


def dependency_timeout(what: str, seconds: float) -> ApiError:
    """Admission waited `seconds` on the database or Redis: answer rather than hang."""
    log.error("%s took over %.1f s; answering 503", what, seconds)
    return ApiError(
        503, "The service is temporarily unavailable.", type="server_error", code="service_unavailable",
        headers={"Retry-After": "2"},
    )


def as_response(error: ApiError) -> Response:
    return Response(error.body(), status=error.status, headers=error.headers)


def openai_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's exception handler, rendering every API error in the OpenAI shape."""
    if isinstance(exc, ApiError):
        return as_response(exc)
    if isinstance(exc, drf_exceptions.NotAuthenticated):
        return as_response(missing_api_key())
    if isinstance(exc, drf_exceptions.AuthenticationFailed):
        return as_response(invalid_api_key(str(exc.detail)))
    if isinstance(exc, drf_exceptions.APIException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        code = exc.get_codes() if isinstance(exc.get_codes(), str) else exc.default_code
        return as_response(ApiError(exc.status_code, message, code=code))
    if isinstance(exc, redis.RedisError):
        return as_response(limits_unavailable(exc))
    if isinstance(exc, db.Error):
        return as_response(database_unavailable(exc))
    return None


def missing_scope(scope: str) -> ApiError:
    """403 for a key whose scopes leave out what the endpoint needs; `code` names the scope."""
    return ApiError(
        403,
        f"This API key lacks the '{scope}' scope this endpoint needs. Use a key with it, or ask an owner of the "
        "organization to add it.",
        type="permission_error",
        code=f"missing_scope_{scope}",
    )
