"""The shared Redis client for rate limits and readiness checks."""
from functools import lru_cache

import redis
from django.conf import settings


@lru_cache(maxsize=4)
def _client_for(url: str) -> redis.Redis:
    # Short timeouts: a request waiting on an unreachable Redis should fail fast with a
    # 503, not hang until the client gives up.
    return redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2, health_check_interval=30)


def client() -> redis.Redis:
    """The client for the current `REDIS_URL` (read per call, so tests can point it elsewhere)."""
    return _client_for(settings.REDIS_URL)
