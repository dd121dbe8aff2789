"""Console v2's pages with Django's test client on a real database and Redis: numbers as
operators read them, tenants searched, sorted and paged in a fixed number of queries, a
tenant deactivated through the audited action, a batch's detail and downloads, the
workers panel with and without workers or Redis, and the requests tail.
(test_browser.py drives the same pages in Chromium.)"""
from __future__ import annotations

import re

import pytest
from django.test import override_settings
from django.urls import reverse

from batches import actions as batch_actions
from batches.models import Batch, BatchItem, File
from batches.views import DOWNLOAD_CHUNK
from console.templatetags.numbers import abbrev
from tenants import actions
from tenants.models import AuditEntry, Tenant
from tests.batches.test_batch_states import (  # noqa: F401 (fixtures: broker keeps sends on the test Redis)
    QUEUE, batch_underway, broker, claim, item_at, start_batch,
)

pytestmark = pytest.mark.django_db

State, Status = BatchItem.State, Batch.Status


@pytest.fixture
def tier():
    tier, _ = actions.save_tier("console-pages", lane=2, requests_per_minute=1000, tokens_per_minute=2_500_000,
                                concurrent_streams=4, max_tokens_per_request=256, monthly_token_budget=10**12,
                                allow_batch=True)
    return tier


@pytest.fixture
def tenant(tier) -> Tenant:
    return actions.create_tenant("acme", tier)


def rows_of(page: str, table: str) -> list[str]:
    body = re.search(rf'<table id="{table}">.*?<tbody[^>]*>(.*?)</tbody>', page, re.S).group(1)
    return re.findall(r"<tr\b.*?</tr>", body, re.S)


def text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()


# --- numbers ------------------------------------------------------------------------------


def test_budgets_and_usage_read_abbreviated_with_the_exact_figure_on_hover(admin_client, tenant):
    actions.record_usage(tenant, lane=2, prompt_tokens=1_000_000, completion_tokens=234_567)
    page = admin_client.get(reverse("console:tenant", kwargs={"pk": tenant.pk})).content.decode()
    assert "1000000000000" not in text(page)
    assert '<span title="1,000,000,000,000 tokens" data-value="1000000000000">1T</span>' in page
    assert '<span title="1,234,567 tokens" data-value="1234567">1.2M</span>' in page
    listing = admin_client.get(reverse("console:tenants")).content.decode()
    [row] = rows_of(listing, "tenants")
    assert "1.2M tokens" not in row and "1.2M / 1T" in text(row)
    assert "/ 2.5M" in text(row)  # tokens per minute


def test_a_figure_that_rounds_to_1000_of_a_unit_reads_as_the_next_unit():
    assert [abbrev(v) for v in (999, 1_234, 999_499, 999_999, 1_250_000, 10**12)] == ["999", "1.2k", "999k", "1M", "1.2M", "1T"]


# --- tenants: search, sort, pages, queries --------------------------------------------------


def test_200_tenants_are_searched_sorted_by_usage_and_paged_in_a_fixed_number_of_queries(
        admin_client, tier, django_assert_max_num_queries):
    tenants = [actions.create_tenant(f"tenant-{i:03d}", tier) for i in range(200)]
    for i, t in enumerate(tenants[::20]):  # ten of them used something, tenant-180 the most
        actions.record_usage(t, lane=2, prompt_tokens=10 * (i + 1), completion_tokens=1)
    # Session, user, permissions, the count, the page, the tiers of the form: not one per row.
    with django_assert_max_num_queries(8):
        page = admin_client.get(reverse("console:tenants"), {"sort": "usage"}).content.decode()
    rows = rows_of(page, "tenants")
    assert len(rows) == 50
    assert [re.search(r">(tenant-\d+)</a>", r).group(1) for r in rows[:3]] == ["tenant-180", "tenant-160", "tenant-140"]
    assert "200 tenants, page 1 of 4." in page
    last = admin_client.get(reverse("console:tenants"), {"sort": "usage", "page": 4}).content.decode()
    assert len(rows_of(last, "tenants")) == 50 and 'rel="prev"' in last and 'rel="next"' not in last

    found = admin_client.get(reverse("console:tenants"), {"q": "nt-19"}).content.decode()
    assert [re.search(r">(tenant-\d+)</a>", r).group(1) for r in rows_of(found, "tenants")] == \
        [f"tenant-{i}" for i in range(190, 200)]
    none = admin_client.get(reverse("console:tenants"), {"q": "globex"}).content.decode()
    assert "No tenant matches “globex”." in none


