"""GET /v1/usage: a tenant reads its own usage, in buckets (tenants.usage)."""
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from tenants import usage
from tenants.api import TenantAPIView
from tenants.errors import ApiError
from tenants.models import Scope, UsageRecord

USAGE_PARAMETERS = [
    OpenApiParameter("start_time", int, required=True, description="Unix seconds; aligned down to the bucket's start."),
    OpenApiParameter("end_time", int, description="Unix seconds, exclusive; default now."),
    OpenApiParameter("bucket_width", str, enum=list(usage.WIDTHS), description="Default 1d."),
    OpenApiParameter("group_by", str, many=True, description=f"Any of {', '.join(usage.GROUPS)} (repeat, or comma-separated)."),
    OpenApiParameter("limit", int, description="Buckets per page: 1h up to 168 (default 24), 1d up to 31 (default 7)."),
    OpenApiParameter("page", str, description="The previous page's next_page."),
]

_RESULT = {
    "object": serializers.CharField(), "input_tokens": serializers.IntegerField(),
    "output_tokens": serializers.IntegerField(), "input_cached_tokens": serializers.IntegerField(),
    "num_model_requests": serializers.IntegerField(), "api_key_id": serializers.CharField(allow_null=True),
    "model": serializers.CharField(allow_null=True), "lane": serializers.IntegerField(allow_null=True),
}
USAGE_PAGE = inline_serializer("UsagePage", {
    "object": serializers.ChoiceField(choices=["page"]),
    "data": inline_serializer("UsageBucket", {
        "object": serializers.ChoiceField(choices=["bucket"]), "start_time": serializers.IntegerField(),
        "end_time": serializers.IntegerField(), "results": inline_serializer("UsageResult", _RESULT, many=True)}, many=True),
    "has_more": serializers.BooleanField(),
    "next_page": serializers.CharField(allow_null=True),
})


def query_or_400(params) -> usage.Query:
    try:
        return usage.parse_query(params, timezone.now())
    except ValueError as exc:
        param, message = exc.args
        raise ApiError(400, message, code="invalid_value", param=param) from None


class Usage(TenantAPIView):
    """GET /v1/usage: this tenant's token usage, in the shape of OpenAI's organization usage
    API (completions): buckets of 1h or 1d, each with results grouped by key, model or lane."""

    scopes = {"GET": Scope.READ}

    @extend_schema(operation_id="getUsage", parameters=USAGE_PARAMETERS, responses=USAGE_PAGE, tags=["usage"])
    def get(self, request: Request) -> Response:
        query = query_or_400(request.query_params)
        return Response(usage.buckets(UsageRecord.objects.filter(tenant=request.user), query))


class OrganizationUsage(Usage):
    """GET /v1/organization/usage/completions: OpenAI's path for the same (left out of the
    schema, which lists /v1/usage once)."""

    schema = None
