"""Settings: engine settings are validated at start, and no model is loaded at import time."""
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    prelude = "import os, sys, django; os.environ['DJANGO_SETTINGS_MODULE'] = 'config.settings'; django.setup();"
    result = subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_url_map_and_the_celery_app_load_neither_the_engine_nor_torch():
    # What `manage.py migrate`, `check` and the Celery worker import: no model, no torch.
    loaded = _run(
        "import config.urls, config.celery;"
        "print([m for m in ('torch', 'inference.engine') if m in sys.modules])"
    )
    assert loaded == "[]"


def test_importing_the_asgi_application_builds_no_engine():
    # daphne imports it, then the first connection starts the engine (inference.host).
    assert _run("import config.asgi; from inference.host import host; print(host.state)") == "not started"


@pytest.mark.parametrize("key, value", [("POLICY", "random"), ("DTYPE", "int4"), ("MAX_NUM_SEQS", 0)])
def test_a_bad_engine_setting_fails_the_system_checks(settings, key, value):
    settings.INFERENCE = {**settings.INFERENCE, key: value}
    with pytest.raises(SystemCheckError, match=f"INFERENCE_{key}"):
        call_command("check")
