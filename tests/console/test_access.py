"""The console's pages are for staff only, its writes need CSRF, and a new key's secret
is shown once: checked with Django's test client on a real database and Redis.
(The browser tests in test_browser.py drive the same pages in Chromium.)"""
import re
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import URLPattern, reverse
from django.utils import timezone

from batches.models import Batch, File
from console.urls import urlpatterns
from tenants import actions
from tenants.models import ApiKey, Tenant
from tests.tenants.test_keys import assert_not_stored

pytestmark = pytest.mark.django_db

LOGIN = "/admin/login/"


@pytest.fixture(autouse=True)
def _redis(redis):
    return redis


@pytest.fixture
def tenant() -> Tenant:
    tier, _ = actions.save_tier("console-test", lane=1, requests_per_minute=100, tokens_per_minute=10_000,
                                concurrent_streams=2, max_tokens_per_request=256, monthly_token_budget=1_000_000)
    return actions.create_tenant("acme", tier)


def every_console_url(tenant: Tenant) -> list[str]:
    """Each console URL pattern with its arguments filled in, so a new page cannot be missed."""
    key = actions.issue_key(tenant, name="probe").api_key
    # A finished batch's rows as they stand (no worker here to run one): its pages and its file exist.
    output = File.objects.create(tenant=tenant, purpose=File.Purpose.BATCH_OUTPUT, filename="out.jsonl", content=b"{}\n",
                                 bytes=3)
    batch = Batch.objects.create(tenant=tenant, endpoint="/v1/chat/completions", input_file_id="file-none",
                                 status=Batch.Status.COMPLETED, output_file=output,
                                 expires_at=timezone.now() + timedelta(hours=24))
    values = {"pk": tenant.pk, "key_pk": key.pk, "batch_id": batch.id, "kind": "output"}
    urls = []
    for pattern in urlpatterns:
        assert isinstance(pattern, URLPattern)
        names = pattern.pattern.converters
        urls.append(reverse(f"console:{pattern.name}", kwargs={name: values[name] for name in names}))
    return urls


def test_anonymous_and_non_staff_visitors_are_sent_to_the_login_on_every_page(tenant, django_user_model):
    urls = every_console_url(tenant)
    assert len(urls) == len(urlpatterns) >= 14
    django_user_model.objects.create_user("mallory", password="pw-mallory-1")
    member = Client()
    assert member.login(username="mallory", password="pw-mallory-1")
    keys_before = ApiKey.objects.count()
    for client, who in ((Client(), "anonymous"), (member, "non-staff")):
        for url in urls:
            for method in (client.get, client.post):
                response = method(url, {"name": "evil", "tier": tenant.tier.pk, "tenant": tenant.pk})
                if url == "/console/":
                    assert response.status_code == 302  # the index only redirects to the engine page
                    continue
                assert response.status_code == 302, (who, method.__name__, url, response.status_code)
                assert response["Location"].startswith(f"{LOGIN}?next="), (who, url, response["Location"])
    # Nothing was written on their behalf.
    assert ApiKey.objects.count() == keys_before
    assert not ApiKey.objects.filter(revoked__isnull=False).exists()
    assert not Tenant.objects.filter(name="evil").exists()
    assert Tenant.objects.get(pk=tenant.pk).tier_id == tenant.tier_id


# Committed data: a batch file's download reads its slices on a pool of its own, whose connections
# see no test transaction's rows; the test client reads that async stream synchronously, and says so.
@pytest.mark.filterwarnings("ignore:StreamingHttpResponse must consume asynchronous iterators")
@pytest.mark.django_db(transaction=True)
def test_every_page_renders_for_staff(admin_client, tenant):
    for url in every_console_url(tenant):
        response = admin_client.get(url, follow=True)
        # The write endpoints answer GET with 405; the pages render.
        assert response.status_code in (200, 405), (url, response.status_code)
        if response.get("Content-Disposition", "").startswith("attachment"):
            assert b"".join(response) == b"{}\n"  # a batch's file, downloaded
        elif response.status_code == 200:
            assert "Inference platform" in response.content.decode()


def test_writes_need_the_csrf_token(admin_user, tenant):
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    for url, data in ((reverse("console:tenants"), {"name": "csrf-less", "tier": tenant.tier.pk}),
                      (reverse("console:issue-key", kwargs={"pk": tenant.pk}), {"name": "csrf-less"}),
                      (reverse("console:playground"), {"tenant": tenant.pk})):
        assert client.post(url, data).status_code == 403, url
    assert not Tenant.objects.filter(name="csrf-less").exists()
    assert not ApiKey.objects.filter(tenant=tenant).exists()


