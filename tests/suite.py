"""The whole suite as `make test` runs it: four pytest processes at once.

The live tests (daphne, Celery workers, Redis and nginx over real sockets) spend much of their
time waiting on the engine, a socket or a timer: alone they kept a 2-core machine about half
busy. So they run as two processes, split by module: the modules that wait longest on workers,
replicas, a browser or a launcher (`PATIENT`) beside the rest. On a 2-core Zen 3 EPYC
(PostgreSQL) the live tests took 985 s in one process, 639 and 483 s as two beside each other.
Each live process picks its ports from a range of its own (`TEST_PORT_RANGE`, read by
`tests.conftest.free_port`), below the kernel's ephemeral range, so one process's server never
takes a port the other just found free, and names its test database apart (`TEST_DB_SUFFIX`).

The in-process engine and kernel tests have no wall-clock bound that load could break, and take
~40% of the suite's CPU. They run as two more processes under SCHED_IDLE: the kernel gives them
a core only when no other thread wants one, so the live tests, some of which bound waits in
seconds, run as if they were not there, and the in-process tests fill what they leave idle, one
thread each (two OpenMP threads sharing the one idle core would spin at every barrier).

The first live process streams to the terminal; the others' output follows when all are done.
Exit status: the first process's that is not 0 (5, no tests collected, counts as a failure).
Arguments are passed to all. `python -m pytest` alone still runs everything in one process.
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
# ... except these, whose engine threads are awaited under deadlines of seconds, and the
# launcher's supervisor, which counts a start that fails within 2 s (whole seconds) as quick:
# under SCHED_IDLE on a saturated box one of its quick starts took over a second and the count
# began again (9 starts, not 6, in a clean-clone run on a 2-core AMX Xeon).
STAY = ("engine/test_async_engine.py", "engine/test_metrics.py", "install/test_supervise.py")
# The second in-process process: the real model's modules (~320 s of the ~690 on a Zen 3 EPYC).
BACKGROUND_HEAVY = ("engine/test_real_model.py", "engine/test_speculative_real.py",
                    "engine/test_engine_process.py")
# The second live process: modules whose time is mostly waiting on a Celery worker, a replica
# behind nginx, a browser or `make run`, with bounds of a minute or more.
PATIENT = ("batches", "cluster", "console/test_browser.py", "integration/test_run.py",
           "reliability/test_usage_outbox.py", "serving/test_schema.py")
# Each live process's ports: disjoint, and below Linux's ephemeral range (32768 up), from which
# outgoing connections and bind(("", 0)) take theirs.
PORT_RANGES = ("10000-20999", "21000-31999")


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


def _commands() -> list[tuple[str, list[str], bool, str]]:
    """(name, pytest arguments, idle, port range) for each process; the first streams."""
    live, background = _paths()
    patient = [f"tests/{path}" for path in PATIENT]
    heavy = [f"tests/{path}" for path in BACKGROUND_HEAVY]

    def ignore(paths) -> list[str]:  # for what pytest finds in a folder it was given, not for a path given
        return [f"--ignore={path}" for path in paths]

    return [
        ("live", [*(path for path in live if path not in patient), *ignore(patient)], False, PORT_RANGES[0]),
        ("live, patient", patient, False, PORT_RANGES[1]),
        ("in-process", [*background, *ignore(f"tests/{path}" for path in STAY), *ignore(heavy)], True, ""),
        ("in-process, real model", heavy, True, ""),
    ]


def _env(index: int, idle: bool, ports: str) -> dict[str, str]:
    env = {**os.environ, "TEST_DB_SUFFIX": str(index)}
    env.update({"OMP_NUM_THREADS": "1"} if idle else {"TEST_PORT_RANGE": ports})
    return env


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    (_, first, _, first_ports), *others = _commands()
    with tempfile.TemporaryDirectory(prefix="suite-") as tmp:
        sides = []
        for index, (name, paths, idle, ports) in enumerate(others, start=1):
            log_path = Path(tmp) / f"{index}.log"
            with log_path.open("w") as log:
                side = subprocess.Popen(
                    [*pytest, *paths, "-p", "no:cacheprovider", f"--basetemp={tmp}/basetemp-{index}", *args],
                    cwd=ROOT, env=_env(index, idle, ports), stdout=log, stderr=subprocess.STDOUT,
                    preexec_fn=_idle if idle else None,
                )
            sides.append((name, side, log_path))
        try:
            statuses = [subprocess.call([*pytest, *first, *args], cwd=ROOT, env=_env(0, False, first_ports))]
        finally:
            statuses += [side.wait() for _, side, _ in sides]
        for name, _, log_path in sides:
            print(f"\n{'=' * 30} {name} tests, run beside the above {'=' * 30}")
            sys.stdout.write(log_path.read_text(errors="replace"))
    for status in statuses:
        if status != 0:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
