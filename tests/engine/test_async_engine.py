"""The AsyncEngine on a tiny random-weight Llama: what an asyncio caller sees.

Every test runs a real engine thread; expected tokens come from `LLMEngine.generate`
on an engine of its own (greedy fp32 on the tiny model is batch-invariant). Faults
are injected only at the runner seam.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading

import pytest

from inference.engine.async_engine import AsyncEngine, EngineNotRunningError
from inference.engine.errors import DuplicateRequestError, InvalidRequestError
from inference.engine.api import Lane, LaneStats, SamplingParams
from inference.engine.model_runner import ModelRunner
from tests.engine import tiny
from tests.engine.tiny import GREEDY, VOCAB, make_seq, one_thread

assert one_thread  # an autouse fixture: importing it is what applies it here

# A hang inside a test fails after its asyncio.wait_for (15 s); this outer limit only leaves
# room for the first tiny model to build the CPU kernels when their compile cache is cold.
pytestmark = pytest.mark.timeout(120)


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def run(coro, timeout: float = 15.0):
    """Run `coro` on a fresh loop; a hang fails the test instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def tiny_engine(**kw):
    # A few swap blocks, not the default gigabyte: allocating that costs a test seconds.
    return tiny.tiny_engine(**{"swap_space_bytes": 1 << 16, **kw})


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def random_prompts(n: int, seed: int, max_len: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def baseline(prompts, params) -> list[list[int]]:
    """The tokens `LLMEngine.generate` gives each prompt, on an engine of its own."""
    return [list(c.token_ids) for c in tiny_engine(num_blocks=256).generate(prompts, params)]


async def collect(stream) -> tuple[list[int], list]:
    outputs = [out async for out in stream]
    return [t for out in outputs for t in out.new_token_ids], outputs


async def until(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


def idle(ae: AsyncEngine) -> bool:
    s = ae.stats()
    return s.blocks_free == s.blocks_total and s.running == 0 and s.waiting == 0 and s.in_flight == 0


@pytest.fixture
def serve():
    """Start AsyncEngines for a test; every one is shut down afterwards."""
    started: list[AsyncEngine] = []

    def start(engine=None, **kw) -> AsyncEngine:
        ae = AsyncEngine(engine or tiny_engine(), **kw)
        ae.start()
        started.append(ae)
        return ae

    yield start
    for ae in started:
        ae.shutdown()


class FaultyRunner:
    """Wraps the real runner; raises on the calls numbered in `fail_on` (1-based), after `before_raise`."""

    def __init__(self, inner, fail_on, before_raise=None):
        self.inner = inner
        self.fail_on = fail_on
        self.before_raise = before_raise
        self.calls = 0

    def run(self, schedule):
        self.calls += 1
        if self.fail_on(self.calls):
            if self.before_raise:
                self.before_raise()
            raise RuntimeError("injected fault while running a batch")
        return self.inner.run(schedule)


def faulty(fail_on, before_raise=None):
    """A make_runner: the real ModelRunner the engine sizes, wrapped in a FaultyRunner."""
    return lambda model, **kv_cache: FaultyRunner(ModelRunner(model, **kv_cache), fail_on, before_raise)


# -- streams --------------------------------------------------------------------------------


def test_stream_of_a_greedy_request_equals_generate(serve):
    prompt = [5, 9, 13, 2, 7, 41]
    (expected,) = baseline([prompt], GREEDY)
    ae = serve()

    async def main():
        tokens, outputs = await collect(await ae.submit("r", prompt, GREEDY))
        assert tokens == expected
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 12
        assert all(o.request_id == "r" for o in outputs)

    run(main())


def test_twenty_concurrent_submits_from_one_loop_all_complete(serve):
    prompts = random_prompts(20, seed=3)
    expected = baseline(prompts, GREEDY)
    ae = serve(tiny_engine(num_blocks=128, max_num_batched_tokens=32, max_num_seqs=6))

    async def one(i):
        return await collect(await ae.submit(f"r{i}", prompts[i], GREEDY))

    async def main():
        results = await asyncio.gather(*(one(i) for i in range(20)))
        assert [tokens for tokens, _ in results] == expected
        assert all(outputs[-1].finish_reason == "length" for _, outputs in results)
        await until(lambda: idle(ae), what="an idle engine")

    run(main())


def test_speculating_streams_deliver_every_token_once_in_order(serve):
    prompts = [[5, 9, 11, 5, 9, 11, 5, 9], [3] * 5, [7, 8, 7, 8, 7]]
    expected = baseline(prompts, greedy(40))
    ae = serve(tiny_engine(num_blocks=128, speculative="ngram", ngram_min=1))

    async def one(i):
        return await collect(await ae.submit(f"s{i}", prompts[i], greedy(40)))

    async def main():
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        assert [tokens for tokens, _ in results] == expected
        assert all(outputs[-1].num_output_tokens == 40 for _, outputs in results)
        await until(lambda: idle(ae), what="an idle engine")
        assert ae.stats().spec_accepted_tokens > 0
        assert ae.stats().generated_tokens == 40 * len(prompts)

    run(main())


def test_a_slow_reader_gets_merged_deltas_with_every_token(serve):
    prompt = [1, 2, 3]
    (expected,) = baseline([prompt], greedy(40))
    ae = serve()

    async def main():
        stream = await ae.submit("slow", prompt, greedy(40))
        await until(lambda: ae.stats().in_flight == 0, what="the request to finish unread")
        tokens, outputs = await collect(stream)
        assert tokens == expected
        # Whatever arrived before the first read comes as one delta (the last may follow on its own).
        assert len(outputs) <= 2 and outputs[-1].finished and outputs[-1].num_output_tokens == 40

    run(main())


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, params, kw, param",
    [
        ([], GREEDY, {}, "prompt"),
        ([1, VOCAB], GREEDY, {}, "prompt"),
        ("text without a tokenizer", GREEDY, {}, "prompt"),
        ([1, 2], greedy(600), {}, "max_tokens"),
        ([1, 2], GREEDY, {"lane": 7}, "priority"),
    ],
)
def test_invalid_requests_raise_at_submit_and_the_engine_serves_on(serve, prompt, params, kw, param):
    (expected,) = baseline([[4, 4, 4]], GREEDY)
    ae = serve()

    async def main():
        with pytest.raises(InvalidRequestError) as info:
            await ae.submit("bad", prompt, params, **kw)
        assert info.value.param == param
        tokens, _ = await collect(await ae.submit("good", [4, 4, 4], GREEDY))
        assert tokens == expected

    run(main())
    assert ae.stats().in_flight == 0


def test_duplicate_request_id_is_refused_while_in_flight_and_the_first_is_untouched(serve):
    (expected,) = baseline([[8, 9]], greedy(60))
    ae = serve()

    async def main():
        first = await ae.submit("dup", [8, 9], greedy(60))
        with pytest.raises(DuplicateRequestError):
            await ae.submit("dup", [1, 1], GREEDY)
        tokens, outputs = await collect(first)
        assert tokens == expected and outputs[-1].finish_reason == "length"
        # Finished, the id is free again.
        tokens, _ = await collect(await ae.submit("dup", [8, 9], greedy(60)))
        assert tokens == expected

    run(main())


# -- aborts ---------------------------------------------------------------------------------


def test_abort_from_another_thread_ends_the_stream_and_frees_every_block(serve):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    (expected,) = baseline([prompt], greedy(200))
    ae = serve()

    async def main():
        stream = await ae.submit("a", prompt, greedy(200))
        first = await stream.__anext__()
        aborter = threading.Thread(target=ae.abort, args=("a",))
        aborter.start()
        aborter.join()
        tokens, outputs = await collect(stream)
        tokens = list(first.new_token_ids) + tokens
        assert outputs[-1].finished and outputs[-1].finish_reason == "abort" and outputs[-1].error is None
        assert 0 < len(tokens) < 200 and tokens == expected[: len(tokens)]
        await until(lambda: idle(ae), what="every block free")
        assert ae.engine.stats().aborted_requests == 1

    run(main())


def test_a_paused_stream_generates_nothing_until_resumed_then_finishes_token_identical(serve):
    prompt = [2, 7, 1, 8, 2, 8]
    # Long enough that the pause lands before the end on a loaded box: at 60 tokens the engine
    # thread once finished them while this loop waited for a core, and the pause never showed.
    (expected,) = baseline([prompt], greedy(200))
    ae = serve()

    async def main():
        stream = await ae.submit("p", prompt, greedy(200))
        first = await stream.__anext__()
        stream.pause()
        await until(lambda: ae.stats().paused == 1, what="the request paused")
        generated = ae.engine.stats().generated_tokens
        await asyncio.sleep(0.2)  # dozens of the tiny model's steps
        assert ae.engine.stats().generated_tokens == generated, "a paused request kept decoding"
        assert ae.stats().running == 1  # it keeps its place and its blocks
        stream.pause(False)
        tokens, outputs = await collect(stream)
        assert list(first.new_token_ids) + tokens == expected
        assert outputs[-1].finish_reason == "length" and ae.stats().paused == 0
        await until(lambda: idle(ae), what="every block free")

    run(main())


def test_aborting_a_paused_stream_frees_its_blocks(serve):
    ae = serve()

    async def main():
        stream = await ae.submit("q", [5, 5, 5], greedy(200))
        await stream.__anext__()
        stream.pause()
        await until(lambda: ae.stats().paused == 1, what="the request paused")
        await stream.aclose()
        await until(lambda: idle(ae), what="every block free")
        assert ae.stats().paused == 0 and ae.engine.stats().aborted_requests == 1

    run(main())


def test_abort_of_an_unknown_or_finished_request_is_harmless(serve):
    ae = serve()

    async def main():
        ae.abort("never-submitted")
        tokens, outputs = await collect(await ae.submit("x", [1, 2], GREEDY))
        ae.abort("x")
        assert outputs[-1].finish_reason == "length" and len(tokens) == 12
        await until(lambda: idle(ae))

    run(main())


def test_aclose_aborts_the_request(serve):
    ae = serve()

    async def main():
        stream = await ae.submit("c", [2, 7, 1, 8], greedy(200))
        await stream.__anext__()
        await stream.aclose()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await until(lambda: idle(ae), what="every block free")
        assert ae.engine.stats().aborted_requests == 1

    run(main())


def test_final_after_an_early_close_reports_every_token_the_engine_generated(serve):
    """Billing reads `final()`: after the consumer leaves, it still learns how many tokens
    the engine produced, including ones generated after the last read."""
    ae = serve()

    async def main():
        stream = await ae.submit("f", [2, 7, 1, 8], greedy(200))
        first = await stream.__anext__()
        await until(lambda: ae.engine.requests["f"].num_output_tokens >= len(first.new_token_ids) + 3,
                    what="the engine to run ahead of the reader")
        final = await stream.final()
        assert final is not None and final.finished and final.finish_reason == "abort"
        assert final.num_output_tokens >= len(first.new_token_ids) + 3
        assert final.num_prompt_tokens == 4
        assert await stream.final() is final  # asking again answers at once
        await until(lambda: idle(ae), what="every block free")

    run(main())


def test_final_of_a_finished_stream_is_its_last_output(serve):
    ae = serve()

    async def main():
        stream = await ae.submit("g", [3, 1, 4], greedy(5))
        tokens, outputs = await collect(stream)
        final = await stream.final()
        assert final is outputs[-1] and final.num_output_tokens == len(tokens) == 5
        assert ae.engine.stats().aborted_requests == 0

    run(main())


def test_cancelling_the_reading_task_aborts_the_request(serve):
    ae = serve()

    async def main():
        stream = await ae.submit("t", [2, 7, 1, 8], greedy(200))
        got_one = asyncio.Event()

        async def reader():
            async for _ in stream:
                got_one.set()

        task = asyncio.create_task(reader())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: idle(ae), what="every block free")
        assert ae.engine.stats().aborted_requests == 1

    run(main())


