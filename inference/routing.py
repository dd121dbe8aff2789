"""Channels routes: streaming HTTP (SSE) consumers and WebSocket consumers.

Every route here wraps its consumer in `tenants.middleware.ApiKeyAuthMiddleware` (the
WebSocket router as a whole is wrapped in `config.asgi`). Streaming endpoints arrive
with the chat completions issue; until then plain Django serves all HTTP.
"""
from django.urls import URLPattern

http_routes: list[URLPattern] = []
websocket_routes: list[URLPattern] = []
