"""The staff admin API under /api/v1/admin/: what the console does, for operators' scripts.

Authenticated by a staff session (CSRF-checked, and held to the user's Django model
permissions, as the admin and the console are) or by OPERATOR_API_TOKEN (every
permission). Every write goes through `tenants.actions` with the caller as its actor, so
it lands in the audit log with its before and after.

    GET  /api/v1/admin/tenants?search=&limit=&offset=   POST (name, tier)
    GET  /api/v1/admin/tenants/{id}                     PATCH (name, tier, is_active)
    GET  /api/v1/admin/tenants/{id}/keys                POST: issue (the secret shown once)
    POST /api/v1/admin/keys/{id}/revoke                 POST /api/v1/admin/keys/{id}/rotate
    GET  /api/v1/admin/tiers                            POST (a new tier)
    GET  /api/v1/admin/tiers/{name}                     PATCH (any of its limits)
    GET  /api/v1/admin/usage?tenant=&start_time=...     (as GET /v1/usage, any tenant or all)
    GET  /api/v1/admin/audit?limit=
"""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import Q
from django.shortcuts import get_object_or_404
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.authentication import BaseAuthentication, SessionAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from inference.service_tokens import is_operator_token
from tenants import actions, usage
from tenants.errors import ApiError
from tenants.models import ApiKey, AuditEntry, QuotaTier, Scope, Tenant, UsageRecord
from tenants.views import USAGE_PAGE, USAGE_PARAMETERS, query_or_400

PAGE_MOST = 500  # tenants per page
AUDIT_MOST = 1000  # audit entries per answer
MAX_GRACE = timedelta(days=30)  # a rotated key's old secret lives at most this long


class OperatorToken:
    """The caller that presented OPERATOR_API_TOKEN: an operator's script, with every permission."""

    is_authenticated = True
    is_staff = True

    def get_username(self) -> str:
        return "operator-token"

    def has_perm(self, perm: str) -> bool:
        return True


class OperatorTokenAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[OperatorToken, None] | None:
        return (OperatorToken(), None) if is_operator_token(request.META.get("HTTP_AUTHORIZATION")) else None

    def authenticate_header(self, request: Request) -> str:
        return "Bearer"


class OperatorTokenScheme(OpenApiAuthenticationExtension):
    target_class = "tenants.staff_api.OperatorTokenAuthentication"
    name = "OperatorToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "OPERATOR_API_TOKEN (or a staff session)."}


class StaffWithModelPermission(BasePermission):
    """Staff only; each method needs the view's `permissions[method]` (Django's codenames)."""

    def has_permission(self, request: Request, view: APIView) -> bool:
        user = request.user
        if not (user and user.is_authenticated and user.is_staff):
            raise ApiError(403, "The admin API is for staff: a staff session or OPERATOR_API_TOKEN.",
                           type="permission_error", code="staff_only")
        needed = getattr(view, "permissions", {}).get(request.method, ())
        missing = [perm for perm in needed if not user.has_perm(perm)]
        if missing:
            raise ApiError(403, f"This staff user lacks the permission {missing[0]!r}.", type="permission_error",
                           code="missing_permission")
        return True


class StaffView(APIView):
    authentication_classes = [OperatorTokenAuthentication, SessionAuthentication]
    permission_classes = [StaffWithModelPermission]
    throttle_classes: list = []
    permissions: dict[str, tuple[str, ...]] = {}

    def actor(self) -> str:
        return self.request.user.get_username()


def _valid(serializer: serializers.Serializer) -> dict:
    """The validated data, or a 400 naming the first field that is wrong."""
    if not serializer.is_valid():
        field, problems = next(iter(serializer.errors.items()))
        problem = problems[0] if isinstance(problems, list) else problems
        param = None if field == "non_field_errors" else field
        raise ApiError(400, f"{field}: {problem}" if param else str(problem), code="invalid_value", param=param)
    return serializer.validated_data


