"""DRF throttle: every authenticated API request counts against its tenant's requests/min."""
from typing import Any

from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle

from tenants import quota
from tenants.models import Tenant


class TenantRequestThrottle(BaseThrottle):
    """Refusals raise the OpenAI-shaped 429 from `tenants.quota` (DRF's own `Throttled`
    cannot carry the x-ratelimit headers); the admitting decision is kept on the request
    so `TenantAPIView` can report it in the response headers."""

    def allow_request(self, request: Request, view: Any) -> bool:
        if isinstance(request.user, Tenant):
            request.rate_limit = quota.admit_request(request.user, request.auth)
        return True
