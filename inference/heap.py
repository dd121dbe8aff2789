"""The web process's Python heap: frozen once the engine has loaded, its collections timed.

What the process holds by then (Django, Twisted, torch, the tokenizer: ~330,000 objects on
SmolLM2) is never garbage, yet every full collection walked all of it: 190-330 ms with the
GIL held, and a burst of 400 requests set one off every few seconds, so another tenant's
first token waited that long. `gc.freeze` moves it out of the collector's sight; after it a
full collection walks only what requests allocate (45-95 ms under the same burst).
"""
from __future__ import annotations

import gc
import threading
import time

_lock = threading.Lock()
_paused_s = [0.0, 0.0, 0.0]  # per generation, since freeze()
_collections = [0, 0, 0]
_started = [0.0]


def _timed(phase: str, info: dict) -> None:
    # Runs inside the collection, on whichever thread set it off, with the GIL held throughout:
    # two collections never overlap, so no lock.
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        generation = info["generation"]
        _paused_s[generation] += time.perf_counter() - _started[0]
        _collections[generation] += 1


def freeze() -> None:
    """Collect what is garbage now, freeze the rest, and time collections from here on."""
    with _lock:
        if _timed in gc.callbacks:
            return
        gc.collect()
        gc.freeze()
        gc.callbacks.append(_timed)


def render() -> bytes:
    """Prometheus text for /metrics."""
    lines = ["# HELP process_gc_frozen_objects Objects frozen out of the garbage collector's walks",
             "# TYPE process_gc_frozen_objects gauge", f"process_gc_frozen_objects {gc.get_freeze_count()}",
             "# HELP process_gc_pause_seconds_total Time the garbage collector held the GIL, by generation",
             "# TYPE process_gc_pause_seconds_total counter"]
    lines += [f'process_gc_pause_seconds_total{{generation="{g}"}} {_paused_s[g]:.6f}' for g in range(3)]
    lines += ["# HELP process_gc_collections_total Collections by generation",
              "# TYPE process_gc_collections_total counter"]
    lines += [f'process_gc_collections_total{{generation="{g}"}} {_collections[g]}' for g in range(3)]
    return ("\n".join(lines) + "\n").encode()
