"""The fleet (inference.fleet): replicas report themselves to Redis, GET /api/v1/engine/fleet
lists them with their totals, and a replica that stops reporting leaves within three beats.

Replicas here are heartbeats with reports of their own against a real Redis; the last test
is the live server reporting its own engine. The bounds on waiting are hang guards.
"""
from __future__ import annotations

import threading
import time

import pytest
import requests

from inference import fleet
from tests.live import LiveServer

TIMEOUT_S = 120


def report(running: int, waiting_p1: int) -> dict:
    return {"state": "ready", "ready": True, "kv_block_size": 16, "kv_blocks_total": 100, "requests_running": running,
            "tokens_per_s": 10.5, "requests_waiting": {"0": 0, "1": waiting_p1, "2": 0}, "error": None}


def listed(client, token: str) -> dict:
    response = client.get("/api/v1/engine/fleet", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    return response.json()


@pytest.mark.django_db
def test_the_fleet_lists_every_replica_and_sums_their_numbers(client, redis, settings):
    settings.OPERATOR_API_TOKEN = token = "t" * 40
    for ident, running, waiting in (("a", 3, 1), ("b", 4, 2)):
        fleet.Heartbeat(lambda r=running, w=waiting: report(r, w), period_s=5, ident=ident,
                        url=f"http://replica-{ident}:8000").beat()
    body = listed(client, token)
    assert [(r["id"], r["url"], r["state"]) for r in body["replicas"]] == [
        ("a", "http://replica-a:8000", "ready"), ("b", "http://replica-b:8000", "ready")]
    assert all(r["pid"] > 0 and r["last_seen"] <= time.time() for r in body["replicas"])
    assert body["replicas"][0]["stats"] == report(3, 1)
    totals = body["totals"]
    assert (totals["replicas"], totals["replicas_ready"]) == (2, 2)
    assert (totals["requests_running"], totals["kv_blocks_total"], totals["tokens_per_s"]) == (7, 200, 21.0)
    assert totals["requests_waiting"] == {"0": 0, "1": 3, "2": 0}
    assert "kv_block_size" not in totals and "state" not in totals


@pytest.mark.django_db
@pytest.mark.django_db
def test_an_engine_that_replicas_share_is_counted_once(client, redis, settings):
    """Web processes sharing one engine (INFERENCE_ENGINE_SOCKET) each report its numbers: the
    fleet adds them once, and each process's own streams and requests in flight every time."""
    settings.OPERATOR_API_TOKEN = token = "t" * 40
    for ident, engine, in_flight in (("a", "host:1", 2), ("b", "host:1", 5), ("c", None, 1)):
        fleet.Heartbeat(lambda e=engine, n=in_flight: {**report(3, 1), "engine": e, "requests_in_flight": n},
                        period_s=5, ident=ident, url=f"http://replica-{ident}:8000").beat()
    totals = listed(client, token)["totals"]
    assert (totals["replicas"], totals["engines"]) == (3, 2)
    assert (totals["requests_running"], totals["kv_blocks_total"], totals["requests_waiting"]["1"]) == (6, 200, 2)
    assert totals["requests_in_flight"] == 8


def test_a_replica_that_stops_reporting_leaves_within_three_beats_and_one_that_stops_cleanly_at_once(
        client, redis, settings):
    settings.OPERATOR_API_TOKEN = token = "t" * 40
    dying = fleet.Heartbeat(lambda: report(1, 0), period_s=0.2, ident="dying")
    leaving = fleet.Heartbeat(lambda: report(1, 0), period_s=0.2, ident="leaving")
    dying.start()
    leaving.start()
    deadline = time.monotonic() + 10
    while {r["id"] for r in listed(client, token)["replicas"]} != {"dying", "leaving"}:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    leaving.stop()
    assert {r["id"] for r in listed(client, token)["replicas"]} == {"dying"}
    dying._stop.set()  # its process died: no more reports, nothing removed
    dying._thread.join()
    stopped = time.monotonic()
    while listed(client, token)["replicas"]:
        assert time.monotonic() - stopped < 3 * 0.2 + 2, "a replica that stopped reporting stayed in the fleet"
        time.sleep(0.05)
    assert redis.smembers(fleet.MEMBERS) == set()  # the expired id is dropped from the set too


@pytest.mark.django_db
def test_a_replica_that_leaves_while_its_report_is_slow_stays_gone(client, redis, settings):
    """A beat still gathering its report when the replica stops (a draining engine's stats, a
    sweep past stop()'s join) must not write the entry back after the removal."""
    settings.OPERATOR_API_TOKEN = token = "t" * 40
    slow, released = threading.Event(), threading.Event()

    def slow_report() -> dict:
        if slow.is_set():
            released.wait(TIMEOUT_S)
        return report(1, 0)

    leaving = fleet.Heartbeat(slow_report, period_s=0.2, ident="leaving")
    leaving.start()
    deadline = time.monotonic() + 10
    while not listed(client, token)["replicas"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    slow.set()
    time.sleep(0.5)  # the next beat is now inside its report
    leaving.stop()  # joins for period_s + 1 s, then removes the entry
    assert listed(client, token)["replicas"] == []
    released.set()  # the stalled beat finishes its report
    leaving._thread.join(TIMEOUT_S)
    assert not leaving._thread.is_alive()
    assert listed(client, token)["replicas"] == [] and redis.smembers(fleet.MEMBERS) == set()


@pytest.mark.django_db
def test_the_fleet_needs_operator_credentials_and_answers_503_while_redis_is_away(client, settings):
    settings.OPERATOR_API_TOKEN = "t" * 40
    assert client.get("/api/v1/engine/fleet").status_code == 401
    assert client.get("/api/v1/engine/fleet", HTTP_AUTHORIZATION="Bearer " + "x" * 40).status_code == 403
    away = client.get("/api/v1/engine/fleet", HTTP_AUTHORIZATION="Bearer " + "t" * 40)  # no `redis` fixture
    assert away.status_code == 503 and away.json()["error"]["code"] == "service_unavailable"
    assert away["Retry-After"]


def test_the_live_server_reports_its_own_engine_to_the_fleet(live: LiveServer):
    headers = {"Authorization": f"Bearer {live.internal_token}"}
    deadline = time.monotonic() + 30
    while True:
        body = requests.get(live.url + "/api/v1/engine/fleet", headers=headers, timeout=TIMEOUT_S).json()
        if body["replicas"] and body["replicas"][0]["state"] == "ready":
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.2)
    stats = requests.get(live.url + "/api/v1/engine/stats", headers=headers, timeout=TIMEOUT_S).json()
    [replica] = body["replicas"]
    assert replica["url"] == live.url and replica["pid"] > 0
    assert set(replica["stats"]) == set(stats)
    assert replica["stats"]["kv_blocks_total"] == stats["kv_blocks_total"] == body["totals"]["kv_blocks_total"]
    assert body["totals"]["replicas_ready"] == 1
