"""The console's WebSocket under /ws/console/: session authentication behind an origin
check (scheme, host and port; see console.origin). config.asgi mounts `console_routes`."""
from channels.auth import AuthMiddlewareStack
from channels.routing import URLRouter
from django.urls import path, re_path

from console.consumers import EngineConsumer
from console.origin import SameOriginValidator

console_routes = [
    re_path(r"^ws/console/", SameOriginValidator(AuthMiddlewareStack(URLRouter([
        path("engine", EngineConsumer.as_asgi()),
    ])))),
]
