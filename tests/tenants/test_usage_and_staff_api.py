"""Usage read back (GET /v1/usage, export_usage), the staff admin API, its audit log and the
operators' commands (issue 23), in process on a real Redis."""
import csv
import io
import json
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from rest_framework.test import APIClient

from tenants import actions
from tenants.models import ApiKey, AuditEntry, Tenant, UsageRecord

T0 = datetime(2030, 3, 4, 10, 0, tzinfo=dt_timezone.utc)  # a whole hour, in the future of any real row


def _rows(tenant, api_key) -> None:
    """Six rows over two days and three hours, two models, two lanes, with and without the key."""
    spec = [(T0 + timedelta(minutes=5), "m-a", 1, api_key, 10, 20, 4),
            (T0 + timedelta(minutes=50), "m-a", 1, api_key, 11, 21, 0),
            (T0 + timedelta(hours=1, minutes=1), "m-b", 1, api_key, 12, 22, 8),
            (T0 + timedelta(hours=2), "m-a", 2, None, 13, 23, 0),
            (T0 + timedelta(days=1), "m-b", 2, None, 14, 24, 0),
            (T0 + timedelta(days=1, hours=3), "m-a", 1, api_key, 15, 25, 15)]
    for created, model, lane, key, prompt, completion, cached in spec:
        row = actions.record_usage(tenant, lane=lane, prompt_tokens=prompt, completion_tokens=completion,
                                   api_key=key, model=model, endpoint="/v1/chat/completions", cached_tokens=cached)
        UsageRecord.objects.filter(pk=row.pk).update(created=created)


def _epoch(at: datetime) -> int:
    return int(at.timestamp())


def _sum(page: dict, field: str) -> int:
    return sum(result[field] for bucket in page["data"] for result in bucket["results"])


def test_usage_buckets_sum_to_the_usage_records_by_hour_and_by_day(make_tenant, client_for):
    tenant, issued = make_tenant("acme")
    _rows(tenant, issued.api_key)
    other, _ = make_tenant("other")
    actions.record_usage(other, lane=1, prompt_tokens=999, completion_tokens=999)  # never in acme's usage
    UsageRecord.objects.filter(tenant=other).update(created=T0 + timedelta(minutes=1))
    client = client_for(issued.plaintext)
    start, end = _epoch(T0 + timedelta(minutes=30)), _epoch(T0.replace(hour=0) + timedelta(days=2))

    by_day = client.get("/v1/usage", {"start_time": start, "end_time": end}).json()
    assert by_day["object"] == "page" and [b["start_time"] for b in by_day["data"]] == [
        _epoch(T0.replace(hour=0)), _epoch(T0.replace(hour=0) + timedelta(days=1))]  # aligned to UTC midnight
    rows = UsageRecord.objects.filter(tenant=tenant)
    assert _sum(by_day, "input_tokens") == sum(r.prompt_tokens for r in rows) == 75
    assert _sum(by_day, "output_tokens") == sum(r.completion_tokens for r in rows)
    assert _sum(by_day, "input_cached_tokens") == 27 and _sum(by_day, "num_model_requests") == 6

    by_hour = client.get("/v1/usage", {"start_time": start, "end_time": end, "bucket_width": "1h", "limit": 48,
                                       "group_by": "model,lane"}).json()
    assert len(by_hour["data"]) == 38 and not by_hour["has_more"]  # 10:00 on day 1 .. 23:00 on day 2
    first = by_hour["data"][0]
    assert first["start_time"] == _epoch(T0)
    assert [(r["model"], r["lane"], r["input_tokens"], r["num_model_requests"]) for r in first["results"]] == [
        ("m-a", 1, 21, 2)]
    assert by_hour["data"][4]["results"] == []  # 14:00: nothing
    assert _sum(by_hour, "input_tokens") == 75

    by_key = client.get("/v1/usage", {"start_time": start, "end_time": end, "group_by": "key"}).json()
    keyed = [r for b in by_key["data"] for r in b["results"] if r["api_key_id"] == f"sk-{issued.api_key.prefix}"]
    assert sum(r["input_tokens"] for r in keyed) == 10 + 11 + 12 + 15

    paged = client.get("/v1/usage", {"start_time": start, "end_time": end, "bucket_width": "1h", "limit": 24}).json()
    assert paged["has_more"] and len(paged["data"]) == 24
    rest = client.get("/v1/usage", {"page": paged["next_page"], "end_time": end, "bucket_width": "1h",
                                    "limit": 24}).json()
    assert _sum(paged, "input_tokens") + _sum(rest, "input_tokens") == 75


