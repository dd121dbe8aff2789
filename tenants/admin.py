"""Admin console for tiers, tenants, keys and usage. Saves go through `tenants.actions`."""
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.cache import add_never_cache_headers

from tenants import actions
from tenants.models import ApiKey, AuditEntry, QuotaTier, Tenant, UsageRecord


class NoDeleteAdmin(admin.ModelAdmin):
    """Rows here are deactivated or revoked through `tenants.actions`, never deleted from a
    page: usage records and keys must keep pointing at the tenant they belong to."""

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False



def _adopt(obj: Any, saved: Any) -> None:
    """Make the admin's unsaved form instance the row an action saved, so the admin's
    logging and redirects see the real primary key."""
    obj.pk = saved.pk
    obj._state.adding = False
    obj.refresh_from_db()


@admin.register(QuotaTier)
class QuotaTierAdmin(NoDeleteAdmin):
    list_display = [
        "name", "lane", "requests_per_minute", "tokens_per_minute", "concurrent_streams",
        "max_tokens_per_request", "monthly_token_budget", "allow_batch", "share_prefix_cache",
    ]

    def get_readonly_fields(self, request: HttpRequest, obj: QuotaTier | None = None) -> list[str]:
        # Tiers are saved by name; renaming one would create another.
        return ["name"] if obj else []

    def save_model(self, request: HttpRequest, obj: QuotaTier, form: Any, change: bool) -> None:
        limits = {f.name: getattr(obj, f.name) for f in QuotaTier._meta.concrete_fields if f.name not in ("id", "name")}
        tier, _ = actions.save_tier(obj.name, **limits, actor=request.user.get_username())
        _adopt(obj, tier)


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    fields = ["prefix", "name", "created", "last_used", "expires", "revoked"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # keys are issued from the API key page, which shows the secret once


@admin.register(Tenant)
class TenantAdmin(NoDeleteAdmin):
    list_display = ["name", "tier", "is_active", "created"]
    list_filter = ["tier", "is_active"]
    search_fields = ["name"]
    fields = ["name", "tier", "is_active"]
    inlines = [ApiKeyInline]

    def save_model(self, request: HttpRequest, obj: Tenant, form: Any, change: bool) -> None:
        if change:
            actions.update_tenant(obj, name=obj.name, tier=obj.tier, is_active=obj.is_active,
                                  actor=request.user.get_username())
        else:
            tenant = actions.create_tenant(obj.name, obj.tier, actor=request.user.get_username())
            if not obj.is_active:
                actions.set_active(tenant, False, actor=request.user.get_username())
            _adopt(obj, tenant)


# A key's own limits and scopes are set when it is issued (rotation carries them over).
KEY_LIMITS = ["scopes", "requests_per_minute", "tokens_per_minute", "monthly_token_budget"]


@admin.register(ApiKey)
class ApiKeyAdmin(NoDeleteAdmin):
    list_display = ["__str__", "tenant", "created", "last_used", "expires", "revoked"]
    list_filter = ["tenant"]
    search_fields = ["prefix", "name", "tenant__name"]
    actions = ["revoke"]

    def get_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        if obj is None:
            return ["tenant", "name", "expires", *KEY_LIMITS]
        return ["tenant", "name", "prefix", "created", "last_used", "expires", "revoked", *KEY_LIMITS, "replaced_by"]

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        # A key never changes after issue; it is revoked instead.
        return self.get_fields(request, obj) if obj else []

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if change:
            return
        issued = actions.issue_key(obj.tenant, name=obj.name, expires=obj.expires, scopes=obj.scopes,
                                   requests_per_minute=obj.requests_per_minute, tokens_per_minute=obj.tokens_per_minute,
                                   monthly_token_budget=obj.monthly_token_budget, actor=request.user.get_username())
        _adopt(obj, issued.api_key)
        request._issued_plaintext = issued.plaintext  # read once by response_add

    def response_add(self, request: HttpRequest, obj: ApiKey, post_url_continue: str | None = None) -> HttpResponse:
        """Show the new key on this page instead of redirecting: the secret never travels
        through the session or a message cookie, and is gone once the page is left."""
        response = TemplateResponse(
            request,
            "admin/tenants/apikey/issued.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "api_key": obj,
                "plaintext": request._issued_plaintext,
                "title": "API key issued",
            },
        )
        add_never_cache_headers(response)
        return response

    @admin.action(description="Revoke selected keys")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        for api_key in queryset:
            actions.revoke_key(api_key, actor=request.user.get_username())
        self.message_user(request, f"Revoked {queryset.count()} key(s).", messages.SUCCESS)


@admin.register(UsageRecord)
class UsageRecordAdmin(NoDeleteAdmin):
    list_display = ["created", "tenant", "model", "lane", "prompt_tokens", "completion_tokens", "finish_reason"]
    list_filter = ["tenant", "lane", "finish_reason"]
    date_hierarchy = "created"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False



@admin.register(AuditEntry)
class AuditEntryAdmin(NoDeleteAdmin):
    """Staff writes, read-only: nobody edits the record of what they did."""

    list_display = ["at", "actor", "action", "target"]
    list_filter = ["action", "actor"]
    search_fields = ["target", "actor"]
    date_hierarchy = "at"
    readonly_fields = ["at", "actor", "action", "target", "before", "after"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
