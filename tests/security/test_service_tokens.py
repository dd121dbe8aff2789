"""INTERNAL_API_TOKEN's three roles (issue 24, suspected: "INTERNAL_API_TOKEN serving three
roles"). Confirmed: the one token read the operators' engine stats, read /metrics, and ran
batch items for any tenant on the internal endpoint, so the copy every batch worker machine
holds opened the operators' endpoints too. Each role now has its own setting
(OPERATOR_API_TOKEN, BATCH_WORKER_TOKEN, METRICS_TOKEN), each defaulting to the old one.
"""
from __future__ import annotations

import asyncio

import pytest
from channels.testing import HttpCommunicator

from inference.internal import ServiceTokenMiddleware
from tenants import actions

WORKER = "worker-token-0123456789-0123456789-abcdef"
OPERATOR = "operator-token-0123456789-0123456789-abcd"
METRICS = "metrics-token-0123456789-0123456789-abcde"


def batch_tier():
    """A tier of this module's own: transactional tests flush the migrations' seeded tiers."""
    tier, _ = actions.save_tier("uploads-batch", lane=2, requests_per_minute=1000, tokens_per_minute=10**6,
                                concurrent_streams=10, max_tokens_per_request=512, monthly_token_budget=10**9,
                                allow_batch=True)
    return tier


@pytest.fixture
def tokens(settings):
    # A deployment that moved its operators to their own token; its workers keep the old one.
    settings.INTERNAL_API_TOKEN = settings.BATCH_WORKER_TOKEN = WORKER
    settings.OPERATOR_API_TOKEN, settings.METRICS_TOKEN = OPERATOR, METRICS
    settings.METRICS_ALLOW_LOOPBACK = False


def bearer(token: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def test_a_batch_workers_token_cannot_read_operator_endpoints(client, tokens):
    assert client.get("/api/v1/engine/stats", **bearer(WORKER)).status_code == 403
    assert client.get("/metrics", **bearer(WORKER)).status_code == 403
    assert client.get("/api/v1/engine/stats", **bearer(OPERATOR)).status_code == 200
    assert client.get("/metrics", **bearer(METRICS)).status_code == 200
    assert client.get("/metrics", **bearer(OPERATOR)).status_code == 200
    assert client.get("/api/v1/engine/stats", **bearer(METRICS)).status_code == 403


class _Reached:
    """The application behind the middleware: answers 204 and keeps the scope it got."""

    def __init__(self) -> None:
        self.scopes: list[dict] = []

    async def __call__(self, scope, receive, send):
        self.scopes.append(scope)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@pytest.mark.django_db(transaction=True)
def test_only_the_batch_workers_token_runs_batch_items(tokens):
    tenant = actions.create_tenant("acme", batch_tier())
    reached = _Reached()
    app = ServiceTokenMiddleware(reached)

    async def status_with(token: str) -> int:
        headers = [(b"authorization", f"Bearer {token}".encode()), (b"x-tenant-id", str(tenant.pk).encode())]
        communicator = HttpCommunicator(app, "POST", "/internal/v1/chat/completions", body=b"{}", headers=headers)
        return (await communicator.get_response())["status"]

    assert asyncio.run(status_with(OPERATOR)) == 401
    assert asyncio.run(status_with(METRICS)) == 401
    assert asyncio.run(status_with(WORKER)) == 204
    assert [scope["tenant"].pk for scope in reached.scopes] == [tenant.pk]
