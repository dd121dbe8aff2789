"""Probes: /healthz answers while the process is up; /readyz only when its dependencies do."""
import pytest

from tenants import actions
from tenants.models import QuotaTier

pytestmark = pytest.mark.django_db


def test_healthz_needs_nothing_but_the_process(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_is_not_ready_until_the_engine_serves(client, redis):
    # The Django test client never goes through config.asgi, so no engine was started here;
    # the live-server tests see /readyz turn 200 once the model is loaded.
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {
        "status": "not ready",
        "checks": {"database": "ok", "redis": "ok", "limits": "redis", "engine": "not started"},
    }


def test_readyz_says_limits_are_local_while_redis_is_unreachable(client, settings):
    response = client.get("/readyz")  # no `redis` fixture: settings point at a closed port
    assert response.json()["checks"]["redis"] == "unavailable"
    assert response.json()["checks"]["limits"] == "local"  # ready with an engine (tests/reliability)
    settings.LIMITS_FALLBACK_SHARE = 0
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["limits"] == "unavailable"


def test_models_lists_the_configured_model_in_the_openai_shape(client, redis, settings):
    issued = actions.issue_key(actions.create_tenant("acme", QuotaTier.objects.get(name="standard")))
    response = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {issued.plaintext}")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in body["data"]] == [
        ("SmolLM2-135M-Instruct", "model", "platform")
    ]
    settings.INFERENCE = {**settings.INFERENCE, "MODEL": "/models/Qwen2-0.5B.gguf"}
    response = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {issued.plaintext}")
    assert [m["id"] for m in response.json()["data"]] == ["Qwen2-0.5B"]
    assert client.get("/v1/models").status_code == 401
