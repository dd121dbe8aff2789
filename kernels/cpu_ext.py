"""The CPU extension: C++ kernels compiled once per machine at first use.

Decode attention in plain PyTorch must gather every sequence's blocks into a
padded copy before attending, which on a CPU cost more than all the matmuls of a
step; and at batch 1 the dozens of tiny ops of norms and rotary cost more than
their arithmetic. The C++ kernels read blocks in place and fuse those ops. If the
build fails (no compiler), `load()` returns None and the dispatcher keeps the
PyTorch references.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# How the extension is compiled (bench/kernels_ab.py builds other revisions the same way).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
_module = None
_failed = False


def _build_name() -> str:
    # -march=native code only runs where it was built: key the build by the CPU too.
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            cpu += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    # And by the source's path: torch rebuilds a module whose build file names another source,
    # so two checkouts on one machine would otherwise rebuild it back and forth (~25 s each).
    digest = hashlib.sha256(_SOURCE.read_bytes() + cpu.encode() + str(_SOURCE).encode()).hexdigest()[:12]
    return f"llm_platform_cpu_{digest}"


def load():
    """The compiled module, or None when it cannot be built here."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load as build

                # torch's cpp_extension takes the build's parallelism (MAX_JOBS) and the ninja it
                # runs (from PATH) only from the environment, which its compiler subprocess
                # inherits: these writes steer that build, they configure nothing of the kernels.
                os.environ.setdefault("MAX_JOBS", "2")
                # The `ninja` wheel lives beside this interpreter: take it first whatever PATH says.
                # A process that found the system's ninja 1.11 and one that found the wheel's 1.13
                # hash build commands differently, so each rebuilt the module the other had just
                # built (~50 s each: `make run`'s launcher puts the venv first on PATH, tests do not).
                here = os.path.dirname(sys.executable)
                if os.path.isfile(os.path.join(here, "ninja")) or shutil.which("ninja") is None:
                    os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
                _module = build(
                    name=_build_name(),
                    sources=[str(_SOURCE)],
                    extra_cflags=CFLAGS,
                    extra_ldflags=LDFLAGS,
                    verbose=False,
                )
            except Exception as exc:  # no compiler, no ninja, odd platform: the reference still works
                log.warning("CPU kernels unavailable, using the PyTorch reference: %s", exc)
                _failed = True
    return _module


def op(name: str):
    """A factory for `dispatch.pick`: the compiled op, or None if the module did not build."""

    def factory():
        module = load()
        return None if module is None else getattr(module, name)

    return factory