def test_deactivating_a_tenant_refuses_its_keys_and_is_audited_with_the_operator(admin_client, tenant, client):
    secret = actions.issue_key(tenant, name="app").plaintext
    url = reverse("console:set-active", kwargs={"pk": tenant.pk})
    page = admin_client.get(reverse("console:tenant", kwargs={"pk": tenant.pk})).content.decode()
    assert 'data-confirm="Deactivate acme? Its keys are refused at once."' in page

    admin_client.post(url, {"on": "0"})
    assert client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {secret}").status_code == 401
    entry = AuditEntry.objects.filter(target=f"tenant:{tenant.pk}").first()
    assert (entry.action, entry.actor) == ("tenant.deactivate", "admin")

    admin_client.post(url, {"on": "1"})
    assert client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {secret}").status_code == 200
    assert AuditEntry.objects.filter(target=f"tenant:{tenant.pk}").first().action == "tenant.reactivate"


def test_deactivating_needs_the_change_permission(client, django_user_model, tenant):
    viewer = django_user_model.objects.create_user("viewer", password="pw-viewer-1", is_staff=True)
    viewer.user_permissions.add(*__import__("django.contrib.auth.models", fromlist=["Permission"]).Permission
                                .objects.filter(codename="view_tenant"))
    client.force_login(viewer)
    page = client.get(reverse("console:tenant", kwargs={"pk": tenant.pk})).content.decode()
    assert 'id="set-active"' not in page
    for name, on in (("set-active", "0"), ("debug-capture", "1")):
        assert client.post(reverse(f"console:{name}", kwargs={"pk": tenant.pk}), {"on": on}).status_code == 403
    assert Tenant.objects.get(pk=tenant.pk).is_active and not Tenant.objects.get(pk=tenant.pk).debug_capture


# --- batches ------------------------------------------------------------------------------


def test_a_cancelled_batch_shows_what_ended_how_not_a_full_bar(admin_client, tenant):
    batch, [(refused, token), _] = batch_underway(tenant, 6, finished=2, running=2)  # lines 5 and 6 queued
    assert batch_actions.finish(refused, token, 400, "req-refused",
                                {"error": {"message": "max_tokens is too large", "type": "invalid_request_error"}})
    admin_client.post(reverse("console:cancel-batch", kwargs={"batch_id": batch.id}))
    page = admin_client.get(reverse("console:batch", kwargs={"batch_id": batch.id})).content.decode()
    bar = re.search(r'<div id="batch-progress">(.*?)</div>', page, re.S).group(1)
    # Two succeeded, one failed, two queued ones cancelled at once, one still running until its worker sees it.
    assert re.findall(r'data-state="(\w+)" data-items="(\d+)"', bar) == [
        ("succeeded", "2"), ("failed", "1"), ("cancelled", "2"), ("running", "1")]
    assert 'aria-label="2 succeeded, 1 failed, 2 cancelled, 1 running of 6"' in bar
    counts = dict(re.findall(r'data-state="(\w+)">(\d+)</td>', page))
    assert counts == {"queued": "0", "running": "1", "succeeded": "2", "failed": "1", "cancelled": "2", "expired": "0"}
    [failed] = rows_of(page, "failed")
    assert text(failed) == "3 req-2 400 invalid_request_error max_tokens is too large"
    assert 'id="cancel-batch"' not in page  # cancelling already

    listing = admin_client.get(reverse("console:batches")).content.decode()
    assert 'data-state="cancelled" data-items="2"' in listing


# Committed data: downloads read their slices on a pool of their own, whose connections see no
# test transaction's rows. The test client reads their async stream synchronously, and says so.
SYNC_READ = pytest.mark.filterwarnings("ignore:StreamingHttpResponse must consume asynchronous iterators")


