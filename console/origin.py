"""The console socket's origin check: scheme, host and port, as a browser compares origins.

The console socket authenticates by session cookie, which a browser attaches to a socket
that any site's page opens, so the page's Origin must be the console's own origin: the
scheme (http for ws, https for wss, or https when a trusted proxy says so), the Host the
socket was opened to (which must be in ALLOWED_HOSTS) and its port, or an origin listed
in CSRF_TRUSTED_ORIGINS. Channels' AllowedHostsOriginValidator compares host names only,
so http://console:8000 would let a page on http://console:9999 in.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host

DEFAULT_PORTS = {"http": 80, "https": 443}


def normalized(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin or URL, or None when it is not one."""
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    return parts.scheme, parts.hostname.lower(), port or DEFAULT_PORTS[parts.scheme]


def _headers(scope: dict) -> dict[str, str]:
    return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope.get("headers", [])}


def socket_origin(scope: dict) -> tuple[str, str, int] | None:
    """The origin a page served by this console has, from the socket's own request."""
    headers = _headers(scope)
    scheme = "https" if scope.get("scheme") == "wss" else "http"
    proxy = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if proxy is not None:
        name = proxy[0].removeprefix("HTTP_").replace("_", "-").lower()
        if headers.get(name, "").split(",")[0].strip() == proxy[1]:
            scheme = "https"
    host = headers.get("host", "")
    domain, _ = split_domain_port(host)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return None
    return normalized(f"{scheme}://{host}")


def allowed(scope: dict) -> bool:
    origin = normalized(_headers(scope).get("origin", ""))
    if origin is None:
        return False
    trusted = {normalized(o) for o in getattr(settings, "CSRF_TRUSTED_ORIGINS", [])}
    return origin == socket_origin(scope) or origin in trusted


class SameOriginValidator:
    """ASGI middleware: a console socket from another origin is refused (HTTP 403)."""

    def __init__(self, application) -> None:
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and not allowed(scope):
            return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)
