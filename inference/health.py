"""Probes: /healthz (the process answers) and /readyz (its dependencies answer too)."""
import logging

from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from config import redis as shared_redis
from inference.readiness import engine_state

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
        return bool(shared_redis.client().ping())
    except Exception as exc:
        log.warning("readyz: redis unavailable: %s", exc)
        return False


@never_cache
@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    engine = engine_state()
    checks = {
        "database": "ok" if _database_ok() else "unavailable",
        "redis": "ok" if _redis_ok() else "unavailable",
        "engine": engine.state,
    }
    ready = checks["database"] == "ok" and checks["redis"] == "ok" and engine.ready
    return JsonResponse({"status": "ready" if ready else "not ready", "checks": checks}, status=200 if ready else 503)
