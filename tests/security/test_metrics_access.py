"""/metrics behind a proxy on the same host (issue 24, suspected: "/metrics public behind a
same-host proxy that adds no X-Forwarded-For"). Confirmed: any request from loopback without
X-Forwarded-For was let in without a token, and behind nginx on the same host every request
is one. Loopback is now trusted only where METRICS_ALLOW_LOOPBACK says so, never by default
in production.
"""
from __future__ import annotations

import os
import subprocess
import sys

METRICS_TOKEN = "metrics-token-for-this-test-0123456789"


def test_metrics_from_a_same_host_proxy_without_x_forwarded_for_need_the_token(client, settings):
    settings.METRICS_ALLOW_LOOPBACK = False  # production's default
    settings.METRICS_TOKEN = METRICS_TOKEN
    refused = client.get("/metrics", REMOTE_ADDR="127.0.0.1")  # what nginx on this host looks like
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "unauthenticated" and b"llm_engine" not in refused.content
    allowed = client.get("/metrics", REMOTE_ADDR="127.0.0.1", HTTP_AUTHORIZATION=f"Bearer {METRICS_TOKEN}")
    assert allowed.status_code == 200 and b"llm_engine_ready" in allowed.content


def test_metrics_stay_open_on_loopback_where_the_setting_allows_it(client, settings):
    settings.METRICS_ALLOW_LOOPBACK = True  # the development default (`make run`)
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="203.0.113.7").status_code == 401
    assert client.get("/metrics", REMOTE_ADDR="203.0.113.7").status_code == 401


def test_production_does_not_trust_loopback_by_default():
    env = {k: v for k, v in os.environ.items() if k != "METRICS_ALLOW_LOOPBACK"}
    env.update(DJANGO_ENV="production", SECRET_KEY="x" * 50, ALLOWED_HOSTS="api.example.com",
               INTERNAL_API_TOKEN="t" * 40, DJANGO_SETTINGS_MODULE="config.settings")
    done = subprocess.run([sys.executable, "-c", "from django.conf import settings; print(settings.METRICS_ALLOW_LOOPBACK)"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
