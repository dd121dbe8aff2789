"""Debian's nginx with deploy/nginx.conf in front of live replicas: tests/cluster and
bench/isolation.py's `--front nginx` start it the same way."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
MISSING = "needs Debian's nginx at /usr/sbin/nginx: apt-get install nginx-light (make test installs it as root)"


def start_nginx(run_dir: Path, port: int, upstreams: list[str]) -> Callable[[], None]:
    """nginx on 127.0.0.1:`port` in front of `upstreams` (host:port), listening when this
    returns; the callable stops it."""
    if not os.path.exists(NGINX):
        raise RuntimeError(MISSING)
    run_dir.mkdir(parents=True, exist_ok=True)
    conf = subprocess.run([sys.executable, str(ROOT / "deploy" / "nginx.py"), "--listen", f"127.0.0.1:{port}",
                           *[arg for u in upstreams for arg in ("--upstream", u)], "--run-dir", str(run_dir)],
                          check=True, capture_output=True, text=True).stdout
    (run_dir / "nginx.conf").write_text(conf)
    # As root (as make test runs): workers of a root master would otherwise run as nobody,
    # which cannot enter pytest's private temporary folders.
    user = ["-g", "daemon off; user root;"] if os.getuid() == 0 else ["-g", "daemon off;"]
    nginx = subprocess.Popen([NGINX, "-c", str(run_dir / "nginx.conf"), "-p", str(run_dir), *user],
                             stdout=subprocess.DEVNULL, stderr=(run_dir / "stderr.log").open("w"))

    def stop() -> None:
        nginx.send_signal(signal.SIGQUIT)  # graceful
        try:
            nginx.wait(timeout=10)
        except subprocess.TimeoutExpired:
            nginx.kill()

    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return stop
        except OSError:
            if nginx.poll() is not None or time.monotonic() > deadline:
                stop()
                logs = [(run_dir / name) for name in ("stderr.log", "error.log")]
                raise RuntimeError("nginx did not listen:\n" + "".join(p.read_text() for p in logs if p.exists()))
            time.sleep(0.1)
