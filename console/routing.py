"""The console's WebSocket, relative to /ws/console/ (config.asgi mounts it behind
session authentication and an origin check)."""
from django.urls import path

from console.consumers import EngineConsumer

console_routes = [
    path("engine", EngineConsumer.as_asgi()),
]
