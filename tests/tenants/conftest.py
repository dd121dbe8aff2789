"""Tenants built through the same actions the product uses, on a real Redis."""
from collections.abc import Callable

import pytest
from rest_framework.test import APIClient

from tenants import actions
from tenants.actions import IssuedKey
from tenants.models import QuotaTier, Tenant


@pytest.fixture(autouse=True)
def _redis(redis):
    return redis


@pytest.fixture
def make_tier(db) -> Callable[..., QuotaTier]:
    def make(name: str = "test", **overrides: int | bool) -> QuotaTier:
        fields = {
            "lane": 1,
            "requests_per_minute": 100,
            "tokens_per_minute": 10_000,
            "concurrent_streams": 2,
            "max_tokens_per_request": 512,
            "monthly_token_budget": 1_000_000,
        }
        fields.update(overrides)
        tier, _ = actions.save_tier(name, **fields)
        return tier

    return make


@pytest.fixture
def make_tenant(make_tier) -> Callable[..., tuple[Tenant, IssuedKey]]:
    def make(name: str, tier: QuotaTier | None = None) -> tuple[Tenant, IssuedKey]:
        tenant = actions.create_tenant(name, tier or make_tier())
        return tenant, actions.issue_key(tenant, name="test")

    return make


@pytest.fixture
def client_for() -> Callable[[str], APIClient]:
    def make(plaintext: str) -> APIClient:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
        return client

    return make
