"""What a tenant may read of a failure that is not its own.

An engine that failed to load says why with the server's file paths; a load balancer in
front of an engine replica answers with an HTML page naming its software. Neither belongs
in an API error or a batch error file: tenants get a short, fixed description and a code,
operators the detail in the logs and on /api/v1/engine/stats.
"""
from __future__ import annotations

import re
from typing import Any

ENGINE_UNAVAILABLE = "The engine is unavailable; retry later."
MAX_MESSAGE = 500
MAX_FIELD = 100
# Markup, a traceback, or an absolute path under a directory servers keep things in.
_INTERNAL = re.compile(
    r"<\s*/?\s*[a-zA-Z!?]|Traceback \(most recent call last\)"
    r"|(?<![\w.])/(?:home|usr|srv|opt|var|tmp|root|etc|app|models|work|mnt|data|proc|run)/",
)


def looks_internal(text: str) -> bool:
    return bool(_INTERNAL.search(text))


def upstream_error(status_code: int) -> dict[str, Any]:
    """An answer from the engine endpoint that is not the API's own error."""
    return {"message": f"The engine endpoint answered HTTP {status_code} without an API error.",
            "type": "server_error", "param": None, "code": "upstream_error"}


def transport_error(exc: BaseException) -> dict[str, Any]:
    """The engine endpoint could not be reached; the exception's text (addresses) stays in the logs."""
    return {"message": f"The engine could not be reached ({type(exc).__name__}).", "type": "server_error",
            "param": None, "code": "engine_unreachable"}


def api_error(error: Any, status_code: int) -> dict[str, Any]:
    """An error object from the engine endpoint as a tenant may read it: OpenAI's four
    fields as short strings, or `upstream_error` when it is not one or reads as internal."""
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return upstream_error(status_code)
    fields = {name: error.get(name) for name in ("message", "type", "param", "code")}
    if any(isinstance(value, str) and looks_internal(value) for value in fields.values()):
        return upstream_error(status_code)
    return {name: value if value is None else str(value)[:MAX_MESSAGE if name == "message" else MAX_FIELD]
            for name, value in fields.items()}


def response_body(body: Any, status_code: int) -> Any:
    """A JSON answer of the engine endpoint with its error, if any, made public."""
    if isinstance(body, dict) and "error" in body:
        return {**body, "error": api_error(body["error"], status_code)}
    return body
