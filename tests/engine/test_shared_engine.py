"""One engine for several web processes (inference.engine.process.SharedEngine): each web
process reads its own requests and nobody else's, one that goes away or stops reading costs the
others nothing, one with other settings is refused, and the web processes connect again when
the engine server restarts.

The server is a process of its own on the real packaged model, as `manage.py engine_server`
runs it; web processes are `EngineProcess(shared=...)` in this process, or a raw socket where
a test needs a web process that misbehaves.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from inference.engine.api import Lane, SamplingParams
from inference.engine.config import EngineConfig
from inference.engine.errors import DuplicateRequestError, EngineError
from inference.engine.process import EngineProcess, _Writer
from tests.engine.test_engine_process import (
    CONFIG,
    TIMEOUT_S,
    greedy,
    read_all,
    run,
    wait_until,
)

pytestmark = pytest.mark.slow  # each server loads the real weights

ROOT = Path(__file__).resolve().parents[2]


def start_server(path: Path) -> subprocess.Popen:
    script = textwrap.dedent(f"""
        import os, pickle, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from inference.engine.process import SharedEngine
        server = SharedEngine(pickle.loads({pickle.dumps(CONFIG)!r}), {str(path)!r}, drain_timeout_s=20)
        signal.signal(signal.SIGTERM, lambda *_: server.stop())
        code = server.serve()
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    """)
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.DEVNULL)


def stop_server(server: subprocess.Popen) -> None:
    server.kill()
    server.wait()


@pytest.fixture(scope="module")
def socket_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("shared-engine") / "engine.sock"
    server = start_server(path)
    yield path
    stop_server(server)


def web_process(path: Path, config: EngineConfig = CONFIG, **kw) -> EngineProcess:
    engine = EngineProcess(config, shared=path, start_timeout_s=TIMEOUT_S, **kw)
    engine.start()
    return engine


class RawWebProcess:
    """A web process as the socket sees it, for the ones that misbehave."""

    def __init__(self, path: Path) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(path))
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        for fd in fds:
            os.close(fd)
        self.conn = Connection(sock.detach())
        self.conn.send(("hello", CONFIG, "raw"))
        assert self.conn.poll(TIMEOUT_S)
        assert self.conn.recv()[0] == "ready"

    def add(self, request_id: str, params: SamplingParams) -> None:
        payload = pickle.dumps(([1, 2, 3], params, Lane.NEAR_REALTIME, "raw", None, time.monotonic()))
        self.conn.send(("add", request_id, payload))

    def settled(self, request_id: str):
        """The engine's answer to this process's add: None (added), or the error."""
        deadline = time.monotonic() + TIMEOUT_S
        while self.conn.poll(max(0.0, deadline - time.monotonic())):
            message = self.conn.recv()
            for rid, error in message[1] if message[0] == "iter" else ():
                if rid == request_id:
                    return error
        raise AssertionError(f"no answer to {request_id}")


def engine_in_flight(engine: EngineProcess) -> int:
    """Requests in the engine, every web process's (stats() counts this process's own)."""
    return engine._snapshot.in_flight


def test_two_web_processes_share_one_engine_each_reading_its_own(socket_path, make_engine, chat_prompt_ids):
    prompts = chat_prompt_ids[:4]
    local = make_engine(kv_cache_bytes=CONFIG.kv_cache_bytes, max_num_seqs=CONFIG.max_num_seqs)
    expected = [list(r.token_ids) for r in local.generate(prompts, greedy(16))]
    first, second = web_process(socket_path, name="web-1"), web_process(socket_path, name="web-2")
    try:
        async def one(engine, i: int, ids: list[int]):
            return await read_all(await engine.submit(f"shared-{i}", ids, greedy(16)))

        async def main():
            return await asyncio.gather(*(one(first if i % 2 else second, i, ids) for i, ids in enumerate(prompts)))

        results = run(main())
        assert [tokens for tokens, _ in results] == expected
        assert all(final.finish_reason == "length" and final.num_output_tokens == 16 for _, final in results)
        # One engine: one cache, one count of generated tokens, seen the same from both.
        assert first.engine.block_manager.num_blocks == second.engine.block_manager.num_blocks
        wait_until(lambda: first.stats().generated_tokens == second.stats().generated_tokens >= 64,
                   "the two web processes see different engines")
        assert first.stats().in_flight == second.stats().in_flight == 0
        assert b"llm_engine_requests_running" in second.metrics.render()
    finally:
        first.shutdown()
        second.shutdown()


def test_a_web_process_reaches_only_its_own_requests(socket_path):
    """Another web process's abort of a request id it did not submit is ignored, and its add of
    the same id is refused: an id is one web process's until the request finishes."""
    engine = web_process(socket_path)
    other = RawWebProcess(socket_path)
    try:
        async def main():
            stream = await engine.submit("mine", [1, 2, 3], greedy(48))
            await stream.__anext__()
            other.conn.send(("abort", "mine", "not yours"))
            other.conn.send(("pause", "mine", True))
            other.add("mine", greedy(4))
            error = await asyncio.to_thread(other.settled, "mine")
            _, final = await read_all(stream)
            return error, final

        error, final = run(main())
        assert error is not None and error[0] is DuplicateRequestError
        assert final.finish_reason == "length" and final.num_output_tokens == 48
    finally:
        other.conn.close()
        engine.shutdown()


