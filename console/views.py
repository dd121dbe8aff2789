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

from django.conf import settings
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.db import IntegrityError, transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from batches import actions as batch_actions
from batches.models import Batch, BatchItem, File
from batches.views import streamed_file
from console import queries
from console import workers as console_workers
from tenants import actions
from tenants.errors import ApiError
from tenants.models import ApiKey, AuditEntry, Lane, QuotaTier, Tenant

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
    search = request.GET.get("q", "").strip()[:128]
    sort = request.GET.get("sort", "name") if request.GET.get("sort") in queries.TENANT_SORTS else "name"
    page = queries.tenant_page(search, sort, request.GET.get("page", 1))
    rows = [{"tenant": t, "used": t.month_tokens, "limits": queries.limits_state(t),
             "used_pct": queries.budget_pct(t.month_tokens, t.tier.monthly_token_budget)} for t in page]
    return render(request, "console/tenants.html", {
        "section": "tenants", "rows": rows, "page": page, "q": search, "sort": sort,
        "sorts": queries.TENANT_SORTS, "tiers": QuotaTier.objects.all()})


def _tenant_page(request: HttpRequest, tenant: Tenant, issued: actions.IssuedKey | None = None) -> HttpResponse:
    by_lane = queries.usage_by_lane(tenant)
    response = render(request, "console/tenant_detail.html", {
        "section": "tenants",
        "tenant": tenant,
        "used": queries.tokens_this_month().get(tenant.pk, 0),
        "limits": queries.limits_state(tenant),
        "by_day": queries.usage_by_day(tenant),
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


# A tenant's on/off switches: the action that writes each (audited), and what the operator is told.
SWITCHES = {
    "active": (actions.set_active, lambda name, on: f"{name} is {'active again' if on else 'deactivated: its keys are refused'}."),
    "debug-capture": (actions.set_debug_capture, lambda name, on: f"Debug capture for {name} is "
                      f"{'on: its prompts are stored' if on else 'off; its captured prompts are deleted'}."),
}


@staff_member_required
@requires(post="tenants.change_tenant")
@require_POST
def switch_tenant(request: HttpRequest, pk: int, switch: str) -> HttpResponse:
    """Turn one of the tenant's switches on or off (POST `on` = 1 or 0): deactivate or
    reactivate it, or start or stop capturing its prompts (stopping deletes them)."""
    tenant = get_object_or_404(Tenant, pk=pk)
    write, told = SWITCHES[switch]
    on = request.POST.get("on") == "1"
    write(tenant, on, actor=request.user.get_username())
    messages.success(request, told(tenant.name, on))
    return redirect("console:tenant", pk=pk)


@staff_member_required
@requires(get="batches.view_batch")
@require_GET
def batches(request: HttpRequest) -> HttpResponse:
    rows = queries.batch_rows()
    active = any(_moving(row["batch"]) for row in rows)
    return render(request, "console/batches.html", {"section": "batches", "rows": rows, "active": active})


def _moving(batch: Batch) -> bool:
    """Whether the batch's page is worth reloading: its items still change state."""
    return batch.status in Batch.ACTIVE or batch.status == Batch.Status.VALIDATING


@staff_member_required
@requires(get="batches.view_batch")
@require_GET
def batch_detail(request: HttpRequest, batch_id: str) -> HttpResponse:
    batch = get_object_or_404(Batch.objects.select_related("tenant"), pk=batch_id)
    counts = queries.item_counts([batch.id])[batch.id]
    progress = queries.progress(counts)
    usage = batch_actions.batch_usage(batch)
    files = {kind: file for kind, file in _batch_files(batch).items() if file is not None}
    return render(request, "console/batch_detail.html", {
        "section": "batches", "batch": batch, "progress": progress, "usage": usage, "files": files,
        "by_state": [(s.value, counts.get(s.value, 0)) for s in BatchItem.State],
        "pace": queries.pace(batch, progress.done, progress.total, usage["total_tokens"]),
        "failed": queries.failed_items(batch), "failed_shown": queries.FAILED_SHOWN,
        "cancellable": queries.cancellable(batch), "moving": _moving(batch),
    })


def _batch_files(batch: Batch) -> dict[str, File | None]:
    """The batch's input, output and error files (content deferred: the page lists them only)."""
    ids = {"input": batch.input_file_id, "output": batch.output_file_id, "error": batch.error_file_id}
    found = {f.pk: f for f in File.objects.filter(tenant_id=batch.tenant_id, pk__in=[i for i in ids.values() if i])
             .defer("content")}
    return {kind: found.get(file_id) for kind, file_id in ids.items()}


@staff_member_required
@requires(get="batches.view_batch")
@require_GET
def batch_file(request: HttpRequest, batch_id: str, kind: str) -> HttpResponse:
    """A batch's input, output or error file as a download, streamed as GET /v1/files/{id}/content
    streams it: read whole, a 100 MiB output file was held in the web process three times over."""
    batch = get_object_or_404(Batch, pk=batch_id)
    file = _batch_files(batch).get(kind)
    if file is None:
        raise Http404(f"Batch {batch_id} has no {kind} file.")
    try:
        return streamed_file(file, ("console", request.user.pk))
    except ApiError as error:
        return HttpResponse(error.message, status=error.status, headers=error.headers, content_type="text/plain")


@staff_member_required
@requires(get="batches.view_batch")
@require_GET
@never_cache
def workers(request: HttpRequest) -> HttpResponse:
    """Celery workers online, queue depths, items running per worker, the last sweep, alerts.
    Bounded: a broker or workers that are away cost the page about three seconds, not a hang."""
    return render(request, "console/workers.html", {"section": "workers", "state": console_workers.read(),
                                                    "now": timezone.now()})


def _tail_filter(params) -> queries.TailFilter:
    lane = params.get("lane", "")
    try:
        limit = int(params.get("n") or queries.TAIL_DEFAULT)
    except ValueError:
        limit = queries.TAIL_DEFAULT
    return queries.TailFilter(tenant=params.get("tenant", "").strip()[:128], endpoint=params.get("endpoint", "").strip()[:64],
                              lane=int(lane) if lane in ("0", "1", "2") else None,
                              status=params.get("status", "").strip()[:32], key_prefix=params.get("key", "").strip()[:40],
                              limit=limit)


@staff_member_required
@requires(get="tenants.view_tenant")
@require_GET
@never_cache
def requests_tail(request: HttpRequest) -> HttpResponse:
    """The newest requests across tenants; `?rows=1` renders the table body alone, which the
    page fetches every two seconds to stay live."""
    tail = _tail_filter(request.GET)
    found = queries.request_tail(tail)
    context = {"section": "requests", "rows": found.rows, "refusals_error": found.refusals_error, "filter": tail,
               "lanes": Lane.choices, "limit_max": queries.TAIL_MAX, "refusals_kept": settings.REFUSALS_KEPT,
               "refusal_statuses": ("400", "401", "403", "404", "413", "429", "503")}
    if request.GET.get("rows") == "1":
        return render(request, "console/_request_rows.html", context)
    return render(request, "console/requests.html", context)


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
    return redirect("console:batch", batch_id=batch.id)


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
        # The tier's lane or a lower one: the API refuses a better lane than the tier's.
        context["lanes"] = [(value, label) for value, label in Lane.choices if value >= tenant.tier.lane]
    return render(request, "console/playground.html", context)
