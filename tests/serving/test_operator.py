"""Operator endpoints on the live server: /api/v1/engine/stats and /metrics, and prefix-cache
isolation between tenants seen through the API's usage.

Tenants: "ops" (an ordinary key), "iso-a" and "iso-b" (an ordinary tier: their prefix caches are
their own, as every tier's are unless it shares).
"""
from __future__ import annotations

import re
import secrets

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.live import LiveServer

TIMEOUT_S = 120  # a hang guard for each request, never a timing assertion
STATS_FIELDS = ("kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "kv_blocks_used", "swap_blocks_used",
                "requests_running", "requests_swapped", "preemptions")


def stats_response(live: LiveServer, headers: dict | None = None, cookies: dict | None = None) -> requests.Response:
    return requests.get(live.url + "/api/v1/engine/stats", headers=headers or {}, cookies=cookies, timeout=TIMEOUT_S)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --- /api/v1/engine/stats ------------------------------------------------------------------


def test_stats_need_credentials(live: LiveServer):
    response = stats_response(live)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "unauthenticated"


@pytest.mark.parametrize("token", ["tenant key", "wrong internal token"])
def test_stats_refuse_other_tokens(live: LiveServer, token: str):
    value = live.keys["ops"] if token == "tenant key" else live.internal_token + "x"
    response = stats_response(live, bearer(value))
    assert response.status_code == 403
    assert response.json()["error"]["type"] == "permission_error"


def test_stats_with_the_internal_token(live: LiveServer):
    response = stats_response(live, bearer(live.internal_token))
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "application/json"
    assert "no-cache" in response.headers["Cache-Control"]
    stats = response.json()
    assert stats["ready"] is True and stats["state"]
    for name in STATS_FIELDS:
        assert isinstance(stats[name], int) and stats[name] >= 0, name
    assert stats["kv_blocks_total"] > 0
    assert stats["kv_blocks_free"] + stats["kv_blocks_used"] <= stats["kv_blocks_total"]
    assert stats["kv_blocks_cached"] <= stats["kv_blocks_total"]
    assert set(stats["requests_waiting"]) == {"0", "1", "2"}
    assert all(isinstance(n, int) and n >= 0 for n in stats["requests_waiting"].values())


def test_stats_count_a_generation(live: LiveServer):
    before = live.stats()
    response = requests.post(live.url + "/v1/chat/completions", headers=bearer(live.keys["ops"]), timeout=TIMEOUT_S,
                             json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 3})
    assert response.status_code == 200
    after = live.wait_idle(timeout=30)
    assert after["finished_requests"] >= before["finished_requests"] + 1
    assert after["generated_tokens"] >= before["generated_tokens"] + 3


@pytest.mark.parametrize("path", ["/api/v1/engine/stats", "/metrics"])
def test_operator_endpoints_only_read(live: LiveServer, path: str):
    response = requests.post(live.url + path, headers=bearer(live.internal_token), timeout=TIMEOUT_S)
    assert response.status_code == 405
    assert response.headers["Allow"] == "GET"
    assert response.json()["error"]["code"] == "method_not_allowed"


def create_user(live: LiveServer, staff: bool) -> tuple[str, str]:
    username, password = f"op-{secrets.token_hex(4)}", secrets.token_urlsafe(16)
    live.django(f"""
        from django.contrib.auth import get_user_model
        get_user_model().objects.create_user({username!r}, password={password!r}, is_staff={staff!r})
        result = True
    """)
    return username, password


def admin_login(live: LiveServer, username: str, password: str) -> requests.Session:
    """Log in through the admin's login form, as a person would."""
    session = requests.Session()
    form = session.get(live.url + "/admin/login/", timeout=TIMEOUT_S)
    assert form.status_code == 200
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
    session.post(live.url + "/admin/login/?next=/admin/", timeout=TIMEOUT_S, allow_redirects=False,
                 data={"username": username, "password": password, "csrfmiddlewaretoken": csrf, "next": "/admin/"})
    return session


def test_staff_session_reads_stats(live: LiveServer):
    session = admin_login(live, *create_user(live, staff=True))
    assert "sessionid" in session.cookies
    response = session.get(live.url + "/api/v1/engine/stats", timeout=TIMEOUT_S)
    assert response.status_code == 200
    assert response.json()["kv_blocks_total"] > 0


