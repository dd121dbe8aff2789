"""Channels routes: the endpoints that talk to the engine.

Each consumer is wrapped in `tenants.middleware.ApiKeyAuthMiddleware` (key and
requests/min) or, for the batch workers, `ServiceTokenMiddleware`. Everything else over
HTTP is plain Django (DRF authenticates itself).
"""
from django.urls import path

from inference.consumers import OpenAIConsumer, PlatformChatConsumer
from inference.internal import BatchChatConsumer, BatchCompletionConsumer, ServiceTokenMiddleware
from inference.websocket import ChatSocketConsumer
from tenants.middleware import ApiKeyAuthMiddleware


class ChatCompletionsConsumer(OpenAIConsumer):
    kind = "chat"


class CompletionsConsumer(OpenAIConsumer):
    kind = "completion"


http_routes = [
    path("v1/chat/completions", ApiKeyAuthMiddleware(ChatCompletionsConsumer.as_asgi())),
    path("v1/completions", ApiKeyAuthMiddleware(CompletionsConsumer.as_asgi())),
    path("api/v1/inference/chat", ApiKeyAuthMiddleware(PlatformChatConsumer.as_asgi())),
    # Batch workers only (service token): lane P2, acting for the batch's tenant.
    path("internal/v1/chat/completions", ServiceTokenMiddleware(BatchChatConsumer.as_asgi())),
    path("internal/v1/completions", ServiceTokenMiddleware(BatchCompletionConsumer.as_asgi())),
]
websocket_routes = [
    path("ws/v1/chat", ApiKeyAuthMiddleware(ChatSocketConsumer.as_asgi())),
]
