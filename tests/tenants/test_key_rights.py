"""A key's own rights under its tenant's (issue 23): scopes, limits, expiry by rotation.

Through the DRF views and `tenants.quota` in process, on a real Redis; the generation
endpoints' side runs on a live server in tests/serving/test_keys_and_usage.py.
"""
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from tenants import actions, errors, quota
from tenants.models import ApiKey


def _issue(tenant, **rights) -> actions.IssuedKey:
    return actions.issue_key(tenant, name="scoped", **rights)


def test_each_endpoint_refuses_a_key_without_its_scope_with_403_naming_it(make_tenant, client_for):
    tenant, _ = make_tenant("acme")
    inference_only = client_for(_issue(tenant, scopes=["inference"]).plaintext)
    refused = inference_only.get("/v1/batches")
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "missing_scope_read"
    assert inference_only.get("/v1/models").status_code == 200  # listing models needs no scope

    read_only = client_for(_issue(tenant, scopes=["read"]).plaintext)
    assert read_only.get("/v1/batches").status_code == 200
    assert read_only.get("/v1/files").status_code == 200
    # (POSTs to the Files and Batch APIs and to /tokenize run on threads of their own, which this
    # test's transaction hides its tenant from: tests/serving covers them live.)
    deleted = read_only.delete("/v1/files/file-x")
    assert (deleted.status_code, deleted.json()["error"]["code"]) == (403, "missing_scope_batch")

    everything = client_for(_issue(tenant).plaintext)  # no scopes: all of them, as before scopes existed
    assert everything.get("/v1/batches").status_code == 200


def test_an_unknown_scope_is_refused_when_issuing(make_tenant):
    tenant, _ = make_tenant("acme")
    with pytest.raises(ValueError, match="unknown scope 'admin'"):
        _issue(tenant, scopes=["admin"])


def test_a_key_with_rpm_2_under_a_tenant_of_100_gets_exactly_2_of_5(make_tier, make_tenant, client_for):
    tenant, _ = make_tenant("acme", make_tier(requests_per_minute=100))
    slow = client_for(_issue(tenant, requests_per_minute=2).plaintext)
    statuses = [slow.get("/v1/models").status_code for _ in range(5)]
    assert statuses.count(200) == 2 and statuses.count(429) == 3, statuses
    refused = slow.get("/v1/models")
    assert refused.json()["error"]["type"] == "requests"
    assert "This API key's own limit" in refused.json()["error"]["message"]
    assert refused["x-ratelimit-limit-requests"] == "2"  # the tighter of the two buckets
    # The tenant's other keys are not held to it, and the key's requests counted for the tenant too.
    other = client_for(_issue(tenant).plaintext)
    admitted = other.get("/v1/models")
    assert admitted.status_code == 200
    assert admitted["x-ratelimit-remaining-requests"] == str(100 - 3)


def test_a_key_can_never_exceed_its_tenant(make_tier, make_tenant, client_for):
    tenant, _ = make_tenant("acme", make_tier(requests_per_minute=3))
    generous = client_for(_issue(tenant, requests_per_minute=1000).plaintext)
    statuses = [generous.get("/v1/models").status_code for _ in range(5)]
    assert statuses.count(200) == 3, statuses


def test_a_keys_tokens_per_minute_hold_beside_the_tenants(make_tier, make_tenant):
    tenant, _ = make_tenant("acme", make_tier(tokens_per_minute=10_000))
    api_key = _issue(tenant, tokens_per_minute=100).api_key
    with pytest.raises(errors.ApiError) as too_big:
        quota.admit_tokens(tenant, 50, 60, api_key=api_key)  # 110 > the key's 100 per minute
    assert (too_big.value.status, too_big.value.param) == (400, "max_tokens")
    assert "this API key's 100 tokens per minute" in too_big.value.message
    first = quota.admit_tokens(tenant, 20, 60, api_key=api_key)
    assert first.decision.bucket("tokens").remaining == 20  # the key's bucket, the tighter one
    with pytest.raises(errors.ApiError) as per_minute:
        quota.admit_tokens(tenant, 20, 20, api_key=api_key)
    assert (per_minute.value.status, per_minute.value.type) == (429, "tokens")
    quota.settle(tenant, first, used=30)  # gives 50 back to the key's bucket and the tenant's
    assert quota.admit_tokens(tenant, 20, 20, api_key=api_key).decision.bucket("tokens").remaining == 30


