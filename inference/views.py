"""The OpenAI-compatible API. Views parse, call one function, and respond."""
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from inference.catalog import served_models
from tenants.api import TenantAPIView


class ModelList(TenantAPIView):
    """GET /v1/models: the models this deployment serves (the same for every tenant)."""

    @extend_schema(
        operation_id="listModels",
        responses=inline_serializer("ModelList", {
            "object": serializers.ChoiceField(choices=["list"]),
            "data": inline_serializer("Model", {
                "id": serializers.CharField(),
                "object": serializers.ChoiceField(choices=["model"]),
                "created": serializers.IntegerField(),
                "owned_by": serializers.CharField(),
            }, many=True),
        }),
        tags=["models"],
    )
    def get(self, request: Request) -> Response:
        return Response({"object": "list", "data": served_models()})
