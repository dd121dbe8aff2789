"""The engine process behind a live replica (inference.engine.process): killed under a stream,
the client gets the API's error, the tokens it got are billed, /readyz turns 503 until another
engine process serves, and the replica serves again. And the engine in a thread of the web
process (INFERENCE_ENGINE_PROCESS=false) serves what the process serves, token for token."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.isolation_env import BIG
from tests.live import LiveServer, start_live_server
from tests.serving.rawsse import OPENAI_CHAT, Event, SocketStream, chat_body

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    server, stop = start_live_server(tmp_path_factory.mktemp("engine-process"), {"t": {"lane": 1, **BIG}}, {"t": "t"})
    try:
        yield server
    finally:
        stop()


def engine_processes(server: LiveServer) -> list[int]:
    """Pids of the engine processes whose parent is this server's daphne."""
    port = server.url.rsplit(":", 1)[1]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "inference.engine.process" not in cmdline:
                continue
            ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if f"tcp:port={port}:" in parent:
            found.append(int(entry.name))
    return found


def readyz(server: LiveServer) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(server.url + "/readyz", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def greedy_chat(server: LiveServer, key: str) -> dict:
    # ignore_eos: where the model's reply ends before 16 tokens depends on the CPU's kernels
    # (12 tokens on a Zen 4 EPYC, past 16 on an AMX Xeon); the count checked must not.
    status, body = server.post_json(OPENAI_CHAT, {"messages": [{"role": "user", "content": "Name three colors."}],
                                                  "max_tokens": 16, "temperature": 0, "ignore_eos": True}, key)
    assert status == 200, body
    return body


def test_the_engine_in_a_thread_serves_what_the_engine_process_serves(replica, tmp_path):
    assert len(engine_processes(replica)) == 1
    thread_server, stop = start_live_server(tmp_path, {"t": {"lane": 1, **BIG}}, {"t": "t"},
                                            {"INFERENCE_ENGINE_PROCESS": "false"})
    try:
        assert engine_processes(thread_server) == []
        apart, inside = greedy_chat(replica, replica.keys["t"]), greedy_chat(thread_server, thread_server.keys["t"])
        assert apart["choices"][0]["message"]["content"] == inside["choices"][0]["message"]["content"]
        assert apart["usage"] == inside["usage"]
    finally:
        stop()


def test_an_engine_process_killed_under_a_stream_errs_bills_and_comes_back(replica):
    [engine] = engine_processes(replica)
    restarts = replica.stats()["restarts"]
    stream = SocketStream(replica.url, OPENAI_CHAT, replica.keys["t"], chat_body(400, stream=True), timeout=TIMEOUT_S)
    try:
        events = []
        while not any(e.json()["choices"][0]["delta"].get("content") for e in events):
            event = stream.next_event()
            assert isinstance(event, Event), event
            events.append(event)
        os.kill(engine, signal.SIGKILL)
        while True:
            event = stream.next_event()
            assert isinstance(event, Event) and event.data != "[DONE]", "the stream ended without an error"
            data = event.json()
            if "error" in data:
                break
            events.append(event)
    finally:
        stream.close()
    assert data["error"]["type"] == "server_error" and "engine process exited" in data["error"]["message"]
    streamed = sum(1 for e in events if e.json()["choices"][0]["delta"].get("content"))

    status, body = readyz(replica)  # the next engine process starts a second later, then loads
    assert status == 503 and body["checks"]["engine"] == "failed", body

    deadline = time.monotonic() + TIMEOUT_S
    while readyz(replica)[0] != 200:
        assert time.monotonic() < deadline, "no engine process served again"
        time.sleep(0.2)
    [again] = engine_processes(replica)
    assert again != engine
    assert greedy_chat(replica, replica.keys["t"])["usage"]["completion_tokens"] == 16
    assert replica.stats()["restarts"] == restarts + 1
    assert "the engine process exited (code -9)" in replica.log()

    # Billed for what it generated before the engine died: at least what the client saw.
    request_id = events[0].json()["id"]
    deadline = time.monotonic() + TIMEOUT_S
    while not (row := replica.django(
            "from tenants.models import UsageRecord\n"
            f"result = list(UsageRecord.objects.filter(request_id={request_id!r}, closed=True)"
            ".values_list('finish_reason', 'completion_tokens'))")):
        assert time.monotonic() < deadline, "the killed stream's usage row was never completed"
        time.sleep(0.2)
    [(finish, completion)] = row
    assert finish == "error" and completion >= streamed > 0


def test_the_web_process_beside_an_engine_process_holds_no_torch(replica):
    # It tokenizes, checks grammars and streams; the engine process runs the model. torch in the
    # web process cost every replica ~270 MB of RSS and ~5 s of its start (2-core Zen 4). Last in
    # this module: its request warms the prefix cache that the thread test above counts on cold.
    status, body = replica.post_json(OPENAI_CHAT, {"messages": [{"role": "user", "content": "Say yes in JSON."}],
                                                   "max_tokens": 8, "response_format": {"type": "json_object"}},
                                     replica.keys["t"])
    assert status == 200, body
    [engine] = engine_processes(replica)
    web = Path(f"/proc/{engine}/stat").read_text().rsplit(")", 1)[1].split()[1]
    web_maps, engine_maps = Path(f"/proc/{web}/maps").read_text(), Path(f"/proc/{engine}/maps").read_text()
    assert "libtorch" in engine_maps
    assert "libtorch" not in web_maps
