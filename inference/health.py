"""Probes: /healthz (the process answers) and /readyz (its dependencies answer too)."""
import logging

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from config import redis as shared_redis
from inference import drain
from inference.readiness import engine_state
from tenants import quota

log = logging.getLogger(__name__)


@never_cache
@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def _database_ok() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return True
    except Exception as exc:  # any driver error means "not ready"
        log.warning("readyz: database unavailable: %s", exc)
        return False


def _redis_ok() -> bool:
    try:
        # Admission's client: a stalled Redis answers within its deadline, not the shared client's 2 s.
        return bool(shared_redis.admission_client().ping())
    except Exception as exc:
        log.warning("readyz: redis unavailable: %s", exc)
        return False


def _limits(redis_ok: bool) -> str:
    """Where admission decides limits: `redis`, `local` (this process alone while Redis is
    away, tenants.fallback) or `unavailable` (away, and LIMITS_FALLBACK_SHARE is 0)."""
    if redis_ok and not quota.limiter().breaker.open:
        return "redis"
    return "local" if settings.LIMITS_FALLBACK_SHARE > 0 else "unavailable"


@never_cache
@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    engine = engine_state()
    redis_ok = _redis_ok()
    checks = {
        "database": "ok" if _database_ok() else "unavailable",
        "redis": "ok" if redis_ok else "unavailable",
        "limits": _limits(redis_ok),
        "engine": engine.state,
    }
    # Redis away is not a reason to leave the rotation while limits are decided locally: every
    # replica shares that Redis, so a balancer would take them all out at once.
    ready = checks["database"] == "ok" and checks["limits"] != "unavailable" and engine.ready
    if drain.draining():  # SIGTERM: out of the balancer's rotation while its streams finish
        return JsonResponse({"status": "draining", "checks": checks}, status=503)
    return JsonResponse({"status": "ready" if ready else "not ready", "checks": checks}, status=200 if ready else 503)
