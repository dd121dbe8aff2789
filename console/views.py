"""The operators' console: staff-only pages over tenants, batches, the engine and a playground.

Views parse, call `tenants.actions` or `batches.actions`, and render; reads live in
`console.queries`. Every page needs a staff session (`staff_member_required` sends anyone
else to the admin's login), and every write is a POST under Django's CSRF check.
Staff alone is not enough, as in the admin: a page needs the model permission it shows
(`view_*`) and a write the one it exercises (`add_*`, `change_*`); without it, a 403.
"""
from __future__ import annotations

from datetime import timedelta
from functools import wraps

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.db import IntegrityError, transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from batches import actions as batch_actions
from batches.models import Batch
from console import queries
from tenants import actions
from tenants.models import ApiKey, AuditEntry, QuotaTier, Tenant

PLAYGROUND_KEY_TTL = timedelta(hours=1)


def requires(get: str | None = None, post: str | None = None):
    """The Django model permission a GET and a POST of the view need (the admin's rule).
    Placed under `staff_member_required`, so a visitor without a staff session is still
    sent to the login rather than told what exists."""
    def decorate(view):
        @wraps(view)
        def checked(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            needed = post if request.method == "POST" else get
            if needed is not None and not request.user.has_perm(needed):
                raise PermissionDenied(f"Your account lacks the permission {needed!r}.")
            return view(request, *args, **kwargs)
        return checked
    return decorate


@staff_member_required
@require_GET
def engine(request: HttpRequest) -> HttpResponse:
    return render(request, "console/engine.html", {"section": "engine"})


@staff_member_required
@requires(get="tenants.view_tenant", post="tenants.add_tenant")
@require_http_methods(["GET", "POST"])
def tenants(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        name = request.POST.get("name", "").strip()
        tier = QuotaTier.objects.filter(pk=request.POST.get("tier") or None).first()
        if not name or tier is None:
            messages.error(request, "A tenant needs a name and a tier.")
            return redirect("console:tenants")
        try:
            with transaction.atomic():  # a savepoint: the duplicate name's error must not poison the request
                tenant = actions.create_tenant(name, tier, actor=request.user.get_username())
        except IntegrityError:
            messages.error(request, f"A tenant named {name!r} exists already.")
            return redirect("console:tenants")
        messages.success(request, f"Tenant {tenant.name} created.")
        return redirect("console:tenant", pk=tenant.pk)
    used = queries.tokens_this_month()
    rows = [{"tenant": t, "used": used.get(t.pk, 0), "limits": queries.limits_state(t),
             "used_pct": min(100, round(100 * used.get(t.pk, 0) / t.tier.monthly_token_budget))
             if t.tier.monthly_token_budget else 100}
            for t in Tenant.objects.select_related("tier")]
    return render(request, "console/tenants.html",
                  {"section": "tenants", "rows": rows, "tiers": QuotaTier.objects.all()})


def _tenant_page(request: HttpRequest, tenant: Tenant, issued: actions.IssuedKey | None = None) -> HttpResponse:
    by_day = queries.usage_by_day(tenant)
    by_lane = queries.usage_by_lane(tenant)
    response = render(request, "console/tenant_detail.html", {
        "section": "tenants",
        "tenant": tenant,
        "used": queries.tokens_this_month().get(tenant.pk, 0),
        "limits": queries.limits_state(tenant),
        "day_bars": queries.bars(by_day),
        "lane_bars": queries.bars(by_lane, width=240),
        "keys": queries.keys_with_usage(tenant),
        "tiers": QuotaTier.objects.all(),
        "issued": issued,
        "now": timezone.now(),
    })
    # A new key's secret is in this response only: never cached, never in the session or a message.
    add_never_cache_headers(response)
    return response


@staff_member_required
@requires(get="tenants.view_tenant")
@require_GET
def tenant_detail(request: HttpRequest, pk: int) -> HttpResponse:
    return _tenant_page(request, get_object_or_404(Tenant.objects.select_related("tier"), pk=pk))


@staff_member_required
@requires(post="tenants.add_apikey")
@require_POST
def issue_key(request: HttpRequest, pk: int) -> HttpResponse:
    tenant = get_object_or_404(Tenant.objects.select_related("tier"), pk=pk)
    issued = actions.issue_key(tenant, name=request.POST.get("name", "").strip()[:128], actor=request.user.get_username())
    return _tenant_page(request, tenant, issued)


@staff_member_required
@requires(post="tenants.change_apikey")
@require_POST
def revoke_key(request: HttpRequest, pk: int, key_pk: int) -> HttpResponse:
    api_key = get_object_or_404(ApiKey, pk=key_pk, tenant_id=pk)
    actions.revoke_key(api_key, actor=request.user.get_username())
    messages.success(request, f"Key sk-{api_key.prefix}_… revoked.")
    return redirect("console:tenant", pk=pk)


@staff_member_required
@requires(post="tenants.change_tenant")
@require_POST
def change_tier(request: HttpRequest, pk: int) -> HttpResponse:
    tenant = get_object_or_404(Tenant, pk=pk)
    tier = get_object_or_404(QuotaTier, pk=request.POST.get("tier") or None)
    actions.change_tier(tenant, tier, actor=request.user.get_username())
    messages.success(request, f"{tenant.name} is now on tier {tier.name}.")
    return redirect("console:tenant", pk=pk)


@staff_member_required
@requires(get="batches.view_batch")
@require_GET
def batches(request: HttpRequest) -> HttpResponse:
    rows = queries.batch_rows()
    active = any(row["batch"].status in Batch.ACTIVE or row["batch"].status == Batch.Status.VALIDATING for row in rows)
    return render(request, "console/batches.html", {"section": "batches", "rows": rows, "active": active})


AUDIT_PAGE = 100


@staff_member_required
@requires(get="tenants.view_auditentry")
@require_GET
def audit(request: HttpRequest) -> HttpResponse:
    """Staff writes, newest first, each with the record before and after; ?target=tenant:3 narrows."""
    entries = AuditEntry.objects.all()
    target = request.GET.get("target", "").strip()[:200]
    if target:
        entries = entries.filter(target=target)
    try:
        page = max(1, int(request.GET.get("page", "1")))
    except ValueError:
        page = 1
    rows = list(entries[(page - 1) * AUDIT_PAGE:page * AUDIT_PAGE + 1])
    return render(request, "console/audit.html", {
        "section": "audit", "entries": rows[:AUDIT_PAGE], "target": target, "page": page,
        "more": len(rows) > AUDIT_PAGE,
    })


@staff_member_required
@requires(post="batches.change_batch")
@require_POST
def cancel_batch(request: HttpRequest, batch_id: str) -> HttpResponse:
    batch = batch_actions.cancel(get_object_or_404(Batch, pk=batch_id))
    messages.success(request, f"Batch {batch.id} is {batch.status}.")
    return redirect("console:batches")


@staff_member_required
@requires(get="tenants.view_tenant", post="tenants.add_apikey")
@never_cache
@require_http_methods(["GET", "POST"])
def playground(request: HttpRequest) -> HttpResponse:
    """GET picks a tenant; POST issues that tenant a key valid for an hour, named after the
    operator, and hands it to the page, whose script calls the public streaming API with it.
    The operator's earlier playground keys for that tenant are revoked: one live key each."""
    context = {"section": "playground", "tenants": Tenant.objects.filter(is_active=True).select_related("tier")}
    if request.method == "POST":
        tenant = get_object_or_404(Tenant.objects.select_related("tier"), pk=request.POST.get("tenant") or None,
                                   is_active=True)
        name = f"console playground ({request.user.get_username()})"[:128]
        for earlier in ApiKey.objects.filter(tenant=tenant, name=name, revoked__isnull=True):
            actions.revoke_key(earlier, actor=request.user.get_username())
        context["tenant"] = tenant
        context["issued"] = actions.issue_key(tenant, name=name, expires=timezone.now() + PLAYGROUND_KEY_TTL,
                                               actor=request.user.get_username())
        context["max_tokens"] = min(128, tenant.tier.max_tokens_per_request)
    return render(request, "console/playground.html", context)
