"""The API's own paths answer in the OpenAI error shape, unknown ones included, and a model can
be retrieved by id (`client.models.retrieve`). Django's test client: no engine runs here, so the
model's `max_model_len` is null (the live test in test_openai_client.py sees the number)."""
import pytest

from tenants import actions
from tenants.models import QuotaTier

pytestmark = pytest.mark.django_db

SERVED = "SmolLM2-135M-Instruct"


@pytest.fixture
def key(redis) -> str:
    return actions.issue_key(actions.create_tenant("acme", QuotaTier.objects.get(name="standard"))).plaintext


def test_a_served_model_is_retrieved_by_id_and_an_unknown_one_is_404(client, key):
    auth = {"HTTP_AUTHORIZATION": f"Bearer {key}"}
    response = client.get(f"/v1/models/{SERVED}", **auth)
    assert response.status_code == 200
    assert response.json() | {"created": 0} == {"id": SERVED, "object": "model", "created": 0, "owned_by": "platform",
                                                "max_model_len": None}
    assert response.json() == client.get("/v1/models", **auth).json()["data"][0]
    missing = client.get("/v1/models/gpt-4o", **auth)
    assert missing.status_code == 404
    assert missing.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                        "param": "model", "code": "model_not_found"}
    assert "gpt-4o" in missing.json()["error"]["message"]
    assert client.get(f"/v1/models/{SERVED}").status_code == 401


@pytest.mark.parametrize("method", ["get", "post", "delete"])
@pytest.mark.parametrize("path", ["/v1/nothing-here", "/v1/chat/completions/extra", "/api/v2/engine/stats", "/v1",
                                  "/internal/v1/embeddings"])
def test_an_unknown_api_path_is_a_json_404_in_the_openai_shape(client, path, method):
    response = getattr(client, method)(path)
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_url")
    assert method.upper() in error["message"]


def test_other_unknown_paths_keep_djangos_page(client):
    response = client.get("/no-such-page")
    assert response.status_code == 404
    assert not response["Content-Type"].startswith("application/json")


def test_a_wrong_method_on_an_api_path_is_a_json_405(client, key):
    for path in ("/v1/models", "/v1/files/file-x", "/api/v1/engine/stats"):
        response = client.put(path, HTTP_AUTHORIZATION=f"Bearer {key}")
        assert response.status_code == 405, path
        assert response.json()["error"]["code"] == "method_not_allowed", path
    assert client.post("/api/v1/engine/stats")["Allow"] == "GET"
