"""Migration 0003 run on a database that has tiers in it: after it no tier shares its prefix
cache, whatever the old field said, and rolling it back keeps the tiers isolated.

Run the way Django's own migration tests run them: a MigrationExecutor moves the schema to a
state, and the historical models of that state write and read the rows."""
from collections.abc import Iterator

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("tenants", "0002_seed_tiers")]
AFTER = [("tenants", "0003_share_prefix_cache")]
LIMITS = {"lane": 1, "requests_per_minute": 10, "tokens_per_minute": 1000, "concurrent_streams": 1,
          "max_tokens_per_request": 100, "monthly_token_budget": 10_000}


@pytest.fixture
def migrate() -> Iterator:
    """Move the schema to a state and return that state's models; the latest schema afterwards."""
    def to(targets):
        executor = MigrationExecutor(connection)
        executor.migrate(targets)
        return executor.loader.project_state(targets).apps

    yield to
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


def test_every_existing_tier_is_isolated_after_the_migration_whatever_it_had(migrate):
    old = migrate(BEFORE)
    QuotaTier = old.get_model("tenants", "QuotaTier")
    # The seeded tiers as 0002 left them (standard and batch shared), and an operator's tiers.
    tiers = {"realtime": True, "standard": False, "batch": False, "gold": False, "vault": True}
    for name, isolate in tiers.items():
        QuotaTier.objects.update_or_create(name=name, defaults={**LIMITS, "isolate_prefix_cache": isolate})
    old.get_model("tenants", "Tenant").objects.create(name="acme", tier=QuotaTier.objects.get(name="standard"))

    new = migrate(AFTER)
    rows = dict(new.get_model("tenants", "QuotaTier").objects.filter(name__in=tiers).values_list("name", "share_prefix_cache"))
    assert rows == dict.fromkeys(tiers, False)
    assert new.get_model("tenants", "Tenant").objects.get(name="acme").tier.name == "standard"


def test_rolling_back_keeps_isolated_tiers_isolated(migrate):
    new = migrate(AFTER)
    QuotaTier = new.get_model("tenants", "QuotaTier")
    QuotaTier.objects.update_or_create(name="vault", defaults=LIMITS)
    QuotaTier.objects.update_or_create(name="commons", defaults={**LIMITS, "share_prefix_cache": True})

    old = migrate(BEFORE)
    rows = dict(old.get_model("tenants", "QuotaTier").objects.filter(name__in=["vault", "commons"])
                .values_list("name", "isolate_prefix_cache"))
    assert rows == {"vault": True, "commons": False}
