"""The shared Redis client for rate limits and readiness checks."""
from functools import lru_cache

import redis
from django.conf import settings
from redis.backoff import NoBackoff
from redis.retry import Retry


@lru_cache(maxsize=4)
def _client_for(url: str) -> redis.Redis:
    # Short timeouts: a request waiting on an unreachable Redis should fail fast with a
    # 503, not hang until the client gives up.
    return redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2, health_check_interval=30)


def client() -> redis.Redis:
    """The client for the current `REDIS_URL` (read per call, so tests can point it elsewhere)."""
    return _client_for(settings.REDIS_URL)


@lru_cache(maxsize=4)
def _fast_client_for(url: str, timeout_s: float) -> redis.Redis:
    # No retries: redis-py's default (3, with backoff) would turn a 0.1 s deadline into seconds.
    return redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0), health_check_interval=30)


def admission_client() -> redis.Redis:
    """The client admission asks under a short deadline (LIMITS_REDIS_TIMEOUT_S)."""
    return _fast_client_for(settings.REDIS_URL, settings.LIMITS_REDIS_TIMEOUT_S)


def confirm_client() -> redis.Redis:
    """The client that tells a missed deadline from Redis away (LIMITS_REDIS_CONFIRM_S)."""
    return _fast_client_for(settings.REDIS_URL, settings.LIMITS_REDIS_CONFIRM_S)
