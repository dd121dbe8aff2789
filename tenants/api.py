"""The base view for tenant-facing API endpoints."""
from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from tenants.errors import rate_limit_headers


class TenantAPIView(APIView):
    """Authenticated by key, counted against requests/min (the DRF defaults in settings),
    and answering with the `x-ratelimit-*` headers as OpenAI does."""

    def finalize_response(self, request: Request, response: Response, *args: Any, **kwargs: Any) -> Response:
        response = super().finalize_response(request, response, *args, **kwargs)
        decision = getattr(request, "rate_limit", None)
        if decision is not None:
            for name, value in rate_limit_headers(decision).items():
                response.headers.setdefault(name, value)
        return response
