"""The admin console: tiers, tenants, keys (the secret shown once), usage."""
import re

import pytest

from tenants.models import ApiKey, Tenant
from tests.tenants.test_keys import assert_not_stored

pytestmark = pytest.mark.django_db


def test_issuing_a_key_in_the_admin_shows_the_secret_once(admin_client, make_tenant, client_for):
    tenant, _ = make_tenant("acme")
    response = admin_client.post(
        "/admin/tenants/apikey/add/", {"tenant": tenant.pk, "name": "from-admin", "expires_0": "", "expires_1": ""}
    )
    assert response.status_code == 200
    assert "no-cache" in response["Cache-Control"]
    plaintext = re.search(r'id="issued-key"[^>]*>(sk-[^<]+)<', response.content.decode()).group(1)
    api_key = ApiKey.objects.get(name="from-admin")
    assert plaintext.startswith(f"sk-{api_key.prefix}_")
    assert client_for(plaintext).get("/v1/models").status_code == 200
    assert_not_stored(plaintext)
    # The key's own page shows its prefix, never the secret.
    page = admin_client.get(f"/admin/tenants/apikey/{api_key.pk}/change/").content.decode()
    assert api_key.prefix in page and plaintext not in page


def test_revoking_from_the_admin_refuses_the_key(admin_client, make_tenant, client_for):
    _, issued = make_tenant("acme")
    response = admin_client.post(
        "/admin/tenants/apikey/", {"action": "revoke", "_selected_action": [issued.api_key.pk]}, follow=True
    )
    assert response.status_code == 200
    assert client_for(issued.plaintext).get("/v1/models").status_code == 401


def test_tenants_and_tiers_are_created_and_changed_in_the_admin(admin_client, make_tier, client_for):
    standard, bigger = make_tier("small", requests_per_minute=1), make_tier("big", requests_per_minute=100)
    response = admin_client.post(
        "/admin/tenants/tenant/add/",
        {"name": "acme", "tier": standard.pk, "is_active": "on", "api_keys-TOTAL_FORMS": "0",
         "api_keys-INITIAL_FORMS": "0"},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    tenant = Tenant.objects.get(name="acme")
    assert tenant.tier == standard
    response = admin_client.post(
        f"/admin/tenants/tenant/{tenant.pk}/change/",
        {"name": "acme", "tier": bigger.pk, "is_active": "on", "api_keys-TOTAL_FORMS": "0",
         "api_keys-INITIAL_FORMS": "0"},
    )
    assert response.status_code == 302
    tenant.refresh_from_db()
    assert tenant.tier == bigger


def test_every_admin_list_page_renders(admin_client, make_tenant):
    _, issued = make_tenant("acme")
    for path in ("/admin/", "/admin/tenants/quotatier/", "/admin/tenants/tenant/", "/admin/tenants/apikey/",
                 "/admin/tenants/usagerecord/", "/admin/tenants/apikey/add/"):
        response = admin_client.get(path)
        assert response.status_code == 200, path
        assert issued.plaintext not in response.content.decode()


def test_the_admin_deletes_nothing_it_can_revoke_or_deactivate_instead(admin_client, make_tenant):
    tenant, issued = make_tenant("acme")
    for path in (f"/admin/tenants/tenant/{tenant.pk}/delete/", f"/admin/tenants/apikey/{issued.api_key.pk}/delete/",
                 f"/admin/tenants/quotatier/{tenant.tier.pk}/delete/"):
        assert admin_client.get(path).status_code == 403, path
