"""`manage.py check --deploy` passes with the production settings, and they refuse to run
without their secrets."""
import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "SECRET_KEY", "ALLOWED_HOSTS", "DJANGO_ENV")}
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True,
        timeout=120,
    )


PRODUCTION = {
    "DJANGO_ENV": "production",
    "SECRET_KEY": secrets.token_urlsafe(50),
    "ALLOWED_HOSTS": "api.example.com",
    "INTERNAL_API_TOKEN": secrets.token_urlsafe(48),
}


def test_check_deploy_passes_with_production_settings():
    result = manage("check", "--deploy", "--fail-level", "WARNING", **PRODUCTION)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_check_deploy_flags_a_short_internal_token():
    result = manage("check", "--deploy", "--fail-level", "WARNING", **{**PRODUCTION, "INTERNAL_API_TOKEN": "short"})
    assert result.returncode != 0
    assert "inference.W001" in result.stderr + result.stdout


def test_production_refuses_to_start_without_its_secret_key():
    env = {k: v for k, v in PRODUCTION.items() if k != "SECRET_KEY"}
    result = manage("check", **env)
    assert result.returncode != 0
    assert "SECRET_KEY" in result.stderr
