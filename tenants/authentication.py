"""Bearer-key authentication: one path for DRF views and Channels consumers.

`authenticate_bearer` is the whole policy; `ApiKeyAuthentication` (DRF) and
`tenants.middleware.ApiKeyAuthMiddleware` (Channels) only adapt it to their request types.
"""
from django.conf import settings
from django.utils import timezone
from django.utils.crypto import constant_time_compare
from rest_framework.authentication import BaseAuthentication
from rest_framework.request import Request

from tenants import actions, errors, keys
from tenants.models import ApiKey, Tenant

# Compared against when no key has the presented prefix, so an unknown prefix costs the
# same digest and comparison as a known one.
_NO_SUCH_DIGEST = keys.digest("sk-000000000000_no-such-key")


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None if there is none."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def is_service_token(header: str | None) -> bool:
    """Whether an Authorization header carries the platform's service token
    (INTERNAL_API_TOKEN): operators' tools and batch workers. Never true while it is unset."""
    token = bearer_token(header)
    expected = settings.INTERNAL_API_TOKEN
    return bool(token and expected and constant_time_compare(token, expected))


def authenticate_bearer(header: str | None) -> ApiKey:
    """The live key an Authorization header carries, with its tenant and tier loaded.

    Raises a 401 `ApiError` for a missing, malformed, unknown, wrong, revoked or expired
    key, or one whose tenant is inactive. Reads only: the caller records the key's use
    (`actions.mark_key_used` on synchronous views, `note_key_use` on the streaming paths).
    """
    token = bearer_token(header)
    if token is None:
        raise errors.missing_api_key()
    parsed = keys.parse(token)
    if parsed is None:
        raise errors.invalid_api_key()
    api_key = ApiKey.objects.select_related("tenant__tier").filter(prefix=parsed.prefix).first()
    matched = keys.matches(parsed.plaintext, api_key.digest if api_key else _NO_SUCH_DIGEST)
    if api_key is None or not matched:
        raise errors.invalid_api_key()
    # From here on the caller has proved it holds the secret, so saying why is safe.
    _check_live(api_key, timezone.now())
    return api_key


def _check_live(api_key: ApiKey, now) -> None:
    if api_key.revoked is not None:
        raise errors.invalid_api_key("This API key has been revoked.")
    if not api_key.is_usable(now):
        raise errors.invalid_api_key("This API key has expired.")
    if not api_key.tenant.is_active:
        raise errors.invalid_api_key("This API key's organization is inactive.")


def reload_key(api_key_id: int) -> ApiKey:
    """The key as the database has it now (tenant and tier loaded), for a caller that
    authenticated earlier and holds on (a WebSocket): 401 once it is revoked, expired, gone
    or its tenant deactivated."""
    api_key = ApiKey.objects.select_related("tenant__tier").filter(pk=api_key_id).first()
    if api_key is None:
        raise errors.invalid_api_key("This API key has been revoked.")
    _check_live(api_key, timezone.now())
    return api_key


def note_key_use(api_key: ApiKey) -> None:
    """Record the key's use without waiting on the database (the ledger's writer does it)."""
    from tenants.ledger import ledger

    now = timezone.now()
    if actions.key_use_is_news(api_key, now):
        ledger().touch_key(api_key.pk, now)
        api_key.last_used = now


class ApiKeyAuthentication(BaseAuthentication):
    """DRF: `request.user` is the `Tenant`, `request.auth` the `ApiKey`."""

    def authenticate(self, request: Request) -> tuple[Tenant, ApiKey] | None:
        header = request.META.get("HTTP_AUTHORIZATION")
        if not header:
            return None  # IsAuthenticated then answers 401 missing_api_key
        api_key = authenticate_bearer(header)
        actions.mark_key_used(api_key, timezone.now())
        # Known from now on, on every path: config.intake queues and bounds the key's requests
        # as its tenant's, not by address. (tenants.middleware imports this module.)
        from tenants import middleware

        middleware.remember(api_key)
        return api_key.tenant, api_key

    def authenticate_header(self, request: Request) -> str:
        return "Bearer"