def test_a_keys_monthly_budget_holds_beside_the_tenants(make_tier, make_tenant):
    tenant, _ = make_tenant("acme", make_tier(monthly_token_budget=1_000_000))
    api_key = _issue(tenant, monthly_token_budget=150).api_key
    first = quota.admit_tokens(tenant, 100, 40, api_key=api_key)  # holds 140 of the key's 150
    second = quota.admit_tokens(tenant, 5, 5, api_key=api_key)  # 10 left: taken, as the tenant's would be
    with pytest.raises(errors.ApiError) as held:
        quota.admit_tokens(tenant, 1, 1, api_key=api_key)
    assert (held.value.code, held.value.message.startswith("This API key's own")) == ("budget_reserved", True)
    quota.settle(tenant, first, used=140)
    quota.settle(tenant, second, used=10)
    with pytest.raises(errors.ApiError) as spent:
        quota.admit_tokens(tenant, 1, 1, api_key=api_key)
    assert spent.value.code == "insufficient_quota"
    assert "This API key exceeded its own monthly token budget of 150" in spent.value.message
    # The tenant's other keys still have the tenant's room, which counted these 150 too.
    assert quota.admit_tokens(tenant, 10, 10, api_key=_issue(tenant).api_key).budget is not None
    assert quota.monthly_tokens_used(tenant) == 150


def test_a_keys_monthly_budget_is_rebuilt_from_its_own_usage_rows_when_redis_lost_it(make_tenant, redis):
    tenant, _ = make_tenant("acme")
    api_key = _issue(tenant, monthly_token_budget=100).api_key
    actions.record_usage(tenant, lane=1, prompt_tokens=40, completion_tokens=50, api_key=api_key)
    actions.record_usage(tenant, lane=1, prompt_tokens=500, completion_tokens=0)  # another key's: not this one's
    redis.flushall()
    admitted = quota.admit_tokens(tenant, 5, 5, api_key=api_key)  # 90 used (not 590): 10 left
    quota.settle(tenant, admitted, used=10)
    with pytest.raises(errors.ApiError) as spent:
        quota.admit_tokens(tenant, 5, 1, api_key=api_key)
    assert spent.value.code == "insufficient_quota"


def test_a_rotated_keys_old_secret_works_during_the_grace_and_401s_after(make_tenant, client_for):
    tenant, _ = make_tenant("acme")
    old = _issue(tenant, scopes=["read"], requests_per_minute=50)
    new = actions.rotate_key(old.api_key, timedelta(seconds=1), actor="ops")
    assert client_for(old.plaintext).get("/v1/batches").status_code == 200
    assert client_for(new.plaintext).get("/v1/batches").status_code == 200
    assert (new.api_key.scopes, new.api_key.requests_per_minute, new.api_key.name) == (["read"], 50, "scoped")
    old.api_key.refresh_from_db()
    assert old.api_key.replaced_by == new.api_key
    time.sleep(max(0.0, (old.api_key.expires - timezone.now()).total_seconds()) + 0.05)
    expired = client_for(old.plaintext).get("/v1/batches")
    assert expired.status_code == 401
    assert expired.json()["error"]["message"] == "This API key has expired."
    assert client_for(new.plaintext).get("/v1/batches").status_code == 200
    with pytest.raises(ValueError):
        actions.rotate_key(ApiKey.objects.get(pk=old.api_key.pk), timedelta(hours=1))
