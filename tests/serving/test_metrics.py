"""/metrics on the live server: responses by route, status and tenant, 429s by limit kind, batch
items and the Celery queue (inference.http_metrics) beside the engine's series; and the Grafana
dashboard and the Prometheus example in deploy/, checked against what a live server exports.

Tenants: "metrics" (an ordinary key), "metrics-tight" (3 requests a minute), "metrics-batch" (batch jobs).
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from batches.upload_gate import _too_many_uploads
from inference.engine.api import QueueFullError
from inference.http_metrics import BACKLOG_CACHE_S, limit_kind
from inference.streaming import engine_error
from inference.websocket import _frames_exceeded
from tenants import errors
from tests import wsclient
from tests.live import ROOT, LiveServer

TIMEOUT_S = 120  # a hang guard for each request, never a timing assertion
DASHBOARD = ROOT / "deploy" / "grafana" / "llm-platform.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
# The names a PromQL expression or a variable query of the dashboard reads.
METRIC_NAME = re.compile(r"\b(?:llm|process)_[a-z0-9_]+\b")

Samples = dict[tuple[str, frozenset], float]


def scrape(live: LiveServer) -> Samples:
    response = requests.get(live.url + "/metrics", timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 for a series not exported yet (a counter that never moved)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(live: LiveServer, key: str, max_tokens: int = 4) -> requests.Response:
    return requests.post(live.url + "/v1/chat/completions", headers=bearer(key), timeout=TIMEOUT_S, json={
        "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def test_bodies_refused_at_the_servers_limit_are_counted(live: LiveServer):
    """daphne's hook answers a body over the limit before any application sees the request
    (config.daphne_hooks): those 413s never reached the counting layer, so a dashboard showed
    no refused uploads however many there were."""
    host, port = live.url.removeprefix("http://").split(":")
    before = scrape(live)
    for path in ("/v1/chat/completions", "/v1/files"):
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {10**12}\r\n\r\n".encode())
            assert sock.recv(64).startswith(b"HTTP/1.1 413 "), path
    after = scrape(live)
    for endpoint in ("v1/chat/completions", "v1/files"):
        labels = {"endpoint": endpoint, "status": "413", "tenant": "none"}
        assert value(after, "llm_http_responses_total", **labels) - value(before, "llm_http_responses_total", **labels) == 1


def test_responses_and_refusals_are_counted_by_route_status_tenant_and_kind(live: LiveServer):
    key, tenant = live.keys["metrics"], str(live.tenant_ids["metrics"])
    tight, tight_tenant = live.keys["metrics-tight"], str(live.tenant_ids["metrics-tight"])
    before = scrape(live)

    served = chat(live, key)
    assert served.status_code == 200, served.text
    assert requests.get(live.url + "/v1/models/no-such-model", headers=bearer(key), timeout=TIMEOUT_S).status_code == 404
    assert requests.get(live.url + "/no/such/page", timeout=TIMEOUT_S).status_code == 404
    for _ in range(3):  # the tight tier's requests/min, spent on a DRF view
        assert requests.get(live.url + "/v1/models", headers=bearer(tight), timeout=TIMEOUT_S).status_code == 200
    refused = chat(live, tight)  # refused by the Channels key middleware
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"
    assert requests.get(live.url + "/v1/models", headers=bearer(tight), timeout=TIMEOUT_S).status_code == 429  # by DRF

    async def sockets():
        async with wsclient.connect(wsclient.ws_url(live), additional_headers=wsclient.bearer(key)):
            pass  # a key in the header: accepted with no message
        async with wsclient.connect(wsclient.ws_url(live), additional_headers=wsclient.bearer(tight)) as ws:
            messages, code = await wsclient.until_closed(ws, within_s=30)
        assert code == 4429 and messages[0]["error"]["type"] == "requests"

    wsclient.run(sockets())
    after = scrape(live)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    responses = "llm_http_responses_total"
    assert grew(responses, endpoint="v1/chat/completions", status="200", tenant=tenant) == 1
    assert grew(responses, endpoint="v1/models/<path:model>", status="404", tenant=tenant) == 1
    assert grew(responses, endpoint="unmatched", status="404", tenant="none") == 1  # no route: Django's own 404
    assert grew(responses, endpoint="v1/models", status="200", tenant=tight_tenant) == 3
    assert grew(responses, endpoint="v1/chat/completions", status="429", tenant=tight_tenant) == 1
    assert grew(responses, endpoint="v1/models", status="429", tenant=tight_tenant) == 1
    # A WebSocket's handshake is accepted, then a refusal closes it: 101 with its tenant either way.
    assert grew(responses, endpoint="ws/v1/chat", status="101", tenant=tenant) == 1
    assert grew(responses, endpoint="ws/v1/chat", status="101", tenant=tight_tenant) == 1
    assert grew(responses, endpoint="metrics", status="200", tenant="none") == 1  # the first scrape
    # The SSE consumer's, DRF's and the socket's refusals, each read from its own path.
    assert grew("llm_rate_limited_total", kind="requests") == 3
    assert grew("llm_rate_limited_total", kind="tokens") == 0

    usage = served.json()["usage"]
    assert grew("llm_engine_prompt_tokens_total", tenant=tenant) == usage["prompt_tokens"]
    assert grew("llm_engine_generation_tokens_total", tenant=tenant) == usage["completion_tokens"] == 4
    for histogram in ("llm_engine_e2e_request_latency_seconds", "llm_engine_request_queue_time_seconds",
                      "llm_engine_time_to_first_token_seconds", "llm_engine_time_per_output_token_seconds"):
        assert grew(f"{histogram}_count", lane="P1") >= 1, histogram
        assert grew(f"{histogram}_bucket", lane="P1", le="+Inf") == grew(f"{histogram}_count", lane="P1")
    # A prefill and three decodes at least; a speculative engine (the serving tests run under
    # INFERENCE_SPECULATIVE too) may verify the last three tokens in one step.
    speculative = os.environ.get("INFERENCE_SPECULATIVE", "off") != "off"
    assert grew("llm_engine_step_duration_seconds_count") >= (2 if speculative else 4)
    assert 0 <= value(after, "llm_engine_kv_usage_ratio") <= 1


def test_batch_items_by_state_and_the_celery_queue(live: LiveServer):
    key = live.keys["metrics-batch"]
    lines = [{"custom_id": f"m{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}} for i in range(2)]
    upload = requests.post(live.url + "/v1/files", headers=bearer(key), timeout=TIMEOUT_S, data={"purpose": "batch"},
                           files={"file": ("m.jsonl", "\n".join(map(json.dumps, lines)).encode())})
    assert upload.status_code == 200, upload.text
    created = requests.post(live.url + "/v1/batches", headers=bearer(key), timeout=TIMEOUT_S, json={
        "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    try:
        # The serving tests run no worker: the messages the platform's own dispatch sends wait in
        # the broker, where the gauge finds them, and the items stay queued.
        assert live.django(f"from batches import actions\nresult = actions.dispatch({batch_id!r})") == 2
        deadline = time.monotonic() + BACKLOG_CACHE_S + 30  # the gauges are read at most every BACKLOG_CACHE_S
        while True:
            samples = scrape(live)
            queued = value(samples, "llm_batch_items", state="queued")
            waiting = value(samples, "llm_celery_queue_length", queue="celery")
            if queued >= 2 and waiting >= 2:
                break
            assert time.monotonic() < deadline, (queued, waiting)
            time.sleep(0.5)
        assert ("llm_batch_items", frozenset({("state", "succeeded")})) in samples  # every state, zeros included
    finally:
        requests.post(live.url + f"/v1/batches/{batch_id}/cancel", headers=bearer(key), timeout=TIMEOUT_S)


def test_each_429_the_platform_builds_names_its_limit():
    refusals = {
        "streams": errors.slot_queue_full(2, 16),
        "budget": errors.quota_exhausted(1000, 60),
        "lane": engine_error(QueueFullError("lane P1 is full", retry_after_s=3, lane=1)),
        "uploads": _too_many_uploads(),
        "requests": _frames_exceeded(),
    }
    assert {kind: limit_kind(e.type, e.code) for kind, e in refusals.items()} == {k: k for k in refusals}
    assert limit_kind("insufficient_quota", "budget_reserved") == "budget"
    assert limit_kind("tokens", "rate_limit_exceeded") == "tokens"
    assert limit_kind("invalid_request_error", None) == "other"


# --- deploy/grafana and deploy/prometheus ----------------------------------------------------


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(board: dict) -> list[str]:
    """Every PromQL expression of the dashboard's panels and variables."""
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", ())]
    return exprs + [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]


