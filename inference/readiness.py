"""The engine's part in /readyz.

Until the engine is wired into the web process there is none to ask, which is fine:
a process that serves no engine is ready as far as the engine goes.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineState:
    state: str  # "not started", "loading", "ready", "failed"
    ready: bool


def engine_state() -> EngineState:
    return EngineState(state="not started", ready=True)
