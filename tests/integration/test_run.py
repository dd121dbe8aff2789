"""`make run`'s launcher on a fresh database: it serves /readyz and the admin login, creates
the admin once without asking anything, runs a batch job through its Celery worker, starts
the worker again when it dies, listens with a deep queue, and SIGINT stops every process it
started."""
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.live import http_status

ROOT = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").exists(), reason="walks the process tree through /proc")
def test_launcher_serves_and_stops_everything_on_sigint(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DJANGO_ENV", "DATABASE_URL")}
    env.update(PORT=str(port), RUN_DIR=str(tmp_path), DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}")
    log = (tmp_path / "run.log").open("w")
    launcher = subprocess.Popen(
        [sys.executable, "platform/run.py"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True,
    )
    started: set[int] = set()
    try:
        # Ready means the model is loaded (a first run also builds the C++ kernels).
        deadline = time.monotonic() + 300
        while http_status(f"http://127.0.0.1:{port}/readyz") != 200:
            assert launcher.poll() is None, (tmp_path / "run.log").read_text()
            assert time.monotonic() < deadline, "never ready:\n" + (tmp_path / "run.log").read_text()
            time.sleep(0.5)
        assert http_status(f"http://127.0.0.1:{port}/admin/login/") == 200
        password = (tmp_path / "admin-password").read_text().strip()
        assert len(password) >= 16
        output = (tmp_path / "run.log").read_text()
        assert "as 'admin'" in output and password in output
        started = descendants(launcher.pid)
        names = {Path(f"/proc/{p}/cmdline").read_bytes() for p in started if alive(p)}
        assert any(b"redis-server" in n for n in names) and any(b"daphne" in n for n in names)
        assert any(b"celery" in n for n in names)
        assert listen_backlog(port) >= 2048  # daphne's default (50) dropped SYNs under a burst
        _a_batch_runs_through_the_worker(port, env, "first")

        # Issue 24 item 12: a worker killed for good (a crash, the OOM killer) is started again,
        # and the rest of the platform keeps serving.
        workers = celery_workers(launcher.pid)
        assert len(workers) == 1
        os.kill(workers.pop(), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (replacement := celery_workers(launcher.pid) - started):
            assert launcher.poll() is None, "the launcher stopped:\n" + (tmp_path / "run.log").read_text()
            assert time.monotonic() < deadline, "no new worker:\n" + (tmp_path / "run.log").read_text()
            time.sleep(0.5)
        started |= replacement
        assert http_status(f"http://127.0.0.1:{port}/readyz") == 200
        _a_batch_runs_through_the_worker(port, env, "second")
    finally:
        survivors = stop_launcher(launcher, started)
    assert not survivors, f"still running after SIGINT: {survivors}"


def stop_launcher(launcher: subprocess.Popen, started: set[int], timeout: float = 30) -> list[int]:
    """SIGINT to the launcher; the processes it started that outlived it (killed now)."""
    started = started | descendants(launcher.pid)
    launcher.send_signal(signal.SIGINT)
    try:
        launcher.wait(timeout=timeout)
    finally:
        survivors = [p for p in started if alive(p)]
        for p in survivors:
            os.kill(p, signal.SIGKILL)
    return survivors


def celery_workers(launcher: int) -> set[int]:
    """The worker's main process: a celery process whose parent is not itself celery."""
    found = set()
    for pid in descendants(launcher):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            parent_cmdline = Path(f"/proc/{parent}/cmdline").read_bytes()
        except OSError:
            continue
        if is_celery(cmdline) and not is_celery(parent_cmdline) and alive(pid):
            found.add(pid)
    return found


def is_celery(cmdline: bytes) -> bool:
    """celery itself (its script run by the venv's python, or the program run), not a shell
    that names it among its arguments (platform/supervise.sh ... celery -A config worker)."""
    args = cmdline.split(b"\0")
    return args[0] == b"celery" or args[0].endswith(b"/celery") or (len(args) > 1 and args[1].endswith(b"/celery"))


def listen_backlog(port: int) -> int:
    """The listening socket's queue length: `ss` shows it as Send-Q."""
    listing = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(listing.split()[2])


def _a_batch_runs_through_the_worker(port: int, env: dict[str, str], team: str) -> None:
    """The worker and the web process found each other (broker, internal endpoint, token)."""
    from openai import OpenAI

    created = subprocess.run([sys.executable, "manage.py", "create_tenant", f"batch-{team}", "--tier", "batch"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=120, check=True)
    key = created.stdout.strip().splitlines()[-1].split()[-1]
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
    lines = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": f"{i} + {i} =", "max_tokens": 2}}) + "\n" for i in range(3))
    upload = client.files.create(file=("q.jsonl", io.BytesIO(lines.encode())), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        # `finalizing` is the short step that writes the output file: a poll can land in it.
        assert batch.status in ("in_progress", "finalizing") and time.monotonic() < deadline, batch
        time.sleep(0.5)
    assert batch.request_counts.completed == 3


def test_the_launcher_takes_port_redis_and_token_from_dot_env_and_the_environment_over_it(tmp_path):
    """`.env` is where the README sends an operator's settings; the launcher read only the
    environment, so a `.env`'s REDIS_URL got a private Redis beside it (its batches and limits
    in a Redis nobody else saw), its INTERNAL_API_TOKEN a random one and its PORT ignored.
    The launcher runs from a copy beside a `.env` of the test's (it reads the one at its root)."""
    (tmp_path / "platform").mkdir()
    (tmp_path / "platform" / "run.py").write_bytes((ROOT / "platform" / "run.py").read_bytes())
    (tmp_path / ".env").write_text("PORT=9123\nREDIS_URL=redis://127.0.0.1:6390/3\n"
                                   "INTERNAL_API_TOKEN=the-operators-token\nWEB_BACKLOG=4096\n")
    script = ("import json, os, sys\nsys.path.insert(0, 'platform')\nimport run\n_, processes = run.begin()\n"
              "print(json.dumps({'processes': processes, **{k: os.environ.get(k) for k in "
              "('WEB_PORT', 'REDIS_URL', 'INTERNAL_API_TOKEN', 'WEB_BACKLOG')}}))\n")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PORT", "WEB_PORT", "REDIS_URL", "INTERNAL_API_TOKEN", "WEB_BACKLOG")}

    def launcher_sees(**env: str) -> dict:
        done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              env={**clean, "RUN_DIR": str(tmp_path / "run"), **env})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert launcher_sees() == {"processes": ["web", "worker"], "WEB_PORT": "9123", "REDIS_URL": "redis://127.0.0.1:6390/3",
                               "INTERNAL_API_TOKEN": "the-operators-token", "WEB_BACKLOG": "4096"}
    given = launcher_sees(PORT="9200", INTERNAL_API_TOKEN="from-the-environment")
    assert (given["WEB_PORT"], given["INTERNAL_API_TOKEN"]) == ("9200", "from-the-environment")
