"""The OpenAPI schema and Swagger UI of the live server, and Schemathesis fuzzing every
operation the schema describes against the real engine.

Tenant: "fuzz" (max_tokens_per_request 8, so each generated request is short; its tier
allows batch jobs, so the Files and Batch APIs are fuzzed past the tier check).
"""
from __future__ import annotations

import json
import re
from urllib.parse import urljoin

import pytest
import requests
import schemathesis
import yaml
from drf_spectacular.validation import validate_schema
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, status_code_conformance

from tests.live import LiveServer

TIMEOUT_S = 120  # a hang guard for each request, never a timing assertion
OPERATIONS = [
    ("/v1/chat/completions", "post"),
    ("/v1/completions", "post"),
    ("/v1/models", "get"),
    ("/v1/models/{model}", "get"),
    ("/api/v1/inference/chat", "post"),
    ("/api/v1/engine/stats", "get"),
    ("/api/v1/engine/fleet", "get"),
    ("/v1/files", "post"),
    ("/v1/files", "get"),
    ("/v1/files/{file_id}", "get"),
    ("/v1/files/{file_id}", "delete"),
    ("/v1/files/{file_id}/content", "get"),
    ("/v1/batches", "post"),
    ("/v1/batches", "get"),
    ("/v1/batches/{batch_id}", "get"),
    ("/v1/batches/{batch_id}/cancel", "post"),
    ("/tokenize", "post"),
    ("/detokenize", "post"),
    ("/v1/usage", "get"),
    ("/version", "get"),
]
# Examples per operation: valid ones run a generation (seconds each on a loaded 2-core box),
# invalid ones are refused at once. Derandomized, so every run sends the same requests.
FUZZ_EXAMPLES = {GenerationMode.POSITIVE: 10, GenerationMode.NEGATIVE: 50}


def get(live: LiveServer, path: str, **kwargs) -> requests.Response:
    return requests.get(urljoin(live.url, path), timeout=TIMEOUT_S, **kwargs)


@pytest.fixture(scope="module")
def schema_json(live: LiveServer) -> dict:
    response = get(live, "/api/schema/?format=json")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("application/vnd.oai.openapi+json")
    return response.json()


def test_schema_is_valid_openapi_3(schema_json: dict):
    assert schema_json["openapi"].startswith("3.")
    validate_schema(schema_json)  # the OpenAPI 3 JSON Schema; raises on an invalid document


def test_schema_lists_every_endpoint(schema_json: dict):
    for path, method in OPERATIONS:
        assert method in schema_json["paths"].get(path, {}), f"{method.upper()} {path} missing"
    # The consumer endpoints are documented with their real request bodies and errors.
    chat = schema_json["paths"]["/v1/chat/completions"]["post"]
    assert {"200", "400", "401", "429"} <= set(chat["responses"])
    body = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert "messages" in schema_json["components"]["schemas"][body]["required"]
    assert schema_json["components"]["securitySchemes"]["ApiKey"] == {
        "type": "http", "scheme": "bearer", "description": "A tenant API key: `sk-<prefix>_<secret>`."}


def test_schema_says_what_the_server_refuses(live: LiveServer, schema_json: dict):
    """The server refuses fields it does not know (as OpenAI does): the schema says so."""
    components = schema_json["components"]["schemas"]
    for path in ("/v1/chat/completions", "/v1/completions", "/api/v1/inference/chat"):
        ref = schema_json["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert components[ref.rsplit("/", 1)[1]]["additionalProperties"] is False, path
    response = requests.post(live.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {live.keys['fuzz']}"},
                             json={"messages": [{"role": "user", "content": "hi"}], "colour": "blue"}, timeout=TIMEOUT_S)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "colour"


def test_yaml_schema_is_the_same_document(live: LiveServer, schema_json: dict):
    response = get(live, "/api/schema/")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("application/vnd.oai.openapi")
    assert yaml.safe_load(response.text) == json.loads(json.dumps(schema_json))


def test_swagger_ui_is_served_without_a_cdn(live: LiveServer):
    page = get(live, "/api/docs/")
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    scripts_and_styles = [a for a in assets if a.endswith((".js", ".css"))]
    assert any(a.endswith("swagger-ui-bundle.js") for a in scripts_and_styles)
    assert any(a.endswith("swagger-ui.css") for a in scripts_and_styles)
    for asset in assets:
        assert asset.startswith("/static/"), f"{asset} is not served by this server"
        served = get(live, asset)
        assert served.status_code == 200, asset
        assert served.content, asset
    # The page points Swagger UI at this server's schema.
    assert "/api/schema/" in page.text


# --- fuzzing -------------------------------------------------------------------------------
# schemathesis.pytest.from_fixture cannot run here: its lazy parametrization writes
# `request.node._nodeid`, which pytest 9.2 no longer has. Each operation is parametrized
# here instead, and fuzzed from `schema[path][method]` strategies with Hypothesis.


@pytest.fixture(scope="module")
def fuzz_schema(live: LiveServer):
    config = schemathesis.Config.from_dict({
        "headers": {"Authorization": f"Bearer {live.keys['fuzz']}"},
        "request-timeout": TIMEOUT_S,
    })
    return schemathesis.openapi.from_url(live.url + "/api/schema/?format=json", config=config)


# An operation without a request body (the GETs, DELETE, cancel) has no invalid request to
# generate: any string is a valid path parameter.
NO_BODY = {("/v1/batches/{batch_id}/cancel", "post")}
FUZZ_RUNS = [(path, method, mode) for path, method in OPERATIONS
             for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
             if mode == GenerationMode.POSITIVE or (method == "post" and (path, method) not in NO_BODY)]


@pytest.mark.parametrize("path, method, mode", FUZZ_RUNS,
                         ids=[f"{method.upper()} {path} {mode.value}" for path, method, mode in FUZZ_RUNS])
def test_no_operation_answers_a_server_error_or_an_undocumented_status(fuzz_schema, path: str, method: str, mode: GenerationMode):
    """Valid requests (each reaching the engine for at most 8 tokens, the fuzz tier's cap) and
    invalid ones (which must be refused with a 4xx) never get a 5xx, nor a status the schema
    does not list for the operation."""

    @settings(max_examples=FUZZ_EXAMPLES[mode], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(case=fuzz_schema[path][method].as_strategy(mode))
    def check(case):
        case.call_and_validate(checks=[not_a_server_error, status_code_conformance])

    check()