@SYNC_READ
@pytest.mark.django_db(transaction=True)
def test_a_batchs_files_download_with_the_bytes_the_api_gives(admin_client, tenant, client):
    batch, [(refused, token)] = batch_underway(tenant, 3, finished=2, running=1)
    assert batch_actions.finish(refused, token, 400, "req-x", {"error": {"message": "no", "code": "bad"}})
    batch.refresh_from_db()
    assert batch.status == Status.COMPLETED
    secret = actions.issue_key(tenant, name="reader").plaintext
    page = admin_client.get(reverse("console:batch", kwargs={"batch_id": batch.id})).content.decode()
    for kind, file_id in (("input", batch.input_file_id), ("output", batch.output_file_id), ("error", batch.error_file_id)):
        link = reverse("console:batch-file", kwargs={"batch_id": batch.id, "kind": kind})
        assert f'href="{link}" download' in page
        download = admin_client.get(link)
        assert download["Content-Disposition"].startswith("attachment; filename=")
        stored = bytes(File.objects.get(pk=file_id).content)
        api = client.get(f"/v1/files/{file_id}/content", HTTP_AUTHORIZATION=f"Bearer {secret}")
        assert api.status_code == 200 and api["Content-Length"] == str(len(stored))
        assert b"".join(download) == b"".join(api) == stored
        assert stored.count(b"\n") == {"input": 3, "output": 2, "error": 1}[kind]
    running, _ = batch_underway(tenant, 2, finished=0, running=1)
    assert admin_client.get(reverse("console:batch-file", kwargs={"batch_id": running.id, "kind": "output"})).status_code == 404


@SYNC_READ
@pytest.mark.django_db(transaction=True)
def test_a_large_batch_file_downloads_from_the_console_a_slice_at_a_time(admin_client, tenant):
    """Read whole, a staff user's download of a 100 MiB output file was held in the web process
    (shared with every tenant) three times over; it streams as the API's downloads do."""
    batch, _ = batch_underway(tenant, 2, finished=2, running=0)
    batch.refresh_from_db()
    content = b"".join(b'{"custom_id": "%d", "response": {"body": "%s"}}\n' % (i, b"x" * 200) for i in range(15_000))
    File.objects.filter(pk=batch.output_file_id).update(content=content, bytes=len(content))
    response = admin_client.get(reverse("console:batch-file", kwargs={"batch_id": batch.id, "kind": "output"}))
    assert response.status_code == 200 and response.streaming
    assert response["Content-Length"] == str(len(content))
    parts = list(response)
    assert len(parts) == -(-len(content) // DOWNLOAD_CHUNK) and max(map(len, parts)) == DOWNLOAD_CHUNK
    assert b"".join(parts) == content


def test_a_running_batch_shows_its_pace_and_is_cancelled_from_its_page(admin_client, tenant):
    batch, _ = batch_underway(tenant, 4, finished=2, running=1)
    page = admin_client.get(reverse("console:batch", kwargs={"batch_id": batch.id})).content.decode()
    pace = text(re.search(r'<div class="card" id="pace">(.*?)</div></div>', page, re.S).group(0))
    assert re.search(r"[\d.]+ requests/min · [\d.]+ tokens/s ETA \d+:\d\d:\d\d at this rate", pace), pace
    response = admin_client.post(reverse("console:cancel-batch", kwargs={"batch_id": batch.id}))
    assert response["Location"] == reverse("console:batch", kwargs={"batch_id": batch.id})
    assert Batch.objects.get(pk=batch.id).status == Status.CANCELLING
    entry_page = admin_client.get(response["Location"]).content.decode()
    assert 'id="pace"' not in entry_page and "cancelling" in entry_page


# --- workers ------------------------------------------------------------------------------


def test_the_workers_panel_alerts_when_no_worker_answers_while_items_are_queued(admin_client, tenant, broker):
    start_batch(tenant, 3)
    batch_actions.sweep()  # sends the items' messages, which wait on the queue: no worker runs here
    page = admin_client.get(reverse("console:workers")).content.decode()
    assert "No worker answers while 3 batch items are queued" in page
    assert text(rows_of(page, "workers")[0]) == "No worker answered."
    [queue] = rows_of(page, "queues")
    assert text(queue) == f"celery {broker.llen(QUEUE)}" and broker.llen(QUEUE) == 3
    assert re.search(r"\d+ s ago: 3 sent, 0 resent, 0 requeued, 0 expired, 0 finalized again", text(page))


def test_the_workers_panel_renders_and_says_so_when_redis_is_away(admin_client, tenant):
    from config.celery import app

    previous = app.conf.broker_url
    app.conf.broker_url = "redis://127.0.0.1:1/0"
    try:
        with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):
            page = admin_client.get(reverse("console:workers")).content.decode()
    finally:
        app.conf.broker_url = previous
    assert "Redis (the broker) does not answer" in page
    assert text(rows_of(page, "queues")[0]) == "Redis does not answer."


# --- requests -----------------------------------------------------------------------------


