"""The OpenAI-compatible API. Views parse, call one function, and respond."""
from rest_framework.request import Request
from rest_framework.response import Response

from inference.catalog import served_models
from tenants.api import TenantAPIView


class ModelList(TenantAPIView):
    """GET /v1/models: the models this deployment serves (the same for every tenant)."""

    def get(self, request: Request) -> Response:
        return Response({"object": "list", "data": served_models()})
