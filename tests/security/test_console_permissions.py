"""Issue 24, items 9 and 10 (origin): staff alone does not let an operator write in the
console, as it does not in the admin, and the console socket compares the page's whole
origin (scheme, host, port), not only its host name."""
import pytest
from asgiref.sync import async_to_sync
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import Permission
from django.test import Client

from console.routing import console_routes
from tenants import actions
from tenants.models import ApiKey, Tenant

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _redis(redis):
    return redis


@pytest.fixture
def tenant() -> Tenant:
    tier, _ = actions.save_tier("console-perms", lane=1, requests_per_minute=100, tokens_per_minute=10_000,
                                concurrent_streams=2, max_tokens_per_request=256, monthly_token_budget=1_000_000)
    actions.save_tier("console-perms-other", lane=2, requests_per_minute=10, tokens_per_minute=1_000,
                      concurrent_streams=1, max_tokens_per_request=64, monthly_token_budget=1_000)
    return actions.create_tenant("acme", tier)


def staff(django_user_model, name: str, *perms: str) -> Client:
    user = django_user_model.objects.create_user(name, password=f"pw-{name}-1", is_staff=True)
    for perm in perms:
        app, codename = perm.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app, codename=codename))
    client = Client()
    client.force_login(user)
    return client


def test_staff_without_model_permissions_can_neither_read_nor_write(tenant, django_user_model):
    client = staff(django_user_model, "bare")
    key = actions.issue_key(tenant, name="existing").api_key
    other = tenant.tier.__class__.objects.get(name="console-perms-other")
    writes = [
        ("/console/tenants/", {"name": "evil", "tier": tenant.tier.pk}),
        (f"/console/tenants/{tenant.pk}/keys/", {"name": "evil"}),
        (f"/console/tenants/{tenant.pk}/keys/{key.pk}/revoke/", {}),
        (f"/console/tenants/{tenant.pk}/tier/", {"tier": other.pk}),
        ("/console/playground/", {"tenant": tenant.pk}),
    ]
    for url, data in writes:
        response = client.post(url, data)
        assert response.status_code == 403, (url, response.status_code)
    for url in ("/console/tenants/", f"/console/tenants/{tenant.pk}/", "/console/batches/", "/console/playground/"):
        assert client.get(url).status_code == 403, url
    # Nothing changed: no tenant, no key, the key still live, the tier the same.
    assert list(Tenant.objects.values_list("name", flat=True)) == ["acme"]
    assert list(ApiKey.objects.values_list("name", "revoked")) == [("existing", None)]
    assert Tenant.objects.get().tier_id == tenant.tier.pk
    # The engine page shows no model: staff is enough there.
    assert client.get("/console/engine/").status_code == 200


def test_each_write_needs_its_own_permission_and_the_page_hides_what_it_cannot_do(tenant, django_user_model):
    viewer = staff(django_user_model, "viewer", "tenants.view_tenant", "batches.view_batch")
    page = viewer.get(f"/console/tenants/{tenant.pk}/").content.decode()
    assert 'id="issue-key"' not in page and 'id="change-tier"' not in page
    assert viewer.post(f"/console/tenants/{tenant.pk}/keys/", {"name": "x"}).status_code == 403

    issuer = staff(django_user_model, "issuer", "tenants.view_tenant", "tenants.add_apikey")
    page = issuer.get(f"/console/tenants/{tenant.pk}/").content.decode()
    assert 'id="issue-key"' in page and 'id="change-tier"' not in page
    assert issuer.post(f"/console/tenants/{tenant.pk}/keys/", {"name": "ok"}).status_code == 200
    assert ApiKey.objects.filter(tenant=tenant, name="ok").exists()
    other = tenant.tier.__class__.objects.get(name="console-perms-other")
    assert issuer.post(f"/console/tenants/{tenant.pk}/tier/", {"tier": other.pk}).status_code == 403
    assert Tenant.objects.get().tier_id == tenant.tier.pk

    assert viewer.post("/console/batches/batch_0123456789abcdef01234567/cancel/").status_code == 403


def origin_accepted(origin: str, host: str = "console.test:8000", scheme: str = "ws") -> bool:
    return async_to_sync(_connect)(origin, host, scheme)


async def _connect(origin: str, host: str, scheme: str) -> bool:
    app = URLRouter(console_routes)
    headers = [(b"host", host.encode()), (b"origin", origin.encode())]
    communicator = WebsocketCommunicator(app, "/ws/console/engine", headers=headers)
    communicator.scope["scheme"] = scheme
    connected, _ = await communicator.connect(timeout=5)
    if connected:  # an anonymous visitor: the consumer itself closes it (4403), ending the app
        assert (await communicator.receive_output(timeout=5))["code"] == 4403
    await communicator.disconnect(timeout=0.1)
    return connected


def test_the_console_socket_refuses_another_scheme_or_port_of_the_same_host(settings):
    settings.ALLOWED_HOSTS = ["console.test"]
    settings.CSRF_TRUSTED_ORIGINS = ["https://console.example.com"]
    assert origin_accepted("http://console.test:8000")
    assert origin_accepted("HTTP://Console.Test:8000")
    assert not origin_accepted("http://console.test:9999")  # another service on the same host
    assert not origin_accepted("https://console.test:8000")
    assert not origin_accepted("http://console.test")
    assert not origin_accepted("http://evil.example:8000")
    assert not origin_accepted("null")
    assert not origin_accepted("http://console.test:8000", host="evil.example:8000")  # not an allowed host
    assert origin_accepted("https://console.test", host="console.test", scheme="wss")
    assert not origin_accepted("http://console.test", host="console.test", scheme="wss")
    # Behind a TLS proxy the operator lists the public origin.
    assert origin_accepted("https://console.example.com")
    assert not origin_accepted("https://console.example.com:8443")
