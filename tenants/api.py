"""The base view for tenant-facing API endpoints."""
from typing import Any

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
