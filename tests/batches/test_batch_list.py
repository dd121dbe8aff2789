"""GET /v1/batches answers a page in a fixed number of queries: each batch's request counts
and usage came from two queries of its own (200 for a page of 100)."""
from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from batches import actions as batch_actions
from tenants import actions
from tests.batches.test_batch_states import (  # noqa: F401 (fixtures: broker, autouse, keeps sends on the test Redis; tenant)
    batch_underway, broker, start_batch, tenant,
)

pytestmark = pytest.mark.django_db


def listed(client: APIClient, limit: int) -> tuple[list[dict], int]:
    with CaptureQueriesContext(connection) as queries:
        response = client.get("/v1/batches", {"limit": limit})
    assert response.status_code == 200, response.content
    return response.json()["data"], len(queries)


def test_a_page_of_batches_takes_the_same_queries_for_3_batches_as_for_12(tenant):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {actions.issue_key(tenant, name='lister').plaintext}")
    batches = [batch_underway(tenant, 3, finished=1, running=1)[0], start_batch(tenant, 2), start_batch(tenant, 1)]
    listed(client, 100)  # the key's first use writes its last-used time: not part of the page
    few, few_queries = listed(client, 100)
    batches += [start_batch(tenant, 1 + i % 3) for i in range(9)]
    many, many_queries = listed(client, 100)
    assert len(few) == 3 and len(many) == 12
    assert many_queries == few_queries
    # The same objects as batch_object builds one batch at a time (counts and usage included).
    by_id = {b["id"]: b for b in many}
    for batch in batches:
        assert by_id[batch.id] == batch_actions.batch_object(batch), batch.id
    assert by_id[batches[0].id]["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
