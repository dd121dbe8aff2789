"""A real Celery worker process, started from config.celery, answers through Redis."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from config.celery import app

ROOT = Path(__file__).resolve().parents[2]


def test_celery_settings_keep_tasks_from_being_lost_or_repeated():
    conf = app.conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] == conf.result_backend_transport_options[
        "visibility_timeout"
    ] >= 3600


@pytest.mark.slow
def test_a_real_worker_answers_ping(redis_server):
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "--pool", "solo", "-l", "warning",
         "--without-mingle", "--without-gossip"],
        cwd=ROOT,
        env={**os.environ, "REDIS_URL": redis_server},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = Celery(broker=redis_server, backend=redis_server)
        assert client.send_task("inference.ping").get(timeout=60) == "pong"
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
