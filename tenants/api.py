"""The base view for tenant-facing API endpoints, and serving one's heavy methods on a bounded pool."""
from concurrent.futures import Executor
from typing import Any

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from tenants.errors import missing_scope, rate_limit_headers
from tenants.models import ApiKey


class TenantAPIView(APIView):
    """Authenticated by key, counted against requests/min (the DRF defaults in settings),
    and answering with the `x-ratelimit-*` headers as OpenAI does.

    `scopes` names the key scope each method needs (`tenants.models.Scope`); a key without
    it is refused with 403 before it is counted. A method not named needs none."""

    scopes: dict[str, str] = {}

    def check_permissions(self, request: Request) -> None:
        super().check_permissions(request)
        needed = self.scopes.get(request.method)
        if needed and isinstance(request.auth, ApiKey) and not request.auth.allows(needed):
            raise missing_scope(needed)

    def finalize_response(self, request: Request, response: Response, *args: Any, **kwargs: Any) -> Response:
        response = super().finalize_response(request, response, *args, **kwargs)
        decision = getattr(request, "rate_limit", None)
        if decision is not None:
            for name, value in rate_limit_headers(decision).items():
                response.headers.setdefault(name, value)
        return response


def on_a_pool(view_class: type[TenantAPIView], executor: Executor, pool: str, methods=("POST",)):
    """`view_class` as an async view whose `methods` run on `executor`, the others as Django runs
    sync views: under ASGI, each request's on a thread of its own (asgiref's per-request
    ThreadSensitiveContext), as many at once as requests arrive, all sharing one GIL. A view
    that works in Python for long (parsing a file, tokenizing a long prompt) then takes the
    interpreter from every other request of the process for as many calls as a tenant sends
    at once; on the pool, at most its size run and the rest wait their turn."""
    view = view_class.as_view()

    @csrf_exempt  # as DRF's own views: clients authenticate by key, not by cookie
    async def serve(request: HttpRequest) -> HttpResponse:
        if request.method in methods:
            return await database_sync_to_async(view, thread_sensitive=False, executor=executor)(request)
        return await sync_to_async(view)(request)

    serve.__doc__ = f"{view_class.__doc__} ({', '.join(methods)} on the {pool} pool)"
    return serve
