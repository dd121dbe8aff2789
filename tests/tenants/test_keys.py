"""API keys: shown once, stored hashed, refused once revoked or expired."""
import hmac
import re
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from tenants import actions, keys
from tenants.models import ApiKey

pytestmark = pytest.mark.django_db

KEY_SHAPE = re.compile(r"^sk-[0-9a-f]{12}_[A-Za-z0-9_-]{43}$")


def every_cell() -> list[tuple[str, object]]:
    """(table, value) for every column of every row of every table."""
    cells = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            cells += [(table, value) for row in cursor.fetchall() for value in row]
    return cells


def assert_not_stored(plaintext: str) -> None:
    secret = plaintext.split("_", 1)[1]
    for table, value in every_cell():
        text = value.decode(errors="replace") if isinstance(value, (bytes, memoryview)) else str(value)
        assert secret not in text, f"the key's secret is stored in {table}"


def test_issued_key_has_the_documented_shape_and_a_fresh_secret(make_tenant):
    tenant, first = make_tenant("acme")
    second = actions.issue_key(tenant)
    assert KEY_SHAPE.match(first.plaintext)
    assert first.plaintext != second.plaintext
    assert first.plaintext.split("_", 1)[1] != second.plaintext.split("_", 1)[1]


def test_database_holds_no_plaintext_key(make_tenant, client_for, capsys):
    _, issued = make_tenant("acme")
    call_command("create_tenant", "globex", "--tier", "standard")
    from_command = capsys.readouterr().out.strip().splitlines()[-1]
    call_command("issue_key", "globex")
    from_issue = capsys.readouterr().out.strip().splitlines()[-1]
    for plaintext in (issued.plaintext, from_command, from_issue):
        assert client_for(plaintext).get("/v1/models").status_code == 200  # also exercises last_used writes
        assert_not_stored(plaintext)
    stored = ApiKey.objects.get(prefix=issued.api_key.prefix)
    assert stored.digest == keys.digest(issued.plaintext)


def test_key_works_once_issued(make_tenant, client_for):
    _, issued = make_tenant("acme")
    response = client_for(issued.plaintext).get("/v1/models")
    assert response.status_code == 200
    assert ApiKey.objects.get(pk=issued.api_key.pk).last_used is not None


def test_revoked_key_is_refused(make_tenant, client_for):
    _, issued = make_tenant("acme")
    client = client_for(issued.plaintext)
    assert client.get("/v1/models").status_code == 200
    actions.revoke_key(issued.api_key)
    response = client.get("/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert "revoked" in response.json()["error"]["message"]


def test_expired_key_is_refused(make_tenant, client_for):
    tenant, _ = make_tenant("acme")
    expired = actions.issue_key(tenant, expires=timezone.now() - timedelta(seconds=1))
    live = actions.issue_key(tenant, expires=timezone.now() + timedelta(days=1))
    response = client_for(expired.plaintext).get("/v1/models")
    assert response.status_code == 401
    assert "expired" in response.json()["error"]["message"]
    assert client_for(live.plaintext).get("/v1/models").status_code == 200


def test_inactive_tenants_keys_are_refused(make_tenant, client_for):
    tenant, issued = make_tenant("acme")
    actions.update_tenant(tenant, name=tenant.name, tier=tenant.tier, is_active=False)
    assert client_for(issued.plaintext).get("/v1/models").status_code == 401


def test_wrong_secret_with_right_prefix_is_refused(make_tenant, client_for):
    _, issued = make_tenant("acme")
    prefix, secret = issued.plaintext.split("_", 1)
    forged = f"{prefix}_{secret[:-1]}{'A' if secret[-1] != 'A' else 'B'}"
    response = client_for(forged).get("/v1/models")
    assert response.status_code == 401
    assert response.json() == {
        "error": {"message": "Incorrect API key provided.", "type": "invalid_request_error", "param": None,
                  "code": "invalid_api_key"}
    }
    assert response["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "header",
    ["", "Bearer", "Bearer sk-", "Basic abc", "Bearer sk-nothex00000_secret", "Bearer sk-0123456789ab", "Token sk-x_y"],
)
def test_missing_or_malformed_keys_are_refused_in_the_openai_shape(make_tenant, client_for, header):
    make_tenant("acme")
    client = APIClient()
    if header:
        client.credentials(HTTP_AUTHORIZATION=header)
    response = client.get("/v1/models")
    assert response.status_code == 401
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_verification_uses_a_timing_safe_compare_of_digests(make_tenant, client_for, monkeypatch):
    _, issued = make_tenant("acme")
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    forged = issued.plaintext[:-2] + "xx"
    assert client_for(forged).get("/v1/models").status_code == 401
    assert calls == [(keys.digest(forged), issued.api_key.digest)]
    # An unknown prefix costs the same comparison, so timing does not reveal which prefixes exist.
    calls.clear()
    assert client_for("sk-0123456789ab_" + "x" * 43).get("/v1/models").status_code == 401
    assert len(calls) == 1