# --- shapes ------------------------------------------------------------------------------------


class TierShape(serializers.ModelSerializer):
    class Meta:
        model = QuotaTier
        fields = ["name", "lane", "requests_per_minute", "tokens_per_minute", "concurrent_streams",
                  "max_tokens_per_request", "monthly_token_budget", "allow_batch", "share_prefix_cache"]


class TenantShape(serializers.ModelSerializer):
    tier = serializers.SlugRelatedField(slug_field="name", queryset=QuotaTier.objects.all())

    class Meta:
        model = Tenant
        fields = ["id", "name", "tier", "is_active", "created"]
        read_only_fields = ["id", "created"]


class KeyShape(serializers.ModelSerializer):
    id = serializers.IntegerField(read_only=True)
    key_prefix = serializers.SerializerMethodField()
    replaced_by = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = ["id", "tenant", "name", "key_prefix", "scopes", "requests_per_minute", "tokens_per_minute",
                  "monthly_token_budget", "created", "last_used", "expires", "revoked", "replaced_by"]
        read_only_fields = fields

    def get_key_prefix(self, api_key: ApiKey) -> str:
        return f"sk-{api_key.prefix}"

    def get_replaced_by(self, api_key: ApiKey) -> int | None:
        return api_key.replaced_by_id


class IssuedKeyShape(KeyShape):
    secret = serializers.CharField(read_only=True, help_text="The whole key: shown in this answer only.")

    class Meta(KeyShape.Meta):
        fields = [*KeyShape.Meta.fields, "secret"]
        read_only_fields = fields


class IssueKey(serializers.Serializer):
    name = serializers.CharField(max_length=128, required=False, default="", allow_blank=True)
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.values), required=False, default=list)
    requests_per_minute = serializers.IntegerField(min_value=0, required=False, allow_null=True, default=None)
    tokens_per_minute = serializers.IntegerField(min_value=0, required=False, allow_null=True, default=None)
    monthly_token_budget = serializers.IntegerField(min_value=0, required=False, allow_null=True, default=None)
    expires = serializers.DateTimeField(required=False, allow_null=True, default=None)


class RotateKey(serializers.Serializer):
    grace_s = serializers.IntegerField(min_value=0, max_value=int(MAX_GRACE.total_seconds()), required=False,
                                       help_text="How long the old secret keeps working; default KEY_ROTATION_GRACE_S.")


class AuditShape(serializers.ModelSerializer):
    class Meta:
        model = AuditEntry
        fields = ["id", "at", "actor", "action", "target", "before", "after"]


def _issued(issued: actions.IssuedKey) -> dict:
    return {**KeyShape(issued.api_key).data, "secret": issued.plaintext}


# --- tenants -----------------------------------------------------------------------------------


class TenantList(StaffView):
    permissions = {"GET": ("tenants.view_tenant",), "POST": ("tenants.add_tenant",)}

    @extend_schema(operation_id="adminListTenants", tags=["admin"], responses=TenantShape(many=True), parameters=[
        OpenApiParameter("search", str, description="Part of the name."),
        OpenApiParameter("limit", int, description=f"At most {PAGE_MOST}; default 100."),
        OpenApiParameter("offset", int)])
    def get(self, request: Request) -> Response:
        tenants = Tenant.objects.select_related("tier").order_by("name")
        if search := request.query_params.get("search", "").strip():
            tenants = tenants.filter(name__icontains=search[:128])
        limit, offset = _page(request, 100, PAGE_MOST)
        total = tenants.count()
        return Response({"object": "list", "data": TenantShape(tenants[offset:offset + limit], many=True).data,
                         "total": total, "has_more": offset + limit < total})

    @extend_schema(operation_id="adminCreateTenant", tags=["admin"], request=TenantShape, responses={201: TenantShape})
    def post(self, request: Request) -> Response:
        data = _valid(TenantShape(data=request.data))
        tenant = actions.create_tenant(data["name"], data["tier"], actor=self.actor())
        if data.get("is_active") is False:
            actions.set_active(tenant, False, actor=self.actor())
        return Response(TenantShape(tenant).data, status=201)


