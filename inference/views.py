"""The OpenAI-compatible API. Views parse, call one function, and respond."""
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from inference.catalog import served_models
from inference.host import EngineUnavailable, host
from tenants.api import TenantAPIView
from tenants.errors import ApiError

class Model(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["model"])
    created = serializers.IntegerField()
    owned_by = serializers.CharField()
    max_model_len = serializers.IntegerField(allow_null=True, help_text="The context in tokens; null while loading.")


def _models() -> list[dict]:
    try:
        max_model_len = host.max_model_len
    except EngineUnavailable:
        max_model_len = None
    return served_models(max_model_len)


class ModelList(TenantAPIView):
    """GET /v1/models: the models this deployment serves (the same for every tenant)."""

    @extend_schema(
        operation_id="listModels",
        responses=inline_serializer("ModelList", {
            "object": serializers.ChoiceField(choices=["list"]),
            "data": Model(many=True),
        }),
        tags=["models"],
    )
    def get(self, request: Request) -> Response:
        return Response({"object": "list", "data": _models()})


class ModelDetail(TenantAPIView):
    """GET /v1/models/{model}: one served model, or 404 `model_not_found`."""

    @extend_schema(operation_id="retrieveModel", responses=Model, tags=["models"])
    def get(self, request: Request, model: str) -> Response:
        for served in _models():
            if served["id"] == model:
                return Response(served)
        raise ApiError(404, f"The model '{model[:200]}' does not exist.", code="model_not_found", param="model")


@csrf_exempt
def unknown_path(request: HttpRequest) -> JsonResponse:
    """Any /v1/ or /api/ path nothing else routes: OpenAI's error shape, not Django's HTML page."""
    error = ApiError(404, f"Unknown request URL: {request.method} {request.path[:200]}.", code="unknown_url")
    return JsonResponse(error.body(), status=404)