def test_breaking_out_of_async_for_aborts_the_request(serve):
    ae = serve()

    async def main():
        async for _ in await ae.submit("b", [2, 7, 1, 8], greedy(200)):
            break
        await until(lambda: idle(ae), what="every block free")
        assert ae.engine.stats().aborted_requests == 1

    run(main())


def test_a_request_nobody_reads_is_aborted_when_its_lease_expires(serve):
    clock = FakeClock()
    ae = serve(tiny_engine(num_blocks=128), lease_s=5.0, clock=clock)
    (expected,) = baseline([[6, 6, 6]], GREEDY)

    async def main():
        stream = await ae.submit("orphan", [9, 8, 7], greedy(400))
        clock.advance(4.0)
        await asyncio.sleep(0.02)
        assert ae.stats().in_flight == 1  # within the lease
        clock.advance(2.0)
        await until(lambda: ae.stats().in_flight == 0, what="the lease to expire")
        tokens, outputs = await collect(stream)
        assert outputs[-1].finish_reason == "abort" and "lease" in outputs[-1].error
        assert len(tokens) < 400
        await until(lambda: idle(ae), what="every block free")
        # A request that is read is served in full, clock or no clock.
        tokens, outputs = await collect(await ae.submit("read", [6, 6, 6], GREEDY))
        assert tokens == expected and outputs[-1].finish_reason == "length"

    run(main())


