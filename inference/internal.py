"""The internal endpoints batch workers call: /internal/v1/chat/completions and
/internal/v1/completions.

A worker authenticates with its service token (`Authorization: Bearer
<BATCH_WORKER_TOKEN>`) and acts for one tenant (`X-Tenant-Id`). The request runs in lane
P2 whatever it asks for, is not counted against the tenant's interactive requests/min or
tokens/min (batch work has its own pace: the engine's back-pressure), is still held to
the tier's max_tokens and monthly budget, and its usage is recorded against the tenant in
lane P2 with the worker's `X-Request-Id`. A batch created with an API key names it
(`X-Api-Key-Id`): the request is then held to that key's own monthly budget too and billed to
it, and refused (403 `api_key_revoked`) once the key is revoked; an expired key (a rotated one
past its grace) still runs what it created. A worker names the item and its attempt
(`X-Batch-Item`, `X-Batch-Attempt`): an item's attempts share one usage row, each replacing
the last, so an item whose worker died after the engine billed it is billed once.
"""
from __future__ import annotations

from typing import Any

from inference import http_metrics
from inference.consumers import OpenAIConsumer
from inference.service_tokens import is_batch_worker_token
from tenants import admission
from tenants.errors import ApiError
from tenants.middleware import AsgiScope, refuse, scope_header
from tenants.models import ApiKey, Lane, Tenant

MAX_REQUEST_ID = 64


def _tenant(tenant_id: str) -> Tenant | None:
    if not tenant_id.isdigit():
        return None
    return Tenant.objects.select_related("tier").filter(pk=int(tenant_id), is_active=True).first()


def _batch_key(tenant: Tenant, key_id: str) -> ApiKey | None:
    if not key_id.isdigit():
        return None
    return ApiKey.objects.filter(pk=int(key_id), tenant=tenant).first()


class ServiceTokenMiddleware:
    """Admits the batch workers' token only; the scope gains the tenant the worker acts for."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: AsgiScope, receive: Any, send: Any) -> None:
        if not is_batch_worker_token(scope_header(scope, b"authorization")):
            error = ApiError(401, "Internal endpoints need 'Authorization: Bearer <BATCH_WORKER_TOKEN>'.",
                             code="invalid_service_token", headers={"WWW-Authenticate": "Bearer"})
            return await refuse(scope, receive, send, error)
        tenant_id = scope_header(scope, b"x-tenant-id") or ""
        try:
            tenant = await admission.run(_tenant, tenant_id, caller=f"batch:{tenant_id[:32]}", what="batch tenant lookup")
        except ApiError as error:
            return await refuse(scope, receive, send, error)
        if tenant is None:
            error = ApiError(404, "No active tenant with the id in X-Tenant-Id.", code="tenant_not_found",
                             param="X-Tenant-Id")
            return await refuse(scope, receive, send, error)
        http_metrics.note_tenant(scope, tenant.engine_id)
        api_key = None
        key_id = scope_header(scope, b"x-api-key-id")
        if key_id is not None:
            try:
                api_key = await admission.run(_batch_key, tenant, key_id, caller=f"batch:{tenant.pk}",
                                              what="batch key lookup")
            except ApiError as error:
                return await refuse(scope, receive, send, error)
            refusal = None
            if api_key is None:
                refusal = ApiError(404, "No API key of this tenant with the id in X-Api-Key-Id.", code="api_key_not_found",
                                   param="X-Api-Key-Id")
            elif api_key.revoked is not None:
                refusal = ApiError(403, "The API key that created this batch was revoked.", type="permission_error",
                                   code="api_key_revoked")
            if refusal is not None:
                return await refuse(scope, receive, send, refusal)
        return await self.app({**scope, "tenant": tenant, "api_key": api_key, "rate_limit": None}, receive, send)


class BatchItemConsumer(OpenAIConsumer):
    """An OpenAI endpoint in lane P2, outside the interactive rate limits."""

    lane = Lane.BATCH
    metered = False

    def request_id(self) -> str | None:
        given = (self.header(b"x-request-id") or "").strip()
        return given[:MAX_REQUEST_ID] or None

    def billing(self) -> dict:
        item, attempt = (self.header(b"x-batch-item") or "").strip(), (self.header(b"x-batch-attempt") or "").strip()
        if not (item.isdigit() and attempt.isdigit()):
            return {}
        batch = (self.header(b"x-batch-id") or "").strip()
        return {"billing_key": f"batch-item:{int(item)}", "attempt": int(attempt), "batch_id": batch[:40]}

    def endpoint(self) -> str:
        return "batch"


class BatchChatConsumer(BatchItemConsumer):
    kind = "chat"


class BatchCompletionConsumer(BatchItemConsumer):
    kind = "completion"
