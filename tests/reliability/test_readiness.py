"""/readyz while the engine thread is stuck (issue 24, suspected: "green while the engine loop
is stuck"). Confirmed: readiness only asked whether the engine thread was alive, and a thread
blocked inside a step is alive. It now also asks whether the thread's current loop iteration
has run past READYZ_ENGINE_STALL_S.

A real engine thread on the tiny model; the step is held at the runner seam (the one place
the engine tests inject faults) and the engine's clock is moved by hand, so nothing sleeps.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from inference import readiness
from inference.engine.async_engine import AsyncEngine
from inference.engine.api import SamplingParams
from inference.engine.model_runner import ModelRunner
from inference.host import EngineHost
from tests.engine import tiny
from tests.engine.tiny import one_thread

assert one_thread  # an autouse fixture: importing it is what applies it here

pytestmark = pytest.mark.timeout(120)
HANG_GUARD_S = 30  # never a timing assertion: how long a wait may take before the test fails


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class HeldRunner:
    """The real runner, except that its calls wait while `held` is clear."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.released = threading.Event()

    def run(self, schedule):
        self.entered.set()
        assert self.released.wait(HANG_GUARD_S), "the test never released the step"
        return self.inner.run(schedule)


@pytest.fixture
def stuck_engine():
    engine = tiny.tiny_engine(swap_space_bytes=1 << 16, make_runner=lambda model, **kv_cache: HeldRunner(ModelRunner(model, **kv_cache)))
    runner = engine.runner
    clock = FakeClock()
    async_engine = AsyncEngine(engine, clock=clock, lease_s=10**9)
    async_engine.start()
    host = EngineHost()
    host.serve(async_engine)
    yield host, runner, clock
    runner.released.set()
    async_engine.shutdown()


def test_readyz_turns_503_while_an_engine_step_is_stuck_and_green_again_after(stuck_engine, settings, client, redis,
                                                                               monkeypatch, db):
    host, runner, clock = stuck_engine
    monkeypatch.setattr(readiness, "host", host)
    assert client.get("/readyz").status_code == 200  # idle: nothing to make progress on

    async def generate() -> int:
        stream = await host.engine().submit("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2,
                                                                             ignore_eos=True))
        return sum([len(out.new_token_ids) async for out in stream])

    done: list[int] = []
    worker = threading.Thread(target=lambda: done.append(asyncio.run(generate())))
    worker.start()
    assert runner.entered.wait(HANG_GUARD_S)
    assert client.get("/readyz").status_code == 200  # a step in progress is not a stuck one

    clock.now += settings.READYZ_ENGINE_STALL_S + 1
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["engine"] == "stalled"
    assert not readiness.engine_state(host).ready

    runner.released.set()
    worker.join(HANG_GUARD_S)
    assert done == [2]
    assert client.get("/readyz").status_code == 200
