"""The engine's part in /readyz: ready only once this process's engine serves."""
from dataclasses import dataclass

from inference.host import READY, host


@dataclass(frozen=True)
class EngineState:
    state: str  # "not started", "loading", "ready", "failed"
    ready: bool
    detail: str = ""


def engine_state() -> EngineState:
    state = host.state
    return EngineState(state=state, ready=state == READY, detail=host.error)