def test_a_web_process_gone_has_its_requests_aborted(socket_path):
    """A web process killed (its socket's end of file) leaves nobody to read its requests: the
    engine stops them and serves the others on."""
    engine = web_process(socket_path)
    gone = RawWebProcess(socket_path)
    try:
        for i in range(4):
            gone.add(f"orphan-{i}", greedy(1000))
            assert gone.settled(f"orphan-{i}") is None
        wait_until(lambda: engine_in_flight(engine) == 4, "the orphans did not start")
        gone.conn.close()
        wait_until(lambda: engine_in_flight(engine) == 0, "the gone web process's requests ran on")
        assert engine.stats().generated_tokens < 4 * 1000
        tokens, final = run(read_all_of(engine, "after", 8))
        assert len(tokens) == 8 and final.finish_reason == "length"
    finally:
        engine.shutdown()


async def read_all_of(engine, request_id: str, n: int):
    return await read_all(await engine.submit(request_id, [1, 2, 3], greedy(n)))


def test_a_web_process_with_other_settings_is_refused_naming_them(socket_path):
    with pytest.raises(EngineError) as refused:
        web_process(socket_path, dataclasses.replace(CONFIG, max_num_seqs=4))
    assert "max_num_seqs" in str(refused.value)
    # Its own CPU threads are each process's to size.
    web_process(socket_path, dataclasses.replace(CONFIG, cpu_threads=CONFIG.cpu_threads + 1)).shutdown()


def test_a_web_process_that_stops_reading_is_dropped_past_its_bound():
    """The engine thread writes to every web process: one that stops reading (stopped, stuck)
    must neither block it nor grow its buffer without end. Past the bound its socket is shut,
    so the web process sees the end and connects again."""
    engine_end, web_end = socket.socketpair()
    writer = _Writer(engine_end.fileno(), limit=64 * 1024)
    started = time.monotonic()
    with pytest.raises(BrokenPipeError):
        for i in range(10_000):
            writer.send(("iter", [], [], b"x" * 1000))
    assert i > 64 and time.monotonic() - started < 5  # the kernel's buffer and the bound, never blocking
    web_end.settimeout(TIMEOUT_S)
    while web_end.recv(1 << 16):  # what was sent, then the end of file
        pass
    writer.close()
    engine_end.close()
    web_end.close()


def test_web_processes_connect_again_when_the_engine_server_restarts(tmp_path):
    path = tmp_path / "engine.sock"
    server = start_server(path)
    engine = web_process(path)
    try:
        async def doomed():
            stream = await engine.submit("doomed", [1, 2, 3], greedy(1000))
            first = await stream.__anext__()
            server.kill()
            tokens, final = await read_all(stream)
            return len(first.new_token_ids) + len(tokens), final

        generated, final = run(doomed())
        assert final.finish_reason == "error" and "closed the connection" in final.error
        assert final.num_output_tokens == generated > 0  # what reached this process: what is billed
        server.wait()
        wait_until(lambda: not engine.is_ready(), "the web process did not see the engine server go")
        server = start_server(path)
        wait_until(engine.is_ready, "the web process did not connect again")
        tokens, final = run(read_all_of(engine, "after", 8))
        assert len(tokens) == 8 and final.finish_reason == "length"
        assert engine.stats().restarts == 1

        # SIGTERM: no new web process is taken; the server waits for the connected one to leave.
        server.send_signal(signal.SIGTERM)
        wait_until(lambda: not path.exists(), "the stopping server still took web processes")
        assert server.poll() is None, "the server stopped under a connected web process"
        engine.shutdown()
        assert server.wait(TIMEOUT_S) == 0
    finally:
        engine.shutdown()
        stop_server(server)
