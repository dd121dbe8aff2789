"""Nothing one tenant's key can reach names or returns another tenant's objects."""
import pytest
from django.urls import URLPattern, URLResolver, get_resolver

from tenants import actions, quota

pytestmark = pytest.mark.django_db


def key_reachable_paths() -> list[str]:
    """Every parameterless route outside the admin console and static files."""
    paths = []

    def walk(patterns, prefix: str) -> None:
        for p in patterns:
            route = str(p.pattern)
            if isinstance(p, URLResolver):
                if not route.startswith(("admin/", "static/", "^static")):
                    walk(p.url_patterns, prefix + route)
            elif isinstance(p, URLPattern) and "<" not in route and "(" not in route:
                paths.append("/" + prefix + route.lstrip("^").rstrip("$"))

    walk(get_resolver().url_patterns, "")
    return paths


@pytest.fixture
def two_tenants(make_tenant, make_tier):
    tier = make_tier(requests_per_minute=3)
    a = make_tenant("alpha-corp", tier)
    b = make_tenant("zeta-industries-7f3c", tier)
    actions.record_usage(b[0], lane=1, prompt_tokens=5, completion_tokens=5, api_key=b[1].api_key,
                         request_id="zeta-request-91", model="zeta-private-model")
    return a, b


def test_no_response_to_one_tenants_key_mentions_another_tenant(two_tenants, client_for):
    (_, a_key), (b, b_key) = two_tenants
    client = client_for(a_key.plaintext)
    paths = key_reachable_paths()
    assert "/v1/models" in paths
    for path in paths:
        body = client.get(path).content.decode()
        for secret_of_b in (b.name, b_key.api_key.prefix, "zeta-request-91", "zeta-private-model"):
            assert secret_of_b not in body, f"{path} shows {secret_of_b!r} to another tenant"


def test_one_tenants_traffic_does_not_use_another_tenants_limits(two_tenants, client_for):
    (a, a_key), (b, b_key) = two_tenants
    a_client = client_for(a_key.plaintext)
    assert [a_client.get("/v1/models").status_code for _ in range(4)] == [200, 200, 200, 429]
    assert client_for(b_key.plaintext).get("/v1/models").status_code == 200
    assert quota.monthly_tokens_used(a) == 0
    assert quota.monthly_tokens_used(b) == 10


def test_a_tenant_key_opens_no_admin_page(two_tenants, client_for):
    (_, a_key), (b, _) = two_tenants
    client = client_for(a_key.plaintext)
    for path in ("/admin/", "/admin/tenants/tenant/", f"/admin/tenants/tenant/{b.pk}/change/",
                 "/admin/tenants/apikey/", "/admin/tenants/usagerecord/"):
        response = client.get(path)
        assert response.status_code == 302 and "/admin/login/" in response["Location"], path
