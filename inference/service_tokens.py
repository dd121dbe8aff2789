"""The platform's service tokens, one per role, so a leaked one opens only its own door.

    OPERATOR_API_TOKEN   operators' tools: /api/v1/engine/stats (and /metrics)
    BATCH_WORKER_TOKEN   batch workers: the internal endpoints /internal/v1/...
    METRICS_TOKEN        a metrics scraper: /metrics

Each defaults to INTERNAL_API_TOKEN (config/settings.py), which once served all three:
then a batch worker's token, on every worker machine, also read the operators' endpoints.
An unset token matches nothing.
"""
from django.conf import settings
from django.utils.crypto import constant_time_compare

from tenants.authentication import bearer_token


def _carries(header: str | None, *expected: str) -> bool:
    token = bearer_token(header)
    # Every comparison runs, so which token matched (if any) takes no different time.
    matches = [bool(token and value and constant_time_compare(token, value)) for value in expected]
    return any(matches)


def is_operator_token(header: str | None) -> bool:
    return _carries(header, settings.OPERATOR_API_TOKEN)


def is_batch_worker_token(header: str | None) -> bool:
    return _carries(header, settings.BATCH_WORKER_TOKEN)


def is_metrics_token(header: str | None) -> bool:
    return _carries(header, settings.METRICS_TOKEN, settings.OPERATOR_API_TOKEN)