class TenantDetail(StaffView):
    permissions = {"GET": ("tenants.view_tenant",), "PATCH": ("tenants.change_tenant",)}

    @extend_schema(operation_id="adminGetTenant", tags=["admin"], responses=TenantShape)
    def get(self, request: Request, pk: int) -> Response:
        return Response(TenantShape(get_object_or_404(Tenant.objects.select_related("tier"), pk=pk)).data)

    @extend_schema(operation_id="adminUpdateTenant", tags=["admin"], request=TenantShape, responses=TenantShape)
    def patch(self, request: Request, pk: int) -> Response:
        """Rename, move to another tier (applies to the next request), deactivate or reactivate."""
        tenant = get_object_or_404(Tenant.objects.select_related("tier"), pk=pk)
        data = _valid(TenantShape(tenant, data=request.data, partial=True))
        tenant = actions.update_tenant(tenant, name=data.get("name", tenant.name), tier=data.get("tier", tenant.tier),
                                       is_active=data.get("is_active", tenant.is_active), actor=self.actor())
        return Response(TenantShape(tenant).data)


def _page(request: Request, default: int, most: int) -> tuple[int, int]:
    try:
        limit = int(request.query_params.get("limit", default))
        offset = int(request.query_params.get("offset", 0))
    except ValueError:
        raise ApiError(400, "limit and offset are whole numbers.", code="invalid_value", param="limit") from None
    if not 1 <= limit <= most or offset < 0:
        raise ApiError(400, f"limit is 1 to {most}, offset 0 or more.", code="invalid_value", param="limit")
    return limit, offset


# --- keys --------------------------------------------------------------------------------------


class TenantKeys(StaffView):
    permissions = {"GET": ("tenants.view_apikey",), "POST": ("tenants.add_apikey",)}

    @extend_schema(operation_id="adminListKeys", tags=["admin"], responses=KeyShape(many=True))
    def get(self, request: Request, pk: int) -> Response:
        tenant = get_object_or_404(Tenant, pk=pk)
        return Response({"object": "list", "data": KeyShape(tenant.api_keys.all(), many=True).data})

    @extend_schema(operation_id="adminIssueKey", tags=["admin"], request=IssueKey, responses={201: IssuedKeyShape})
    def post(self, request: Request, pk: int) -> Response:
        tenant = get_object_or_404(Tenant, pk=pk)
        data = _valid(IssueKey(data=request.data))
        issued = actions.issue_key(tenant, **data, actor=self.actor())
        response = Response(_issued(issued), status=201)
        response["Cache-Control"] = "no-store"
        return response


class KeyRevoke(StaffView):
    permissions = {"POST": ("tenants.change_apikey",)}

    @extend_schema(operation_id="adminRevokeKey", tags=["admin"], request=None, responses=KeyShape)
    def post(self, request: Request, pk: int) -> Response:
        api_key = actions.revoke_key(get_object_or_404(ApiKey, pk=pk), actor=self.actor())
        return Response(KeyShape(api_key).data)


class KeyRotate(StaffView):
    permissions = {"POST": ("tenants.add_apikey", "tenants.change_apikey")}

    @extend_schema(operation_id="adminRotateKey", tags=["admin"], request=RotateKey, responses={201: IssuedKeyShape})
    def post(self, request: Request, pk: int) -> Response:
        """A new key with the old one's name, scopes and limits; the old secret keeps working for
        `grace_s`, then is refused as expired."""
        api_key = get_object_or_404(ApiKey.objects.select_related("tenant"), pk=pk)
        data = _valid(RotateKey(data=request.data))
        grace = timedelta(seconds=data.get("grace_s", settings.KEY_ROTATION_GRACE_S))
        try:
            issued = actions.rotate_key(api_key, grace, actor=self.actor())
        except ValueError as exc:
            raise ApiError(409, f"{exc}.", code="key_not_rotatable") from None
        response = Response(_issued(issued), status=201)
        response["Cache-Control"] = "no-store"
        return response


