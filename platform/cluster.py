#!/usr/bin/env python
"""`make cluster`: the production shape on one machine. nginx (deploy/nginx.conf) listens on
PORT (8000) in front of REPLICAS (2) daphne+engine replicas on free loopback ports; Redis is
embedded unless REDIS_URL is set; the database is DATABASE_URL's (the SQLite file, in WAL
mode, when unset); one Celery worker sends batch items to nginx. Ctrl-C stops everything.

Each replica grants 1/REPLICAS of every limit alone while Redis does not answer
(LIMITS_FALLBACK_SHARE), reports to the fleet as replica-N, and drains on SIGTERM.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from run import ROOT, begin, free_port, prepare_database, procfile_lines, web_line  # platform/run.py, beside this file

NGINX = "/usr/sbin/nginx"


def ensure_nginx() -> str:
    found = shutil.which("nginx") or (NGINX if os.path.exists(NGINX) else None)
    if found:
        return found
    if os.getuid() != 0:
        sys.exit("make cluster needs Debian's nginx: apt-get install nginx-light (as root, make cluster does it)")
    subprocess.run(["apt-get", "update", "-q"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-q", "nginx-light"], check=True)
    return NGINX


def procfile(run_dir: Path, processes: list[str], ports: list[int], nginx: str) -> Path:
    """platform/Procfile's redis and worker, one web line per replica, and nginx."""
    base = procfile_lines()
    lines = [f"redis: {base['redis']}"] if "redis" in processes else []
    for number, port in enumerate(ports, 1):
        lines.append(web_line(f"web{number}", f"replica-{number}", port, base["web"]))
    user = "user root; " if os.getuid() == 0 else ""  # a root master's workers would run as nobody
    lines.append(f'nginx: {nginx} -c "$RUN_DIR/nginx/nginx.conf" -p "$RUN_DIR/nginx" -g "daemon off; {user}"')
    lines.append(f"worker: {base['worker']}")
    path = run_dir / "Procfile.cluster"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    run_dir, processes = begin()
    env = os.environ
    replicas = int(env.get("REPLICAS", "2"))
    if replicas < 1:
        sys.exit(f"REPLICAS must be at least 1, not {replicas}")
    ports = [free_port() for _ in range(replicas)]
    env["BATCH_ENGINE_URL"] = f"http://127.0.0.1:{env['PORT']}"  # through nginx, like any client
    env.setdefault("LIMITS_FALLBACK_SHARE", str(1 / replicas))
    nginx = ensure_nginx()
    (run_dir / "nginx").mkdir(exist_ok=True)
    conf = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "nginx.py"), "--listen", f"127.0.0.1:{env['PORT']}",
         *[arg for port in ports for arg in ("--upstream", f"127.0.0.1:{port}")], "--run-dir", str(run_dir / "nginx")],
        check=True, capture_output=True, text=True).stdout
    (run_dir / "nginx" / "nginx.conf").write_text(conf)

    login = prepare_database(run_dir)
    base = f"http://127.0.0.1:{env['PORT']}"
    print(f"\n{login}\nnginx on {base}/ in front of {replicas} replicas on ports "
          f"{', '.join(map(str, ports))} (Ctrl-C stops everything). Each loads the model in the background; "
          f"{base}/api/v1/engine/fleet lists them.\n", flush=True)
    honcho = [sys.executable, "-m", "honcho", "-f", str(procfile(run_dir, processes, ports, nginx)), "-d", str(ROOT),
              "start"]
    os.execv(sys.executable, honcho)


if __name__ == "__main__":
    main()