# -- failures -------------------------------------------------------------------------------


def test_a_failed_step_fails_the_requests_in_it_and_the_engine_serves_on(serve):
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10]]
    expected = baseline(prompts, GREEDY)
    # One running sequence at a time: "b" waits outside the step that fails.
    engine = tiny_engine(max_num_seqs=1, max_num_batched_tokens=16, make_runner=faulty(fail_on=lambda n: n == 3))
    ae = serve(engine)

    async def main():
        a = await ae.submit("a", prompts[0], GREEDY)
        b = await ae.submit("b", prompts[1], GREEDY)
        _, a_out = await collect(a)
        assert a_out[-1].finish_reason == "error" and a_out[-1].finished
        assert "RuntimeError" in a_out[-1].error and "injected" not in a_out[-1].error
        b_tokens, b_out = await collect(b)
        assert b_tokens == expected[1] and b_out[-1].finish_reason == "length"
        tokens, _ = await collect(await ae.submit("c", prompts[2], GREEDY))
        assert tokens == expected[2]
        await until(lambda: idle(ae), what="every block free")
        assert ae.stats().step_errors == 1 and ae.stats().restarts == 0

    run(main())


def test_an_engine_that_keeps_failing_is_rebuilt(serve):
    engine = tiny_engine(make_runner=faulty(fail_on=lambda n: True))
    ae = serve(engine)
    (expected,) = baseline([[3, 3]], GREEDY)

    async def main():
        for i in range(3):
            _, outputs = await collect(await ae.submit(f"f{i}", [3, 3], GREEDY))
            assert outputs[-1].finish_reason == "error"
        await until(lambda: ae.stats().restarts == 1, what="a restart")
        assert ae.engine is not engine and ae.is_ready()
        tokens, _ = await collect(await ae.submit("ok", [3, 3], GREEDY))
        assert tokens == expected
        await until(lambda: idle(ae))

    run(main())


