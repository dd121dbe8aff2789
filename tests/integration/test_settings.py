"""Settings: engine settings are validated at start, and no model is loaded at import time."""
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

ROOT = Path(__file__).resolve().parents[2]


def test_starting_the_web_app_loads_neither_the_engine_nor_torch():
    code = (
        "import os, sys, django; os.environ['DJANGO_SETTINGS_MODULE'] = 'config.settings'; django.setup();"
        "import config.asgi, config.urls, config.celery;"
        "loaded = [m for m in ('torch', 'inference.engine') if m in sys.modules]; print(loaded)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("key, value", [("POLICY", "random"), ("DTYPE", "int4"), ("MAX_NUM_SEQS", 0)])
def test_a_bad_engine_setting_fails_the_system_checks(settings, key, value):
    settings.INFERENCE = {**settings.INFERENCE, key: value}
    with pytest.raises(SystemCheckError, match=f"INFERENCE_{key}"):
        call_command("check")
