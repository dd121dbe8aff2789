"""Settings: engine settings are validated at start, and no model is loaded at import time."""
import asyncio
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
    # What `manage.py migrate`, `check` and the Celery worker import: no model, no torch. The
    # engine's torch-free interface (inference.engine.api: limits, SamplingParams; grammar: the
    # response_format check batch lines get) is theirs to use.
    loaded = _run(
        "import config.urls, config.celery;"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('inference.engine.')"
        " and m not in ('inference.engine.api', 'inference.engine.errors', 'inference.engine.grammar')))"
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


def test_a_bad_kernels_setting_fails_the_system_checks(settings):
    settings.INFERENCE = {**settings.INFERENCE, "KERNELS": "cuda-magic"}
    with pytest.raises(SystemCheckError, match="KERNELS must be one of"):
        call_command("check")


def test_a_bad_quantization_fails_the_system_checks_and_the_checks_know_the_engines_choices(settings):
    from inference import checks
    from inference.engine.config import QUANTIZATIONS

    assert checks.QUANTIZATIONS == QUANTIZATIONS  # named twice, so the checks import no torch
    settings.INFERENCE = {**settings.INFERENCE, "QUANTIZATION": "int3"}
    with pytest.raises(SystemCheckError, match="INFERENCE_QUANTIZATION must be one of none, int8, int4"):
        call_command("check")


@pytest.mark.parametrize("key, value, says", [
    ("SPECULATIVE", "eagle", "INFERENCE_SPECULATIVE must be one of off, ngram, draft"),
    ("NUM_SPECULATIVE_TOKENS", 0, "INFERENCE_NUM_SPECULATIVE_TOKENS must be 1-16"),
    ("NUM_SPECULATIVE_TOKENS", 17, "INFERENCE_NUM_SPECULATIVE_TOKENS must be 1-16"),
    ("SPECULATIVE_MAX_BATCH", -1, "INFERENCE_SPECULATIVE_MAX_BATCH must not be negative"),
    ("NGRAM_MIN", 0, "INFERENCE_NGRAM_MIN must be 1-3"),
    ("NGRAM_MIN", 4, "INFERENCE_NGRAM_MIN must be 1-3"),
])
def test_a_bad_speculative_setting_fails_the_system_checks_naming_it(settings, key, value, says):
    from inference import checks
    from inference.engine import config

    assert (checks.SPECULATIVE_MODES, checks.MAX_SPECULATIVE_TOKENS, checks.NGRAM_MAX) == (
        config.SPECULATIVE_MODES, config.MAX_SPECULATIVE_TOKENS, config.NGRAM_MAX)
    settings.INFERENCE = {**settings.INFERENCE, key: value}
    with pytest.raises(SystemCheckError, match=says):
        call_command("check")


@pytest.mark.parametrize("name, value", [("LIMITS_REDIS_TIMEOUT_S", 0), ("LIMITS_FALLBACK_SHARE", 1.5),
                                         ("LIMITS_FALLBACK_SHARE", -0.1), ("LIMITS_REDIS_CONFIRM_S", 0.001)])
def test_a_limits_fallback_setting_out_of_range_fails_the_system_checks(settings, name, value):
    setattr(settings, name, value)
    with pytest.raises(SystemCheckError, match=name):
        call_command("check")


@pytest.mark.parametrize("key, value, says", [("KERNELS", "cuda-magic", "kernels must be one of"),
                                              ("DTYPE", "int8", "dtype must be auto or one of")])
def test_a_config_error_fails_the_engine_start_for_the_operator_and_is_a_503_to_tenants(settings, caplog, key, value,
                                                                                          says):
    # Past the system checks (a setting changed under a running process, or one they do not
    # cover): the engine build raises ConfigError, which leaves the host failed with the
    # message for /readyz and the operator's stats, and a tenant's request sees 503, never 400.
    from inference.streaming import engine_error
    from inference.host import FAILED, EngineHost, EngineUnavailable
    from inference.readiness import engine_state

    settings.INFERENCE = {**settings.INFERENCE, key: value, "DEVICE": "cpu"}
    host = EngineHost()
    with caplog.at_level("ERROR", logger="inference.host"):
        with pytest.raises(EngineUnavailable) as caught:
            asyncio.run(host.wait_engine(timeout=120))
    assert caught.value.state == host.state == FAILED
    assert host.error.startswith("ConfigError: ") and says in host.error
    assert engine_state(host).detail == host.error
    assert any("cannot start with these INFERENCE settings" in r.getMessage() and not r.exc_info for r in caplog.records)
    assert engine_error(caught.value).status == 503
