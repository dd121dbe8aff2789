"""ASGI entry point: Channels routes streaming endpoints and WebSockets, Django the rest."""
import functools
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

# Django must be set up before anything imports models.
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.urls import re_path  # noqa: E402

from batches import upload_gate  # noqa: E402
from config import daphne_hooks, front_worker, intake  # noqa: E402
from config.request_ids import RequestIdMiddleware  # noqa: E402
from console.routing import console_routes  # noqa: E402
from inference import drain, fleet  # noqa: E402
from inference.host import EngineLifespan, host  # noqa: E402
from inference.http_metrics import ResponseMetrics, labelled_routes  # noqa: E402
from inference.routing import http_routes, websocket_routes  # noqa: E402
from tenants import flood_gate  # noqa: E402

MULTIPART_OVERHEAD = 64 * 1024  # form boundaries and the purpose field around an uploaded file
# Body limit while the body arrives, and RFC 6455 close codes for consumers (see daphne_hooks).
daphne_hooks.install_body_limit(settings.MAX_REQUEST_BYTES, {"/v1/files": settings.FILES_MAX_BYTES + MULTIPART_OVERHEAD})
daphne_hooks.allow_endpoint_close_codes()
daphne_hooks.skip_form_parsing()
daphne_hooks.enlarge_body_messages()
daphne_hooks.name_status_codes()
daphne_hooks.abort_after_late_errors()  # a view raising mid-stream: the client sees the cut, daphne keeps checking
daphne_hooks.pace_accepts(settings.ACCEPTS_PER_TURN)
daphne_hooks.close_idle_connections(settings.HTTP_KEEPALIVE_TIMEOUT_S)  # not Twisted's 12 hours
daphne_hooks.raise_open_files_limit()  # a connection is a file descriptor: 1,024 is a stock soft limit
intake.install(settings.INTAKE_TURN_MS, settings.INTAKE_PENDING_PER_CALLER,  # requests parsed in turns per caller
               settings.REQUEST_HEAD_TIMEOUT_S, settings.REQUEST_BODY_IDLE_S)
# A stream's send waits for a slow reader; a stalled one is disconnected (see daphne_hooks).
daphne_hooks.install_stream_backpressure(settings.STREAM_MAX_BUFFERED_BYTES, settings.STREAM_STALL_S)
upload_gate.install()  # POST /v1/files: the key is checked before the body is read
flood_gate.install()  # past a tenant's in-flight bound (429) or with an unusable key (401): before the application
# The engine loads, the replica reports to the fleet and SIGTERM drains from the moment daphne
# serves, not from its first connection (EngineLifespan does the same for servers with lifespan).
daphne_hooks.call_when_serving(host.start, fleet.join, drain.install)
if settings.FRONT_SOCKET:  # connections also come from the front, handed over whole
    daphne_hooks.call_when_serving(functools.partial(front_worker.start, settings.FRONT_SOCKET, settings.WEB_WORKER))

# No origin validator on WebSockets: callers authenticate with a bearer key, which a
# browser page cannot attach to another site's socket, and most API clients send no Origin.
# EngineLifespan starts loading the model when the server starts serving (never at import),
# this replica's reports to the fleet, and the drain on SIGTERM.
# Outermost: every response, refusals and 404s included, is counted (inference.http_metrics)
# and carries X-Request-Id (config.request_ids).
application = ResponseMetrics(RequestIdMiddleware(EngineLifespan(ProtocolTypeRouter(
    {
        # Streaming (SSE) routes first, each wrapped in the key middleware by
        # inference.routing; everything else is plain Django (DRF authenticates itself).
        "http": URLRouter([*labelled_routes(http_routes), re_path(r"", django_asgi_app)]),
        # The operators' console socket authenticates by session cookie, which a browser does
        # attach to another site's socket: it alone checks the Origin (scheme, host and port).
        # The API's socket takes a key, as the streaming routes do (inference.routing).
        "websocket": URLRouter([*labelled_routes(console_routes), *labelled_routes(websocket_routes)]),
    }
), on_serve=(fleet.join, drain.install))))