def test_the_dashboard_is_a_grafana_dashboard():
    board = dashboard()
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"instance", "lane", "tenant"} <= set(variables)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in board["panels"] if p["type"] != "row"]
    assert len(graphs) >= 15
    for panel in board["panels"]:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    for panel in graphs:
        assert panel["title"] and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert target["refId"] and METRIC_NAME.search(target["expr"]), panel["title"]
    # No two panels overlap on the 24-column grid.
    cells = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & area, panel["title"]
        cells |= area
    for variable in ("$instance", "$lane", "$tenant"):
        assert any(variable in expr for expr in queries(board)), variable


def test_every_metric_the_dashboard_reads_is_exported(live: LiveServer):
    assert chat(live, live.keys["metrics"]).status_code == 200  # so the per-lane histograms have series
    exported = {name for name, _ in scrape(live)}
    read = {name for expr in queries(dashboard()) for name in METRIC_NAME.findall(expr)}
    assert {"llm_http_responses_total", "llm_rate_limited_total", "llm_batch_items", "llm_celery_queue_length",
            "llm_engine_e2e_request_latency_seconds_bucket", "llm_engine_step_duration_seconds_bucket",
            "llm_engine_kv_usage_ratio", "llm_engine_prompt_tokens_total"} <= read
    assert read - exported == set()


def test_every_series_is_in_the_documented_table(live: LiveServer):
    response = requests.get(live.url + "/metrics", timeout=TIMEOUT_S)
    table = (ROOT / "docs" / "deploy.md").read_text()
    families = list(text_string_to_metric_families(response.text))
    names = {f"{f.name}_total" if f.type == "counter" else f.name for f in families}
    assert {name for name in names if f"`{name}`" not in table} == set()
    # No creation-time series beside each counter and histogram (prometheus_client's default).
    assert not [s.name for f in families for s in f.samples if s.name.endswith("_created")]


def test_the_prometheus_example_scrapes_every_replica_with_the_metrics_token():
    config = yaml.safe_load(PROMETHEUS.read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer" and Path(job["authorization"]["credentials_file"]).is_absolute()
    assert "credentials" not in job["authorization"]  # the token stays out of the file
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert len(targets) >= 2 and len(set(targets)) == len(targets)
    assert all(re.fullmatch(r"[\w.-]+:\d+", t) for t in targets)