@pytest.mark.parametrize("params, param", [
    ({}, "start_time"),
    ({"start_time": "yesterday"}, "start_time"),
    ({"start_time": 100, "end_time": 50}, "end_time"),
    ({"start_time": 100, "bucket_width": "1w"}, "bucket_width"),
    ({"start_time": 100, "group_by": "project_id"}, "group_by"),
    ({"start_time": 100, "bucket_width": "1d", "limit": 32}, "limit"),
])
def test_a_bad_usage_query_is_a_400_naming_the_parameter(make_tenant, client_for, params, param):
    _, issued = make_tenant("acme")
    response = client_for(issued.plaintext).get("/v1/usage", params)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_export_usage_round_trips(make_tenant, fmt, tmp_path):
    tenant, issued = make_tenant("acme")
    _rows(tenant, issued.api_key)
    out = tmp_path / f"usage.{fmt}"
    call_command("export_usage", "--since", "2030-03-04", "--until", "2030-03-05T13:00:01", "--format", fmt,
                 "--output", str(out), stderr=io.StringIO())
    text = out.read_text()
    exported = list(csv.DictReader(io.StringIO(text))) if fmt == "csv" else [json.loads(line) for line in text.splitlines()]
    rows = UsageRecord.objects.filter(tenant=tenant).order_by("created", "pk")
    assert len(exported) == rows.count() == 6
    for line, row in zip(exported, rows, strict=True):
        assert int(line["id"]) == row.pk
        assert datetime.fromisoformat(line["created"]) == row.created
        assert (line["tenant"], line["model"], line["endpoint"]) == ("acme", row.model, "/v1/chat/completions")
        assert [int(line[f]) for f in ("prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "lane")] \
            == [row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.total_tokens, row.lane]
        assert line["api_key"] == (f"sk-{issued.api_key.prefix}" if row.api_key_id else ("" if fmt == "csv" else None))
    # --until is exclusive and --tenant narrows.
    stdout = io.StringIO()
    call_command("export_usage", "--since", "2030-03-04", "--until", "2030-03-05", "--format", "jsonl",
                 "--tenant", "acme", stdout=stdout, stderr=io.StringIO())
    assert len(stdout.getvalue().splitlines()) == 4


# --- the staff admin API ------------------------------------------------------------------------


@pytest.fixture
def operator(settings) -> APIClient:
    settings.OPERATOR_API_TOKEN = "op-token-for-tests"
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer op-token-for-tests")
    return client


def test_a_tier_change_through_the_admin_api_is_in_the_audit_log_with_before_and_after(make_tier, make_tenant, operator):
    tenant, _ = make_tenant("acme", make_tier("small"))
    make_tier("large", requests_per_minute=1000)
    changed = operator.patch(f"/api/v1/admin/tenants/{tenant.pk}", {"tier": "large"}, format="json")
    assert changed.status_code == 200 and changed.json()["tier"] == "large"
    assert Tenant.objects.get(pk=tenant.pk).tier.name == "large"
    log = operator.get("/api/v1/admin/audit", {"target": f"tenant:{tenant.pk}"}).json()["data"]
    assert log[0]["action"] == "tenant.change_tier" and log[0]["actor"] == "operator-token"
    assert (log[0]["before"]["tier"], log[0]["after"]["tier"]) == ("small", "large")
    assert AuditEntry.objects.filter(target=f"tenant:{tenant.pk}").count() == 1  # make_tenant has no actor


def test_the_admin_api_issues_rotates_and_revokes_keys_and_edits_tiers(make_tier, make_tenant, operator, client_for):
    tenant, _ = make_tenant("acme", make_tier("small"))
    issued = operator.post(f"/api/v1/admin/tenants/{tenant.pk}/keys",
                           {"name": "ci", "scopes": ["read"], "requests_per_minute": 5}, format="json")
    assert issued.status_code == 201 and issued["Cache-Control"] == "no-store"
    body = issued.json()
    assert body["secret"].startswith(body["key_prefix"] + "_") and body["scopes"] == ["read"]
    assert client_for(body["secret"]).get("/v1/batches").status_code == 200
    listed = operator.get(f"/api/v1/admin/tenants/{tenant.pk}/keys").json()["data"]
    assert all("secret" not in key for key in listed) and body["id"] in [key["id"] for key in listed]

    rotated = operator.post(f"/api/v1/admin/keys/{body['id']}/rotate", {"grace_s": 3600}, format="json").json()
    assert rotated["scopes"] == ["read"] and rotated["requests_per_minute"] == 5
    again = operator.post(f"/api/v1/admin/keys/{body['id']}/rotate", {}, format="json")
    assert (again.status_code, again.json()["error"]["code"]) == (409, "key_not_rotatable")
    revoked = operator.post(f"/api/v1/admin/keys/{rotated['id']}/revoke")
    assert revoked.json()["revoked"] is not None
    assert client_for(rotated["secret"]).get("/v1/batches").status_code == 401

    tier = operator.patch("/api/v1/admin/tiers/small", {"requests_per_minute": 7}, format="json")
    assert tier.status_code == 200 and tier.json()["requests_per_minute"] == 7
    assert tier.json()["tokens_per_minute"] == 10_000  # the rest kept
    bad = operator.patch("/api/v1/admin/tiers/small", {"lane": 9}, format="json")
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "lane")
    actions_logged = set(AuditEntry.objects.values_list("action", flat=True))
    assert {"key.issue", "key.rotate", "key.revoke", "tier.update"} <= actions_logged
    created = operator.post("/api/v1/admin/tenants", {"name": "newco", "tier": "small"}, format="json")
    assert created.status_code == 201
    found = operator.get("/api/v1/admin/tenants", {"search": "new"}).json()
    assert [t["name"] for t in found["data"]] == ["newco"] and found["total"] == 1


def test_the_admin_api_holds_staff_to_their_model_permissions(make_tenant, db):
    tenant, _ = make_tenant("acme")
    anonymous = APIClient()
    assert anonymous.get("/api/v1/admin/tenants").status_code in (401, 403)
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_tenant"))
    session = APIClient(enforce_csrf_checks=True)
    session.force_login(user)
    assert session.get("/api/v1/admin/tenants").status_code == 200
    refused = session.patch(f"/api/v1/admin/tenants/{tenant.pk}", {"is_active": False}, format="json")
    assert refused.status_code == 403  # no change_tenant (and no CSRF token either)
    assert Tenant.objects.get(pk=tenant.pk).is_active
    tenant_key = APIClient()
    tenant_key.credentials(HTTP_AUTHORIZATION=f"Bearer {actions.issue_key(tenant).plaintext}")
    assert tenant_key.get("/api/v1/admin/tenants").status_code in (401, 403)  # a tenant's key is no staff


def test_operators_commands_list_revoke_and_deactivate(make_tenant, client_for):
    tenant, issued = make_tenant("acme")
    actions.record_usage(tenant, lane=1, prompt_tokens=7, completion_tokens=8)
    out = io.StringIO()
    call_command("list_tenants", "--json", stdout=out)
    [row] = [json.loads(line) for line in out.getvalue().splitlines()]
    assert (row["name"], row["live_keys"], row["month_tokens"], row["active"]) == ("acme", 1, 15, True)

    call_command("revoke_key", f"sk-{issued.api_key.prefix}", stdout=io.StringIO())
    assert client_for(issued.plaintext).get("/v1/models").status_code == 401
    fresh = actions.issue_key(tenant)
    call_command("deactivate_tenant", "acme", stdout=io.StringIO())
    assert client_for(fresh.plaintext).get("/v1/models").status_code == 401
    call_command("deactivate_tenant", "acme", "--reactivate", stdout=io.StringIO())
    assert client_for(fresh.plaintext).get("/v1/models").status_code == 200
    logged = list(AuditEntry.objects.order_by("pk").values_list("action", "actor"))
    assert [action for action, _ in logged] == ["key.revoke", "tenant.deactivate", "tenant.reactivate"]
    assert all(actor.startswith("manage.py") for _, actor in logged)
    assert ApiKey.objects.get(pk=issued.api_key.pk).revoked is not None
