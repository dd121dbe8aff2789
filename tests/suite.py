"""The whole suite as `make test` runs it: two pytest processes at once.

The live tests (daphne, Celery workers, Redis and nginx over real sockets) spend much of their
time waiting on the engine, a socket or a timer: alone they kept a 2-core machine about half
busy (user time ~ wall time over a 20-minute run). The in-process engine and kernel tests have no
wall-clock bound that load could break, and take ~40% of the suite's CPU. So they run beside
the live tests in a process of their own under SCHED_IDLE: the kernel gives it a core only when
no other thread wants one, so the live tests, some of which bound waits in seconds, run as if
alone, and the in-process tests fill what they leave idle, one thread each (two OpenMP threads
sharing the one idle core would spin at every barrier).

The live tests stream to the terminal; the in-process tests' output follows when both are done.
Exit status: the first process's that is not 0 (5, no tests collected, counts as a failure).
Arguments are passed to both. `python -m pytest` alone still runs everything in one process.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# In-process, and nothing in them waits on a clock another process's load could stretch.
BACKGROUND = ("engine", "kernels", "install")
# ... except these, whose engine threads are awaited under deadlines of seconds.
STAY = ("engine/test_async_engine.py", "engine/test_metrics.py")


def _paths() -> tuple[list[str], list[str]]:
    """(the live group's paths, the background group's), relative to the checkout."""
    live, background = [], []
    for child in sorted(TESTS.iterdir()):
        if (child.is_dir() and (child / "__init__.py").exists()) or (child.name.startswith("test_") and child.suffix == ".py"):
            rel = str(child.relative_to(ROOT))
            (background if child.name in BACKGROUND else live).append(rel)
    live += [f"tests/{path}" for path in STAY]
    return live, background


def _idle() -> None:
    """In the child before exec: the lowest CPU class (inherited by its threads and children)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: the lowest nice level instead
        os.nice(19)


def main(args: list[str]) -> int:
    live, background = _paths()
    pytest = [sys.executable, "-m", "pytest"]
    with tempfile.TemporaryDirectory(prefix="suite-") as tmp:
        log_path = Path(tmp) / "in-process.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with log_path.open("w") as log:
            side = subprocess.Popen(
                [*pytest, *background, *[f"--ignore=tests/{path}" for path in STAY],
                 "-p", "no:cacheprovider", f"--basetemp={tmp}/basetemp", *args],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_idle,
            )
            try:
                live_status = subprocess.call([*pytest, *live, *args], cwd=ROOT)
            finally:
                side_status = side.wait()
        print(f"\n{'=' * 30} in-process tests ({', '.join(background)}), run beside the above {'=' * 30}")
        sys.stdout.write(log_path.read_text(errors="replace"))
    for status in (live_status, side_status):
        if status != 0:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