def test_non_staff_user_cannot_read_stats(live: LiveServer):
    username, password = create_user(live, staff=False)
    # The admin does not let a non-staff user in, so no session comes of the login form...
    session = admin_login(live, username, password)
    assert session.get(live.url + "/api/v1/engine/stats", timeout=TIMEOUT_S).status_code == 401
    # ...and a session the user did get (from any other login page) does not open the stats either.
    cookie = live.django(f"""
        from django.conf import settings
        from django.contrib.auth import get_user_model
        from django.test import Client
        client = Client()
        client.force_login(get_user_model().objects.get(username={username!r}))
        result = client.cookies[settings.SESSION_COOKIE_NAME].value
    """)
    response = stats_response(live, cookies={"sessionid": cookie})
    assert response.status_code in (401, 403)
    assert "error" in response.json()


# --- /metrics ------------------------------------------------------------------------------


def metric_families(text: str) -> dict[str, list]:
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_metrics_open_on_loopback(live: LiveServer):
    response = requests.get(live.url + "/metrics", timeout=TIMEOUT_S)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert re.search(r"^llm_engine_kv_blocks_total \d", response.text, re.MULTILINE)
    assert re.search(r"^llm_engine_ready 1(\.0)?$", response.text, re.MULTILINE)
    families = metric_families(response.text)  # parses as Prometheus text, or raises
    assert families["llm_engine_kv_blocks_total"][0].value == live.stats()["kv_blocks_total"]
    assert {s.labels["lane"] for s in families["llm_engine_requests_waiting"]} == {"P0", "P1", "P2"}
    assert families["llm_limits_local"][0].value == 0  # Redis answers (tests/reliability: while it stalls)
    assert families["llm_limits_fallbacks"][0].value >= 0
    # The heap held once the engine loaded (the model, Django, Twisted) is out of the collector's
    # walks (inference.heap); before, each full collection walked it, 190-330 ms with the GIL held.
    assert families["process_gc_frozen_objects"][0].value > 100_000
    assert {s.labels["generation"] for s in families["process_gc_pause_seconds"]} == {"0", "1", "2"}


def test_metrics_through_a_proxy_need_the_token(live: LiveServer):
    forwarded = {"X-Forwarded-For": "203.0.113.7"}
    refused = requests.get(live.url + "/metrics", headers=forwarded, timeout=TIMEOUT_S)
    assert refused.status_code == 401
    assert "llm_engine" not in refused.text
    wrong = requests.get(live.url + "/metrics", headers={**forwarded, **bearer(live.keys["ops"])}, timeout=TIMEOUT_S)
    assert wrong.status_code == 403
    allowed = requests.get(live.url + "/metrics", headers={**forwarded, **bearer(live.internal_token)}, timeout=TIMEOUT_S)
    assert allowed.status_code == 200
    assert "llm_engine_kv_blocks_total" in metric_families(allowed.text)


# --- prefix-cache isolation ----------------------------------------------------------------


def cached_tokens(live: LiveServer, tenant: str, prompt: str) -> tuple[int, int]:
    response = requests.post(
        live.url + "/v1/chat/completions", headers=bearer(live.keys[tenant]), timeout=TIMEOUT_S,
        json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 1},
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def test_isolated_tenants_do_not_share_prefix_cache(live: LiveServer):
    words = " ".join(f"item-{i}" for i in range(150))
    prompt = f"Here is a long inventory list, read it carefully: {words}. How many items?"
    block_size = live.stats()["kv_block_size"]

    first, prompt_tokens = cached_tokens(live, "iso-a", prompt)
    assert prompt_tokens > 4 * block_size
    # The chat template's system prefix is cached by every tenant's earlier requests; an
    # isolated tenant still reuses nothing it did not compute itself.
    assert first == 0
    again, _ = cached_tokens(live, "iso-a", prompt)
    assert again >= prompt_tokens - block_size  # every full block of its own prompt
    other, _ = cached_tokens(live, "iso-b", prompt)
    assert other == 0
    # iso-b's own second request hits its own cache: the zero above is isolation, not a cold cache.
    other_again, _ = cached_tokens(live, "iso-b", prompt)
    assert other_again >= prompt_tokens - block_size


def test_a_tenant_reuses_its_own_prefix_cache_across_requests(live: LiveServer):
    words = " ".join(f"part-{i}" for i in range(150))
    prompt = f"A different long list for one tenant: {words}. Which part comes last?"
    first, prompt_tokens = cached_tokens(live, "ops", prompt)
    again, _ = cached_tokens(live, "ops", prompt)
    assert first < again
    assert again >= prompt_tokens - live.stats()["kv_block_size"]
