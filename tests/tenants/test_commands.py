"""The operators' commands: create_tenant, issue_key, create_tier."""
import pytest
from django.core.management import CommandError, call_command

from tenants.models import QuotaTier, Tenant

pytestmark = pytest.mark.django_db


def last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_three_tiers_are_seeded_with_their_lanes():
    assert dict(QuotaTier.objects.values_list("name", "lane")) == {"realtime": 0, "standard": 1, "batch": 2}


def test_create_tenant_prints_a_working_key_last(capsys, client_for):
    call_command("create_tenant", "acme", "--tier", "realtime")
    key = last_line(capsys)
    assert Tenant.objects.get(name="acme").tier.name == "realtime"
    assert client_for(key).get("/v1/models").status_code == 200


def test_create_tenant_refuses_an_unknown_tier_or_a_taken_name(capsys):
    with pytest.raises(CommandError, match="No tier 'gold'"):
        call_command("create_tenant", "acme", "--tier", "gold")
    call_command("create_tenant", "acme", "--tier", "batch")
    with pytest.raises(CommandError, match="already exists"):
        call_command("create_tenant", "acme", "--tier", "batch")


def test_issue_key_prints_another_working_key_last(capsys, client_for):
    call_command("create_tenant", "acme", "--tier", "standard")
    first = last_line(capsys)
    call_command("issue_key", "acme", "--name", "ci")
    second = last_line(capsys)
    assert first != second
    assert client_for(second).get("/v1/models").status_code == 200
    assert client_for(first).get("/v1/models").status_code == 200
    with pytest.raises(CommandError):
        call_command("issue_key", "nobody")


def test_create_tier_creates_then_updates(capsys):
    args = ["--lane", "0", "--rpm", "5", "--tpm", "100", "--concurrency", "1", "--max-tokens", "10",
            "--monthly-tokens", "1000"]
    call_command("create_tier", "gold", *args, "--batch", "--share-prefix-cache")
    assert "Created" in last_line(capsys)
    gold = QuotaTier.objects.get(name="gold")
    assert (gold.lane, gold.requests_per_minute, gold.allow_batch, gold.share_prefix_cache) == (0, 5, True, True)
    call_command("create_tier", "gold", *args[:2], "--rpm", "50", *args[4:])
    assert "Updated" in last_line(capsys)
    gold.refresh_from_db()
    assert (gold.requests_per_minute, gold.allow_batch, gold.share_prefix_cache) == (50, False, False)


def test_seeded_and_new_tiers_keep_each_tenants_prefix_cache_its_own(capsys):
    call_command("create_tier", "plain", "--lane", "1", "--rpm", "5", "--tpm", "100", "--concurrency", "1",
                 "--max-tokens", "10", "--monthly-tokens", "1000")
    assert not QuotaTier.objects.filter(share_prefix_cache=True).exists()
