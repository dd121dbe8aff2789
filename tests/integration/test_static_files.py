"""Static files with DEBUG off (config.static_files): the pages link what `collectstatic`
gathered, under hashed names, and daphne serves them; the admin and the console kept their
CSS only in DEBUG before. (pytest-django runs every test with DEBUG off.)"""
import re

import pytest
from django.core.management import call_command


@pytest.fixture
def collected(settings, tmp_path):
    settings.STATIC_ROOT = tmp_path / "static"
    settings.STORAGES = {**settings.STORAGES, "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.ManifestStaticFilesStorage"}}
    call_command("collectstatic", interactive=False, verbosity=0)
    return settings.STATIC_ROOT


def test_a_page_links_hashed_static_files_that_are_served_and_cached_for_a_year(client, collected):
    page = client.get("/admin/login/")
    assert page.status_code == 200
    [css] = re.findall(r'href="(/static/admin/css/base\.[0-9a-f]{12}\.css)"', page.content.decode())
    response = client.get(css)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/css")
    assert response.content == (collected / css.removeprefix("/static/")).read_bytes()
    assert response["Cache-Control"] == "public, max-age=31536000, immutable"
    assert int(response["Content-Length"]) == len(response.content)


def test_the_console_script_is_served_and_an_unhashed_name_is_cached_briefly(client, collected):
    response = client.get("/static/console/engine.js")
    assert response.status_code == 200
    assert b"/ws/console/engine" in response.content
    assert response["Cache-Control"] == "public, max-age=60"
    head = client.head("/static/console/engine.js")
    assert head.status_code == 200 and head.content == b""


@pytest.mark.parametrize("path", ["/static/../config/settings.py", "/static/%2e%2e/manage.py", "/static/nothing.css"])
def test_nothing_outside_the_collected_files_is_served(client, collected, path):
    assert client.get(path).status_code == 404


def test_static_files_answer_only_reads(client, collected):
    assert client.post("/static/console/engine.js").status_code == 405


def test_in_debug_the_apps_own_folders_are_served_without_collectstatic(client, settings, tmp_path):
    # The URL map does not depend on DEBUG at import (a suite imports it at any time): the
    # view reads it per request.
    settings.DEBUG = True
    settings.STATIC_ROOT = tmp_path / "nothing-collected"
    response = client.get("/static/console/engine.js")
    assert response.status_code == 200
    assert b"/ws/console/engine" in b"".join(response.streaming_content)
