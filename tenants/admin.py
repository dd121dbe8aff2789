"""Admin console for tiers, tenants, keys and usage. Saves go through `tenants.actions`."""
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.cache import add_never_cache_headers

from tenants import actions
from tenants.models import ApiKey, QuotaTier, Tenant, UsageRecord


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
        tier, _ = actions.save_tier(obj.name, **limits)
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
            actions.update_tenant(obj, name=obj.name, tier=obj.tier, is_active=obj.is_active)
        else:
            tenant = actions.create_tenant(obj.name, obj.tier)
            if not obj.is_active:
                actions.update_tenant(tenant, name=tenant.name, tier=tenant.tier, is_active=False)
            _adopt(obj, tenant)


@admin.register(ApiKey)
class ApiKeyAdmin(NoDeleteAdmin):
    list_display = ["__str__", "tenant", "created", "last_used", "expires", "revoked"]
    list_filter = ["tenant"]
    search_fields = ["prefix", "name", "tenant__name"]
    actions = ["revoke"]

    def get_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        if obj is None:
            return ["tenant", "name", "expires"]
        return ["tenant", "name", "prefix", "created", "last_used", "expires", "revoked"]

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        # A key never changes after issue; it is revoked instead.
        return self.get_fields(request, obj) if obj else []

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if change:
            return
        issued = actions.issue_key(obj.tenant, name=obj.name, expires=obj.expires)
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
            actions.revoke_key(api_key)
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