def test_a_new_key_is_shown_once_and_only_its_digest_is_kept(admin_client, tenant, client):
    response = admin_client.post(reverse("console:issue-key", kwargs={"pk": tenant.pk}), {"name": "from-console"})
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    plaintext = re.search(r'id="issued-key">(sk-[^<]+)<', response.content.decode()).group(1)
    api_key = ApiKey.objects.get(name="from-console")
    assert plaintext.startswith(f"sk-{api_key.prefix}_")
    assert_not_stored(plaintext)
    page = admin_client.get(reverse("console:tenant", kwargs={"pk": tenant.pk})).content.decode()
    assert f"sk-{api_key.prefix}_" in page and plaintext not in page
    # The key works, and is refused once revoked from the console.
    assert client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {plaintext}").status_code == 200
    admin_client.post(reverse("console:revoke-key", kwargs={"pk": tenant.pk, "key_pk": api_key.pk}))
    assert client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {plaintext}").status_code == 401


def test_tenants_are_created_and_moved_between_tiers(admin_client, tenant):
    bigger, _ = actions.save_tier("console-big", lane=0, requests_per_minute=1000, tokens_per_minute=100_000,
                                  concurrent_streams=8, max_tokens_per_request=512, monthly_token_budget=10**9)
    response = admin_client.post(reverse("console:tenants"), {"name": "globex", "tier": tenant.tier.pk})
    globex = Tenant.objects.get(name="globex")
    assert response["Location"] == reverse("console:tenant", kwargs={"pk": globex.pk})
    response = admin_client.post(reverse("console:tenants"), {"name": "globex", "tier": tenant.tier.pk}, follow=True)
    assert "exists already" in response.content.decode()
    admin_client.post(reverse("console:change-tier", kwargs={"pk": globex.pk}), {"tier": bigger.pk})
    assert Tenant.objects.get(pk=globex.pk).tier == bigger
    listing = admin_client.get(reverse("console:tenants")).content.decode()
    assert "globex" in listing and "console-big" in listing and "/ 1k" in listing  # requests left / limit (1,000, abbreviated)


def test_the_playground_key_is_the_operators_and_expires_within_the_hour(admin_client, admin_user, tenant):
    response = admin_client.post(reverse("console:playground"), {"tenant": tenant.pk})
    assert response.status_code == 200
    api_key = ApiKey.objects.get(tenant=tenant)
    assert api_key.name == f"console playground ({admin_user.username})"
    assert timezone.now() < api_key.expires <= timezone.now() + timedelta(hours=1)
    assert re.search(rf'data-key="sk-{api_key.prefix}_[^"]+"', response.content.decode())


def test_a_new_playground_key_revokes_the_operators_earlier_one(admin_client, tenant):
    admin_client.post(reverse("console:playground"), {"tenant": tenant.pk})
    admin_client.post(reverse("console:playground"), {"tenant": tenant.pk})
    keys = list(ApiKey.objects.filter(tenant=tenant).order_by("created", "pk"))
    assert len(keys) == 2 and keys[0].revoked is not None and keys[1].revoked is None


def test_the_tenant_page_shows_each_keys_usage_this_month_and_its_rights(admin_client, tenant, django_assert_max_num_queries):
    narrow = actions.issue_key(tenant, name="ci", scopes=["batch", "read"], requests_per_minute=60).api_key
    wide = actions.issue_key(tenant, name="app").api_key
    for _ in range(3):
        actions.record_usage(tenant, lane=1, prompt_tokens=100, completion_tokens=23, api_key=narrow)
    actions.record_usage(tenant, lane=1, prompt_tokens=5, completion_tokens=5, api_key=wide)
    for _ in range(20):  # more keys must not mean more queries
        actions.issue_key(tenant, name="extra")
    with django_assert_max_num_queries(20):
        page = admin_client.get(reverse("console:tenant", kwargs={"pk": tenant.pk})).content.decode()
    row = re.search(rf"<tr>\s*<td><code>sk-{narrow.prefix}_….*?</tr>", page, re.S).group(0)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
    assert cells[2].strip() == "batch, read · 60 rpm" and (cells[3], cells[4]) == ("3", "369")
    wide_row = re.search(rf"<tr>\s*<td><code>sk-{wide.prefix}_….*?</tr>", page, re.S).group(0)
    assert re.findall(r"<td[^>]*>(.*?)</td>", wide_row, re.S)[2:5] == ["all", "1", "10"]


def test_the_audit_log_shows_staff_writes_with_before_and_after(admin_client, tenant):
    bigger, _ = actions.save_tier("console-bigger", lane=0, requests_per_minute=1000, tokens_per_minute=100_000,
                                  concurrent_streams=8, max_tokens_per_request=512, monthly_token_budget=10**9)
    admin_client.post(reverse("console:change-tier", kwargs={"pk": tenant.pk}), {"tier": bigger.pk})
    page = admin_client.get(reverse("console:audit"), {"target": f"tenant:{tenant.pk}"}).content.decode()
    [row] = re.findall(r"<tr>\s*<td>\d{4}-.*?</tr>", page, re.S)
    assert "tenant.change_tier" in row and "admin" in row  # the admin_client's user
    assert "console-test" in row and "console-bigger" in row  # the tier before and after
    other = admin_client.get(reverse("console:audit"), {"target": "tenant:999999"}).content.decode()
    assert "No staff writes to tenant:999999" in other