def test_a_failure_that_leaks_blocks_rebuilds_the_engine(serve):
    phantom = make_seq("phantom", [1, 2, 3, 4])
    # The fault leaves blocks held by no running sequence: the pool can no longer be trusted.
    engine = tiny_engine(make_runner=faulty(fail_on=lambda n: n == 2, before_raise=lambda: engine.block_manager.allocate(phantom, 8)))
    ae = serve(engine)
    (expected,) = baseline([[5, 5, 5]], GREEDY)

    async def main():
        _, outputs = await collect(await ae.submit("x", [5, 5, 5], GREEDY))
        assert outputs[-1].finish_reason == "error"
        await until(lambda: ae.stats().restarts == 1, what="a restart")
        tokens, _ = await collect(await ae.submit("y", [5, 5, 5], GREEDY))
        assert tokens == expected
        await until(lambda: idle(ae), what="every block of the new engine free")

    run(main())


def test_shutdown_fails_requests_in_flight_and_refuses_new_ones(serve):
    ae = serve()

    async def main():
        stream = await ae.submit("s", [1, 2, 3], greedy(200))
        await stream.__anext__()
        ae.shutdown()
        _, outputs = await collect(stream)
        assert outputs[-1].finish_reason == "error" and "shutting down" in outputs[-1].error
        assert not ae.is_ready()
        with pytest.raises(EngineNotRunningError):
            await ae.submit("late", [1], GREEDY)
        assert ae.engine.stats().blocks_free == ae.engine.stats().blocks_total

    run(main())


# -- load -----------------------------------------------------------------------------------