# --- tiers -------------------------------------------------------------------------------------


class TierList(StaffView):
    permissions = {"GET": ("tenants.view_quotatier",), "POST": ("tenants.add_quotatier",)}

    @extend_schema(operation_id="adminListTiers", tags=["admin"], responses=TierShape(many=True))
    def get(self, request: Request) -> Response:
        return Response({"object": "list", "data": TierShape(QuotaTier.objects.all(), many=True).data})

    @extend_schema(operation_id="adminCreateTier", tags=["admin"], request=TierShape, responses={201: TierShape})
    def post(self, request: Request) -> Response:
        data = dict(_valid(TierShape(data=request.data)))
        tier, _ = actions.save_tier(data.pop("name"), **data, actor=self.actor())
        return Response(TierShape(tier).data, status=201)


class TierDetail(StaffView):
    permissions = {"GET": ("tenants.view_quotatier",), "PATCH": ("tenants.change_quotatier",)}

    @extend_schema(operation_id="adminGetTier", tags=["admin"], responses=TierShape)
    def get(self, request: Request, name: str) -> Response:
        return Response(TierShape(get_object_or_404(QuotaTier, name=name)).data)

    @extend_schema(operation_id="adminUpdateTier", tags=["admin"], request=TierShape, responses=TierShape)
    def patch(self, request: Request, name: str) -> Response:
        """Change any of a tier's limits; its tenants' next requests see them. The name stays."""
        tier = get_object_or_404(QuotaTier, name=name)
        if "name" in request.data and request.data["name"] != tier.name:
            raise ApiError(400, "A tier keeps its name: create another tier instead.", code="invalid_value",
                           param="name")
        data = _valid(TierShape(tier, data=request.data, partial=True))
        current = {field: getattr(tier, field) for field in TierShape.Meta.fields if field != "name"}
        tier, _ = actions.save_tier(tier.name, **{**current, **{k: v for k, v in data.items() if k != "name"}},
                                    actor=self.actor())
        return Response(TierShape(tier).data)


# --- usage and audit ---------------------------------------------------------------------------


class AdminUsage(StaffView):
    permissions = {"GET": ("tenants.view_usagerecord",)}

    @extend_schema(operation_id="adminGetUsage", tags=["admin"], responses=USAGE_PAGE, parameters=[
        *USAGE_PARAMETERS, OpenApiParameter("tenant", int, description="A tenant's id; default every tenant.")])
    def get(self, request: Request) -> Response:
        query = query_or_400(request.query_params)
        rows = UsageRecord.objects.all()
        if tenant := request.query_params.get("tenant"):
            if not tenant.isdigit():
                raise ApiError(400, "tenant is a tenant's id.", code="invalid_value", param="tenant")
            rows = rows.filter(tenant_id=int(tenant))
        return Response(usage.buckets(rows, query))


class AuditLog(StaffView):
    permissions = {"GET": ("tenants.view_auditentry",)}

    @extend_schema(operation_id="adminAuditLog", tags=["admin"], responses=AuditShape(many=True), parameters=[
        OpenApiParameter("target", str, description="e.g. tenant:3, key:ab12cd34ef56, tier:standard."),
        OpenApiParameter("limit", int, description=f"At most {AUDIT_MOST}; default 100.")])
    def get(self, request: Request) -> Response:
        entries = AuditEntry.objects.all()
        if target := request.query_params.get("target", "").strip():
            entries = entries.filter(Q(target=target[:200]))
        limit, offset = _page(request, 100, AUDIT_MOST)
        return Response({"object": "list", "data": AuditShape(entries[offset:offset + limit], many=True).data})