def test_the_requests_tail_lists_the_newest_requests_across_tenants_filtered(admin_client, tenant, tier):
    globex = actions.create_tenant("globex", tier)
    key = actions.issue_key(tenant, name="app").api_key
    actions.record_usage(tenant, lane=1, prompt_tokens=12, completion_tokens=30, api_key=key, ttft_ms=41, latency_ms=380,
                         finish_reason="stop", endpoint="/v1/chat/completions", request_id="req-acme")
    actions.record_usage(globex, lane=2, prompt_tokens=7, completion_tokens=0, ttft_ms=None, latency_ms=15,
                         finish_reason="abort", endpoint="/v1/completions", request_id="req-globex")
    page = admin_client.get(reverse("console:requests")).content.decode()
    rows = rows_of(page, "requests")
    assert [re.search(r'data-request="([^"]+)"', r).group(1) for r in rows] == ["req-globex", "req-acme"]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", rows[1], re.S)
    assert [text(c) for c in cells[1:]] == ["acme", f"sk-{key.prefix}_…", "/v1/chat/completions", "P1", "stop",
                                            "12", "30", "41 ms", "380 ms", "–"]
    only = admin_client.get(reverse("console:requests"), {"tenant": "glob", "rows": "1"}).content.decode()
    assert "req-globex" in only and "req-acme" not in only and "<html" not in only
    by_key = admin_client.get(reverse("console:requests"), {"key": f"sk-{key.prefix}"}).content.decode()
    assert [re.search(r'data-request="([^"]+)"', r).group(1) for r in rows_of(by_key, "requests")] == ["req-acme"]
    aborted = admin_client.get(reverse("console:requests"), {"status": "abort", "lane": "2"}).content.decode()
    assert [re.search(r'data-request="([^"]+)"', r).group(1) for r in rows_of(aborted, "requests")] == ["req-globex"]


def test_a_capture_left_on_keeps_only_the_tenants_newest_prompts(tenant, tier, settings):
    """Capture had no bound on its count: a busy tenant left captured stored every prompt it
    sent, 20,000 characters each. Now each tenant keeps its newest DEBUG_CAPTURES_KEPT."""
    from tenants.models import PromptCapture

    settings.DEBUG_CAPTURES_KEPT = 3
    globex = actions.create_tenant("globex", tier)
    for owner in (tenant, globex):
        actions.set_debug_capture(owner, True)
    actions.capture_prompt(globex.pk, "req-globex", "[]")
    for i in range(5):
        actions.capture_prompt(tenant.pk, f"req-{i}", "[]")
    kept = PromptCapture.objects.filter(tenant=tenant).order_by("pk").values_list("request_id", flat=True)
    assert list(kept) == ["req-2", "req-3", "req-4"]
    assert list(PromptCapture.objects.filter(tenant=globex).values_list("request_id", flat=True)) == ["req-globex"]


def test_debug_capture_is_off_by_default_stores_prompts_only_while_on_and_deletes_them_when_turned_off(
        admin_client, tenant, tier):
    from tenants.models import PromptCapture

    globex = actions.create_tenant("globex", tier)
    assert not tenant.debug_capture
    actions.capture_prompt(tenant.pk, "req-before", '[{"role": "user", "content": "not stored"}]')
    assert not PromptCapture.objects.exists()

    page = admin_client.get(reverse("console:tenant", kwargs={"pk": tenant.pk})).content.decode()
    assert 'data-confirm="Capture acme\'s prompts? Each request' in page
    admin_client.post(reverse("console:debug-capture", kwargs={"pk": tenant.pk}), {"on": "1"})
    assert AuditEntry.objects.filter(target=f"tenant:{tenant.pk}").first().action == "tenant.debug_capture_on"
    for owner, request_id in ((tenant, "req-acme"), (globex, "req-globex")):
        actions.capture_prompt(owner.pk, request_id, '[{"role": "user", "content": "the secret recipe"}]')
        actions.record_usage(owner, lane=1, prompt_tokens=5, completion_tokens=1, request_id=request_id,
                             endpoint="/v1/chat/completions", finish_reason="stop")
    tail = admin_client.get(reverse("console:requests")).content.decode()
    rows = {re.search(r'data-request="([^"]+)"', r).group(1): r for r in rows_of(tail, "requests")}
    assert "the secret recipe" in rows["req-acme"] and "the secret recipe" not in rows["req-globex"]

    admin_client.post(reverse("console:debug-capture", kwargs={"pk": tenant.pk}), {"on": "0"})
    entry = AuditEntry.objects.filter(target=f"tenant:{tenant.pk}").first()
    assert (entry.action, entry.after) == ("tenant.debug_capture_off", {"debug_capture": False, "captures_deleted": 1})
    assert not PromptCapture.objects.exists()
    assert "the secret recipe" not in admin_client.get(reverse("console:requests")).content.decode()