def test_hundred_concurrent_requests_with_every_tenth_aborted(serve):
    n = 100
    prompts = random_prompts(n, seed=11)
    doomed = set(range(0, n, 10))
    params = [greedy(64) if i in doomed else GREEDY for i in range(n)]
    expected = baseline(prompts, params)
    # Load is what this tests, not admission: its 100 requests queue ~330 steps deep, and with
    # P0's 30 s queue timeout a few slow steps of a loaded 2-core box (the wait estimate is an
    # average of recent steps) had a request refused at submit: 33 s estimated, in one CI run.
    ae = serve(tiny_engine(num_blocks=256, max_num_batched_tokens=64, max_num_seqs=8,
                           lane_queue_timeout_s=(3600.0, 3600.0, 3600.0)))
    rng = random.Random(5)
    abort_after = {i: rng.randint(1, 8) for i in doomed}

    async def one(i):
        stream = await ae.submit(f"r{i}", prompts[i], params[i], tenant_id=f"t{i % 3}", lane=i % 3)
        tokens = []
        async for out in stream:
            tokens += out.new_token_ids
            if i in doomed and len(tokens) >= abort_after[i] and not out.finished:
                if i % 20 == 0:
                    ae.abort(f"r{i}")
                else:
                    await stream.aclose()
            last = out
        return tokens, last

    async def main():
        results = await asyncio.gather(*(one(i) for i in range(n)))
        for i, (tokens, last) in enumerate(results):
            if i in doomed:
                assert tokens == expected[i][: len(tokens)] and len(tokens) < 64, i
                if i % 20 == 0:
                    assert last.finish_reason == "abort", i
            else:
                assert tokens == expected[i] and last.finish_reason == "length", i
        await until(lambda: idle(ae), what="every block free")
        assert ae.engine.stats().aborted_requests == len(doomed)

    run(main(), timeout=25)


# -- introspection --------------------------------------------------------------------------


def test_stats_count_sequences_per_lane(serve):
    ae = serve(tiny_engine(num_blocks=128, max_num_seqs=1), clock=FakeClock())

    async def main():
        # Held, not read: a stream that is dropped aborts its request.
        streams = [await ae.submit("p0", [1, 2], greedy(400), lane=0), await ae.submit("p2", [3, 4], greedy(400), lane=2)]
        await until(lambda: ae.stats().in_flight == 2 and ae.stats().lane(0).running == 1, what="P0 running")
        lanes = ae.stats().lanes
        # Lane P0 goes first; P2 waits (or sits swapped out) behind it.
        assert (lanes[Lane.REALTIME].running, lanes[Lane.REALTIME].waiting, lanes[Lane.REALTIME].swapped) == (1, 0, 0)
        assert lanes[Lane.BATCH].running == 0 and lanes[Lane.BATCH].waiting + lanes[Lane.BATCH].swapped == 1
        assert lanes[Lane.NEAR_REALTIME] == LaneStats()
        for stream in streams:
            await stream.aclose()
        await until(lambda: idle(ae))

    run(main())
    assert ae.is_ready() and ae.stats().ready


def test_the_async_engine_imports_nothing_from_django():
    code = "import sys, inference.engine.async_engine, inference.engine.metrics; sys.exit('django' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_a_submit_ends_the_crowds_step_in_flight_and_its_token_comes_from_the_next(serve):
    """Issue 24: another tenant's request waited for the crowd's step in flight before its own.
    The submit notes its arrival as it posts it, so a crowd step held in its first layer is
    abandoned at the next one, and the newcomer's step follows; the crowd's tokens are as if
    nothing happened."""
    model = tiny.tiny_model(seed=11)
    prompts = [[i + 1, 2, 3, 4, 5] for i in range(6)]
    expected = [list(c.token_ids) for c in tiny_engine(model=model, num_blocks=256).generate(prompts, greedy(24))]
    engine = tiny_engine(model=model, num_blocks=256, max_num_seqs=16)
    ae = serve(engine)
    layer, in_layer, release, hold = model.layers[0], threading.Event(), threading.Event(), [False]
    real_o = layer["o"]

    def held_o(x):
        if hold[0]:
            hold[0] = False
            in_layer.set()
            release.wait(10)
        return real_o(x)

    layer["o"] = held_o
    try:
        async def main():
            crowd = [await ae.submit(f"crowd-{i}", p, greedy(24), lane=1, tenant_id="crowd") for i, p in enumerate(prompts)]
            reading = [asyncio.create_task(collect(stream)) for stream in crowd]
            await until(lambda: ae.stats().generated_tokens >= 12, what="the crowd decoding")
            hold[0] = True
            await until(in_layer.is_set, what="a crowd step in its first layer")
            chat = asyncio.create_task(ae.submit("chat", [9, 8, 7, 6], greedy(2), lane=1, tenant_id="bystander"))
            await until(lambda: bool(engine.arrivals), what="the chat's arrival noted")
            release.set()
            chat_tokens, _ = await collect(await chat)
            return [tokens for tokens, _ in await asyncio.gather(*reading)], chat_tokens

        crowd_tokens, chat_tokens = run(main())
    finally:
        layer["o"] = real_o
        release.set()
    assert ae.stats().steps_interrupted == 1
    assert crowd_tokens == expected
    assert len(chat_tokens) == 2
