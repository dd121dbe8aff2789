"""The engine in a process of its own (inference.engine.process): what the web tier gets from
`EngineProcess` is what it got from an `AsyncEngine` in its own process, and the process
boundary adds its own failures, each handled: the engine process killed under a request, the
web process killed under the engine, a reader gone silent.

The engine process loads the real packaged model (as `make run` serves it); greedy outputs are
compared with an engine of the same settings in this process.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from inference.engine.api import Grammar, SamplingParams
from inference.engine.async_engine import EngineNotRunningError
from inference.engine.config import EngineConfig
from inference.engine.errors import DuplicateRequestError, InvalidRequestError
from inference.engine.process import EngineProcess

pytestmark = pytest.mark.slow  # each test starts an engine process on the real weights

ROOT = Path(__file__).resolve().parents[2]
CONFIG = EngineConfig(dtype="float32", kv_cache_bytes=64 * 1024**2, swap_space_bytes=1 << 20, max_num_seqs=8)
TIMEOUT_S = 120


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_process():
    engine = EngineProcess(CONFIG, lease_s=2.0)
    engine.start()
    yield engine
    engine.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def read_all(stream):
    outs = [out async for out in stream]
    return [t for out in outs for t in out.new_token_ids], outs[-1]


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_greedy_outputs_match_an_engine_in_this_process(engine_process, make_engine, chat_prompt_ids):
    prompts = chat_prompt_ids[:3]
    local = make_engine(kv_cache_bytes=CONFIG.kv_cache_bytes, max_num_seqs=CONFIG.max_num_seqs)
    expected = [list(r.token_ids) for r in local.generate(prompts, greedy(24))]

    async def one(i: int, ids: list[int]):
        # Read from its submission on, as the web tier does: submitted first and read after the
        # others' submissions, a stream sat unread past the module's 2 s lease on a loaded box
        # ("no read for 2 s, aborting it") and came back with 2 of its 24 tokens.
        return await read_all(await engine_process.submit(f"parity-{i}", ids, greedy(24)))

    async def main():
        return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))

    results = run(main())
    assert [tokens for tokens, _ in results] == expected
    for (tokens, final), ids in zip(results, prompts):
        assert final.finish_reason == "length" and final.num_output_tokens == 24
        assert final.num_prompt_tokens == len(ids)
    stats = engine_process.stats()
    assert stats.ready and stats.in_flight == 0 and stats.generated_tokens >= 72
    assert b"llm_engine_requests_running" in engine_process.metrics.render()
    text = engine_process.engine.tokenizer.decode(results[0][0])
    assert text and engine_process.engine.max_model_len > 0


def test_refusals_arrive_as_the_engines_own_errors(engine_process):
    async def main():
        with pytest.raises(InvalidRequestError) as bad:
            await engine_process.submit("bad-token", [engine_process.engine.vocab_size], greedy(4))
        assert (bad.value.param, bad.value.code) == ("prompt", "invalid_token_id")
        assert "outside the vocabulary" in bad.value.message
        with pytest.raises(InvalidRequestError) as long:
            await engine_process.submit("too-long", [1] * 10, greedy(engine_process.engine.max_model_len))
        assert long.value.code == "context_length_exceeded"
        stream = await engine_process.submit("twice", [1, 2, 3], greedy(64))
        with pytest.raises(DuplicateRequestError):
            await engine_process.submit("twice", [1, 2, 3], greedy(4))
        await stream.aclose()
        final = await stream.final()
        assert final.finish_reason == "abort" and final.num_output_tokens < 64

    run(main())
    wait_until(lambda: engine_process.stats().in_flight == 0, "the aborted request stayed in flight")


@pytest.mark.django_db(databases=[])
def test_the_web_tiers_own_lanes_and_ids_reach_an_engine_without_django(engine_process):
    """The web tier hands the engine its Django lane choices: the engine process, which has no
    Django, could not read them, died, and took every request in flight with it."""
    from tenants.models import Lane as TierLane

    tokens, final = run(_generate(engine_process, "django-lane", 4, lane=TierLane.BATCH))
    assert len(tokens) == 4 and final.finish_reason == "length"
    assert engine_process.stats().restarts == 0


def large_schema(i: int, require_all: bool = False) -> Grammar:
    """A JSON schema of ~60 KiB (the API takes up to 64), its own: none is compiled twice. With
    every field required, a document takes thousands of tokens."""
    fields = {f"f{i}_{j}": {"type": ["string", "integer", "array"], "items": {"type": "string", "pattern": f"[a-z]{{3,{5 + j % 50}}}"}}
              for j in range(520)}
    required = list(fields) if require_all else [f"f{i}_0"]
    return Grammar(kind="json_schema", source=json.dumps({"type": "object", "properties": fields, "required": required}))


def test_grammars_being_compiled_hold_up_no_other_request(engine_process):
    """A large schema takes ~80 ms to compile; compiled on the engine process's command thread,
    eight of them held every later submit, abort and pause of every tenant until all eight were
    done. Here the plain request sent after them is submitted before the last of them."""
    async def main():
        order = []

        async def submit(rid, params):
            stream = await engine_process.submit(rid, [1, 2, 3], params)
            order.append(rid)
            return stream

        schemas = [asyncio.create_task(submit(f"schema-{i}", SamplingParams(max_tokens=1, grammar=large_schema(i))))
                   for i in range(8)]
        await asyncio.sleep(0)  # each has sent its add
        streams = [await submit("plain", greedy(1))]
        streams += await asyncio.gather(*schemas)
        for stream in streams:
            await read_all(stream)
        return order

    order = run(main())
    assert order.index("plain") < order.index("schema-7"), order
    wait_until(lambda: engine_process.stats().in_flight == 0, "a request stayed in flight")


def test_a_request_abandoned_while_its_grammar_compiles_never_runs(engine_process):
    """Its abort reaches the engine process before its add can (the add waits for the compile):
    the abort is held until the add is posted, and the request ends at once."""
    async def main():
        task = asyncio.create_task(engine_process.submit("abandoned", [1, 2, 3],
                                                         SamplingParams(max_tokens=1000, grammar=large_schema(99, True))))
        await asyncio.sleep(0.01)  # the add is sent, the compile under way
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    before = engine_process.stats()
    run(main())
    # Its add waits for the compile (~0.4 s): in flight is 0 before it, and again after its abort.
    wait_until(lambda: engine_process.stats().aborted_requests > before.aborted_requests, "the request was never ended")
    wait_until(lambda: engine_process.stats().in_flight == 0 and engine_process.stats().blocks_used == 0,
               "the abandoned request stayed in flight")
    after = engine_process.stats()
    assert after.aborted_requests - before.aborted_requests == 1
    # At most the step its add and abort straddled; unread, it ran until the 2 s lease (dozens).
    assert after.generated_tokens - before.generated_tokens <= 2


def test_a_reader_silent_past_the_lease_is_aborted_with_the_reason(engine_process):
    async def main():
        stream = await engine_process.submit("silent", [1, 2, 3], greedy(1000))
        await asyncio.sleep(engine_process.lease_s + 2 * 0.5 + 1)  # the lease, two sweeps and margin
        tokens, final = await read_all(stream)
        return tokens, final

    tokens, final = run(main())
    assert final.finished and "stream lease expired" in final.error
    assert len(tokens) < 1000 and final.num_output_tokens == len(tokens)
    wait_until(lambda: engine_process.stats().blocks_used == 0, "the silent request's blocks were not freed")


def assert_cache_reported(engine: EngineProcess) -> None:
    """The operator's engine page and /api/v1/engine/stats read the cache's size once the
    engine serves, not zero blocks until its first request has run."""
    stats = engine.stats()
    assert stats.ready and stats.block_size > 0, stats
    assert stats.blocks_total > 0 and stats.blocks_free == stats.blocks_total and stats.blocks_used == 0, stats
    assert stats.swap_blocks_total > 0, stats


def test_an_engine_process_killed_under_a_request_fails_it_and_comes_back():
    engine = EngineProcess(CONFIG)
    engine.start()
    try:
        assert_cache_reported(engine)

        async def doomed():
            stream = await engine.submit("doomed", [1, 2, 3], greedy(1000))
            first = await stream.__anext__()
            os.kill(engine._child.proc.pid, signal.SIGKILL)
            tokens, final = await read_all(stream)
            return len(first.new_token_ids) + len(tokens), final

        generated, final = run(doomed())
        assert final.finish_reason == "error" and "engine process exited" in final.error
        # Its counters are what reached the web side: what the caller is billed for.
        assert final.num_output_tokens == generated > 0

        async def refused():
            with pytest.raises(EngineNotRunningError):
                await engine.submit("meanwhile", [1, 2, 3], greedy(4))

        if not engine.is_ready():
            run(refused())
        wait_until(engine.is_ready, "the engine process was not started again")
        assert_cache_reported(engine)  # the new process's cache, before any request reached it
        tokens, final = run(_generate(engine, "after", 8))
        assert len(tokens) == 8 and final.finish_reason == "length"
        assert engine.stats().restarts == 1
    finally:
        engine.shutdown()
    assert not engine.is_ready()


async def _generate(engine, request_id: str, n: int, **kw):
    return await read_all(await engine.submit(request_id, [1, 2, 3], greedy(n), **kw))


def test_shutdown_ends_what_runs_and_refuses_more():
    engine = EngineProcess(CONFIG)
    engine.start()
    pid = engine._child.proc.pid

    async def main():
        stream = await engine.submit("running", [1, 2, 3], greedy(1000))
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        _, final = await read_all(stream)
        with pytest.raises(EngineNotRunningError):
            await engine.submit("late", [1, 2, 3], greedy(4))
        return final

    final = run(main())
    assert final.finish_reason == "error" and "shutting down" in final.error
    assert engine._child.proc.poll() == 0, "the engine process did not exit cleanly"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_stopped_engine_process_never_blocks_the_web_process():
    """A stuck engine process stops reading: its socket fills with a few long prompts, and the
    web process's event loop, sending the next one, hung with it (every endpoint, the probes
    too). Now the loop goes on, and what it sent reaches the engine once it runs again."""
    engine = EngineProcess(CONFIG)
    engine.start()
    pid = engine._child.proc.pid
    prompt = "word " * 50_000  # 250 KB pickled: two of them are more than the socket holds

    async def main():
        os.kill(pid, signal.SIGSTOP)
        try:
            submits = [asyncio.ensure_future(engine.submit(f"big-{i}", prompt, greedy(4))) for i in range(6)]
            started = time.monotonic()
            for _ in range(10):
                await asyncio.sleep(0.01)  # the loop turns while the engine process cannot read
            turned = time.monotonic() - started
            assert not any(s.done() for s in submits)
        finally:
            os.kill(pid, signal.SIGCONT)
        results = await asyncio.gather(*submits, return_exceptions=True)
        return turned, results

    try:
        turned, results = run(main())
        assert turned < 5
        # Each one reached the engine and got its answer: too long for this engine's cache.
        assert all(isinstance(r, InvalidRequestError) and r.code == "context_length_exceeded" for r in results)
        tokens, final = run(_generate(engine, "after", 4))
        assert len(tokens) == 4 and engine.stats().restarts == 0
    finally:
        engine.shutdown()


def test_the_engine_process_ends_with_the_web_process_however_it_died():
    """SIGKILL leaves no chance to stop it: the engine process sees its socket close and exits."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from inference.engine.config import EngineConfig
        from inference.engine.process import EngineProcess
        engine = EngineProcess(EngineConfig(kv_cache_bytes=16 * 1024**2, swap_space_bytes=1 << 20, max_num_seqs=4))
        engine.start()
        print(engine._child.proc.pid, flush=True)
        time.sleep(3600)
    """)
    web = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = web.stdout.readline()
        assert line, "the web stand-in exited"
        engine_pid = int(line)
        assert _state(engine_pid) != "Z"
        web.kill()
        web.wait()
        deadline = time.monotonic() + 30
        while _state(engine_pid) != "Z":
            assert time.monotonic() < deadline, "the engine process outlived the web process"
            time.sleep(0.05)
    finally:
        web.kill()
        web.wait()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"
