"""The engine's part in /readyz: ready only once this process's engine serves, and only
while its thread makes progress (a step stuck on a hung device or a deadlock leaves the
thread alive, so "alive" alone would keep a load balancer sending traffic into it)."""
from dataclasses import dataclass

from django.conf import settings

from inference.host import READY, EngineHost, EngineUnavailable, host

STALLED = "stalled"


@dataclass(frozen=True)
class EngineState:
    state: str  # "not started", "loading", "ready", "stalled", "failed"
    ready: bool
    detail: str = ""


def engine_state(engine_host: EngineHost | None = None) -> EngineState:
    engine_host = engine_host or host
    try:
        busy = engine_host.engine().busy_for()
    except EngineUnavailable as unavailable:
        return EngineState(state=unavailable.state, ready=False, detail=engine_host.error)
    if busy > settings.READYZ_ENGINE_STALL_S:
        return EngineState(STALLED, ready=False, detail=f"one engine loop iteration has run for {busy:.0f} s")
    return EngineState(state=READY, ready=True)
