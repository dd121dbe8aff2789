"""The console in headless Chromium against a live platform (daphne with the real model,
its own Redis and database, and a Celery worker for the batch test).

Needs Debian's `chromium` at /usr/bin/chromium and the `playwright` Python package
(requirements-dev.txt; `make test` installs both where it can). Playwright drives that
browser; its own browser downloads are never used. Screenshots of each page land in
tests/artifacts/console/, and the README's (light and dark) in docs/screenshots/.
Every page of every test is watched for requests to another origin (the `page` fixture).
"""
from __future__ import annotations

import json
import os
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.urls import reverse
from openai import OpenAI
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from console.urls import urlpatterns
from tests.batches.conftest import WORKER_ENV, Worker, chat_lines, wait_for
from tests.live import ROOT, LiveServer, start_live_server

CHROMIUM = "/usr/bin/chromium"
# Without the networking flags Chromium keeps calling home, which a closed network turns into noise and delay.
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / "tests" / "artifacts" / "console"
# The README's pictures are rewritten only when asked (CONSOLE_README_SCREENSHOTS=1): every run
# draws live charts and times, so writing them into docs/ left `make test` with a changed tree.
SCREENSHOTS = (ROOT / "docs" / "screenshots" if os.environ.get("CONSOLE_README_SCREENSHOTS") == "1"
               else ARTIFACTS / "readme")
TIMEOUT_MS = 120_000  # a generous bound on waits for the model: the 2-core machine may be busy with other tests

BIG = {"requests_per_minute": 100_000, "tokens_per_minute": 50_000_000, "concurrent_streams": 1000,
       "max_tokens_per_request": 512, "monthly_token_budget": 10**12}
TIERS = {"console-p1": {"lane": 1, **BIG}, "console-batch": {"lane": 2, **BIG, "allow_batch": True}}
TENANTS = {"load": "console-p1", "batcher": "console-batch"}
STAFF, MEMBER, PASSWORD = "operator", "member", "console-test-password-1"

USERS_SCRIPT = f"""
from django.contrib.auth.models import Permission, User
from django.test import Client
operator = User.objects.create_user({STAFF!r}, password={PASSWORD!r}, is_staff=True)
# What the console's pages and writes need (console.views), as an admin would grant them.
operator.user_permissions.add(*Permission.objects.filter(
    content_type__app_label__in=["tenants", "batches"],
    codename__regex="^((view|add|change)_(tenant|apikey|batch)|view_auditentry)$"))
member = User.objects.create_user({MEMBER!r}, password={PASSWORD!r})
client = Client()
client.force_login(member)  # a session of a signed-in user who is not staff
result = {{"member_session": client.cookies["sessionid"].value}}
"""


def require_browser() -> None:
    """Fail (never skip) with what to install when the browser or its driver is missing."""
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the Python package playwright==1.65.2 (.venv/bin/pip install -r requirements-dev.txt)")
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"Debian's chromium at {CHROMIUM} (apt-get install chromium; `make test` does it as root)")
    if missing:
        pytest.fail("the console's browser tests need " + " and ".join(missing), pytrace=False)


@dataclass
class Platform:
    server: LiveServer
    tmp: Path
    member_session: str
    worker: Worker | None = None


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    require_browser()
    tmp = tmp_path_factory.mktemp("console")
    # DEBUG off, as in production: the pages' CSS and scripts come from collectstatic's output.
    server, stop = start_live_server(tmp, TIERS, TENANTS, {"DEBUG": "0"})
    platform = Platform(server, tmp, server.django(USERS_SCRIPT)["member_session"])
    try:
        yield platform
    finally:
        if platform.worker is not None:
            platform.worker.stop()
        stop()


@pytest.fixture(scope="module")
def browser(platform: Platform):
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=TIMEOUT_MS)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def log_in(page, url: str) -> None:
    page.goto(url + "/admin/login/?next=/console/")
    page.fill("#id_username", STAFF)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(re.compile(r"/console/engine/$"))


def staff_context(browser, platform: Platform, **options):
    """A signed-in staff member's context whose requests are all recorded (`context.requested`)."""
    context = browser.new_context(base_url=platform.server.url, viewport={"width": 1280, "height": 900}, **options)
    context.set_default_timeout(TIMEOUT_MS)
    context.requested = []
    context.on("request", lambda request: context.requested.append(request.url))
    log_in(context.new_page(), platform.server.url)
    return context


def assert_same_origin(context, platform: Platform) -> None:
    elsewhere = [url for url in context.requested
                 if not url.startswith((platform.server.url + "/", platform.server.ws_url + "/", "data:", "blob:"))]
    assert not elsewhere, f"requests to another origin: {elsewhere}"


@pytest.fixture
def page(browser, platform: Platform):
    """A signed-in staff member's page, in a context of its own; no request it makes leaves the origin."""
    context = staff_context(browser, platform)
    page = context.pages[0]
    yield page
    assert_same_origin(context, platform)
    context.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def readme_shot(page, name: str) -> None:
    """The README's picture of a page: the first screen of it, light or dark as the page is."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"console-{name}.png"))


def test_staff_log_in_through_the_admin_login_and_land_on_the_console(browser, platform: Platform):
    from playwright.sync_api import expect

    context = browser.new_context(base_url=platform.server.url)
    page = context.new_page()
    page.goto("/console/tenants/")
    expect(page).to_have_url(re.compile(r"/admin/login/\?next=/console/tenants/$"))
    page.fill("#id_username", STAFF)
    page.fill("#id_password", PASSWORD)
    shot(page, "login")
    page.click("input[type=submit]")
    expect(page).to_have_url(re.compile(r"/console/tenants/$"))
    expect(page.locator("header")).to_contain_text(STAFF)
    context.close()


def key_works(server: LiveServer, secret: str) -> bool:
    request = urllib.request.Request(server.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status == 200
    except urllib.error.HTTPError as err:
        assert err.code == 401, err.code
        return False


def test_a_new_tenant_and_key_the_secret_shown_once_copied_then_revoked_after_confirming(page, platform: Platform):
    from playwright.sync_api import expect

    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=platform.server.url)
    page.goto("/console/tenants/")
    page.fill("#new-tenant input[name=name]", "initech")
    page.select_option("#new-tenant select[name=tier]", label="console-p1 (P1)")
    page.click("#new-tenant button")
    expect(page.locator("h1")).to_contain_text("initech")
    detail_url = page.url
    expect(page.locator("#keys")).to_contain_text("No keys.")

    page.fill("#issue-key input[name=name]", "ci")
    page.click("#issue-key button")
    secret = page.locator("#issued-key").inner_text()
    assert re.fullmatch(r"sk-[A-Za-z0-9]+_[A-Za-z0-9_-]+", secret), secret
    prefix = secret.split("_", 1)[0]
    expect(page.locator("#keys")).to_contain_text(f"{prefix}_…")
    page.click("#copy-key")
    expect(page.locator("#copy-key")).to_have_text("Copied")
    expect(page.locator("#issued-key-status")).to_have_text("Copied to the clipboard.")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    shot(page, "tenant-key-issued")
    assert key_works(platform.server, secret)  # the secret shown is a working key

    page.goto(detail_url)  # coming back: the key is listed by its prefix, its secret is gone
    expect(page.locator("#keys")).to_contain_text(f"{prefix}_…")
    expect(page.locator("#issued-key")).to_have_count(0)
    assert secret not in page.content()

    # Revoking asks first: dismissed, nothing happens; accepted, the key is refused.
    row = page.locator("#keys tr", has_text=f"{prefix}_…")
    questions = []
    page.once("dialog", lambda dialog: (questions.append(dialog.message), dialog.dismiss()))
    row.locator("button", has_text="Revoke").click()
    assert questions and questions[0].startswith(f"Revoke {prefix}_… (ci)?")
    expect(row).to_contain_text("active")
    assert key_works(platform.server, secret)
    page.once("dialog", lambda dialog: dialog.accept())
    row.locator("button", has_text="Revoke").click()
    expect(page.locator(".messages")).to_contain_text(f"Key {prefix}_… revoked.")
    expect(page.locator("#keys tr", has_text=f"{prefix}_…")).to_contain_text("revoked")
    assert not key_works(platform.server, secret)

    # Deactivating asks too, and reactivating undoes it.
    page.once("dialog", lambda dialog: (questions.append(dialog.message), dialog.accept()))
    page.click("#set-active button")
    assert questions[-1] == "Deactivate initech? Its keys are refused at once."
    expect(page.locator("h1")).to_contain_text("inactive")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#set-active button")
    expect(page.locator(".messages")).to_contain_text("initech is active again.")
    shot(page, "tenant")
    readme_shot(page, "tenant")

    page.goto("/console/tenants/")
    page.fill("#tenant-search input[name=q]", "init")
    page.keyboard.press("Enter")  # the search submits from the keyboard
    expect(page.locator("#tenants tbody tr")).to_have_count(1)
    row = page.locator("#tenants tr", has_text="initech")
    expect(row).to_contain_text("console-p1")
    expect(row).to_contain_text("P1")
    expect(row.locator(".usage")).to_contain_text("/ 1T")  # a budget of 10**12 tokens, abbreviated
    assert secret not in page.content()
    shot(page, "tenants")
    readme_shot(page, "tenants")


def test_the_playground_streams_with_its_settings_and_shows_a_refusal_as_an_error(page):
    from playwright.sync_api import expect

    page.goto("/console/playground/")
    page.select_option("#pick-tenant select[name=tenant]", label="load (console-p1, P1)")
    page.click("#pick-tenant button")
    expect(page.locator("#lane option")).to_have_text(["P1 near-realtime", "P2 batch"])  # never better than the tier's
    page.fill("#system-prompt", "You answer in English.")
    page.fill("#temperature", "0.7")
    page.fill("#top-p", "0.9")
    page.fill("#max-tokens", "32")
    page.fill("#prompt", "Write a short story about a lighthouse keeper and a storm.")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    body = sent.value.post_data_json
    assert body["messages"][0] == {"role": "system", "content": "You answer in English."}
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["priority"]) == (0.7, 0.9, 32, 1)
    # Tokens arrive while the request still runs: text on the page before it has finished.
    page.wait_for_function("document.getElementById('reply') && document.getElementById('reply').textContent.length > 0"
                           " && document.getElementById('finish').textContent === '–'")
    partial = page.locator("#reply").inner_text()
    expect(page.locator("#ttft")).to_have_text(re.compile(r"^\d+ ms$"))
    expect(page.locator("#finish")).to_have_text(re.compile("stop|length"))
    final = page.locator("#reply").inner_text()
    assert len(final) > len(partial) and final.startswith(partial.rstrip())
    assert int(page.locator("#token-count").inner_text()) > 1
    assert float(page.locator("#tokens-per-s").inner_text()) > 0
    # Each reply keeps its own TTFT and rate.
    expect(page.locator(".reply-stats")).to_have_text(re.compile(r"^TTFT \d+ ms · \d+ tokens · [\d.]+ tokens/s · (stop|length)$"))
    shot(page, "playground")
    readme_shot(page, "playground")

    # Above the tier's max_tokens (512): the API's refusal is shown as an error, not as a reply.
    page.fill("#max-tokens", "1000")
    page.fill("#prompt", "Hello again.")
    page.click("#send")
    expect(page.locator("#transcript [role=alert]")).to_have_text(
        "Error: 400: max_tokens is 1000, above this tier's limit of 512.")
    expect(page.locator("#finish")).to_have_text("error")
    expect(page.locator(".reply-stats")).to_have_count(1)
    shot(page, "playground-error")

    # The response format goes with the request; a request the network drops is an error too.
    # (Aborted in the browser: running structured output here would add ~20 s on 2 cores.)
    page.select_option("#response-format", "json_schema")
    expect(page.locator("#json-schema")).to_be_visible()
    page.route("**/v1/chat/completions", lambda route: route.abort("connectionreset"))
    page.fill("#max-tokens", "24")
    page.fill("#prompt", "Answer in one word: what colour is the sky?")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    assert sent.value.post_data_json["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "playground", "schema": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}
    expect(page.locator("#transcript [role=alert]").last).to_have_text(re.compile(r"^Error: the request failed \(.+\)$"))
    expect(page.locator("#finish")).to_have_text("error")
    page.unroute("**/v1/chat/completions")


def run_requests(server: LiveServer, n: int, max_tokens: int) -> threading.Thread:
    """`n` chat requests of tenant `load` at once, in the background."""
    client = OpenAI(base_url=server.url + "/v1", api_key=server.keys["load"], max_retries=0, timeout=120)

    def one(i: int) -> None:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=max_tokens,
                                       messages=[{"role": "user", "content": f"List {i + 5} colours, one per line."}])

    workers = [threading.Thread(target=one, args=(i,)) for i in range(n)]

    def run() -> None:
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()

    runner = threading.Thread(target=run)
    runner.start()
    return runner


def test_the_engine_page_shows_the_counters_move_while_requests_run(page, platform: Platform):
    from playwright.sync_api import expect

    page.goto("/console/engine/")
    expect(page.locator("#engine-state")).to_have_text("ready")
    # The console's CSS is loaded (DEBUG is off on this server: config.static_files serves it).
    expect(page.locator("header")).to_have_css("background-color", "rgb(31, 58, 95)")
    # This replica, as it reported itself to the fleet.
    expect(page.locator("#replicas tr[data-replica] td:nth-child(2)")).to_have_text(platform.server.url)
    expect(page.locator("#replicas tr[data-replica] td:nth-child(3)")).to_have_text("ready")
    expect(page.locator("#finished-requests")).not_to_have_text("–")
    finished_before = int(page.locator("#finished-requests").get_attribute("data-value"))
    generated_before = int(page.locator("#generated-tokens").get_attribute("data-value"))

    runner = run_requests(platform.server, n=4, max_tokens=32)
    try:
        # Lane P1 shows requests running, then the counters move past what they were.
        page.wait_for_function("Number(document.querySelector('#lane-1 td[data-field=running]').textContent) > 0")
        page.wait_for_function(f"Number(document.getElementById('generated-tokens').dataset.value) > {generated_before}")
        shot(page, "engine-busy")
    finally:
        runner.join(timeout=TIMEOUT_MS / 1000)
    page.wait_for_function(f"Number(document.getElementById('finished-requests').dataset.value) >= {finished_before + 4}")
    expect(page.locator("#lane-1 td[data-field=running]")).to_have_text("0")
    # The finished requests' latencies appear for their lane.
    expect(page.locator("#lane-1 td[data-field=ttft_p50_ms]")).to_have_text(re.compile(r"^\d+ ms$"))
    expect(page.locator("#lane-1 td[data-field=itl_p99_ms]")).to_have_text(re.compile(r"^\d+ ms$"))
    # The charts (uPlot draws axes on its canvas): a legend per series, and on hover the instant's
    # time and each value with its unit, in the legend and in a tooltip at the cursor.
    lanes_chart = page.locator("#chart-lanes")
    expect(lanes_chart.locator(".u-legend .u-label")).to_contain_text(["time", "P0 running", "P0 waiting", "P1 running"])
    box = page.locator("#chart-throughput .u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.9, box["y"] + box["height"] / 2)
    tooltip = page.locator("#chart-throughput .tooltip")
    expect(tooltip).to_be_visible()
    expect(tooltip).to_have_text(re.compile(r"^\d\d:\d\d:\d\d\nthis replica: [\d.]+[kM]? tokens/s$"))
    expect(page.locator("#chart-throughput .u-legend .u-value").first).to_have_text(re.compile(r"^\d\d:\d\d:\d\d$"))
    # Every replica of the fleet has its series (here the one, by its id).
    replica_id = page.locator("#replicas tr[data-replica]").first.get_attribute("data-replica")
    expect(page.locator("#chart-fleet .u-legend .u-label")).to_have_text(["time", replica_id])
    shot(page, "engine")
    readme_shot(page, "engine")

    # The requests are billed to their tenant: its page charts them in lane P1 today.
    page.goto("/console/tenants/")
    page.click("#tenants a:text-is('load')")
    tenant_url = page.url

    def p1_usage_charted() -> bool:
        page.goto(tenant_url)
        bars = page.locator("svg[aria-label='Tokens by lane'] title").all_text_contents()
        return any(re.fullmatch(r"P1: [1-9]\d* tokens", bar) for bar in bars)

    wait_for(p1_usage_charted, timeout=TIMEOUT_MS / 1000, what="tenant load's usage in lane P1")
    # Today's bar, the last of 30 days, reads its date and tokens on hover.
    box = page.locator("#chart-by-day .u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] - 2, box["y"] + box["height"] / 2)
    expect(page.locator("#chart-by-day .tooltip")).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d\ntokens: [1-9][\d.]*[kM]? tokens$"))
    shot(page, "tenant-usage")


def ensure_worker(platform: Platform) -> Worker:
    if platform.worker is None:
        server = platform.server
        platform.worker = Worker({**server.env, **WORKER_ENV, "BATCH_WORKER_CONCURRENCY": "4",
                                  "BATCH_ENGINE_URL": server.url}, platform.tmp / "worker.log").start()
    return platform.worker


@pytest.fixture
def traffic(platform: Platform) -> None:
    """What the pages across tenants list: a chat of tenant load and a completed batch of tenant
    batcher. The tests above leave both; made here where they have not run (a test run alone,
    or in another order)."""
    done = platform.server.django("from batches.models import Batch\n"
                                  "result = Batch.objects.filter(tenant__name='batcher', status='completed').exists()")
    if not done:
        ensure_worker(platform)
        client = OpenAI(base_url=platform.server.url + "/v1", api_key=platform.server.keys["batcher"], max_retries=0,
                        timeout=60)
        upload = client.files.create(file=("traffic.jsonl", chat_lines(2, max_tokens=4).encode()), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", TIMEOUT_MS / 1000,
                 what="the batch to complete")
    run_requests(platform.server, n=1, max_tokens=4).join(timeout=TIMEOUT_MS / 1000)


def test_a_finished_batchs_output_downloads_with_the_apis_bytes(page, platform: Platform):
    from playwright.sync_api import expect

    ensure_worker(platform)
    client = OpenAI(base_url=platform.server.url + "/v1", api_key=platform.server.keys["batcher"], max_retries=0, timeout=60)
    upload = client.files.create(file=("short.jsonl", chat_lines(3, max_tokens=8).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    page.goto("/console/batches/")
    page.click(f"a:has-text('{batch.id}')")
    expect(page.locator("#batch-status")).to_have_text("completed")  # the page reloads itself while it runs
    expect(page.locator("#request-counts td[data-state=succeeded]")).to_have_text("3")
    expect(page.locator("#batch-progress .progress")).to_have_attribute("aria-label", "3 succeeded of 3")
    with page.expect_download() as download:
        page.click("#download-output")
    output_file_id = client.batches.retrieve(batch.id).output_file_id
    assert Path(download.value.path()).read_bytes() == client.files.content(output_file_id).content
    assert download.value.suggested_filename == f"{batch.id}_output.jsonl"
    expect(page.locator("#failed")).to_contain_text("None.")
    shot(page, "batch-completed")


def test_a_running_batch_shows_its_pace_and_is_cancelled_from_its_page(page, platform: Platform):
    from playwright.sync_api import expect

    ensure_worker(platform)
    client = OpenAI(base_url=platform.server.url + "/v1", api_key=platform.server.keys["batcher"], max_retries=0, timeout=60)
    upload = client.files.create(file=("long.jsonl", chat_lines(24, max_tokens=256).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")

    def items_running() -> bool:
        page.goto(f"/console/batches/{batch.id}/")
        return page.locator("#batch-progress .progress span.running").count() > 0

    wait_for(items_running, timeout=90, interval=0.5, what="the batch's items to run (worker log: worker.log)")
    expect(page.locator("#batch-status")).to_have_text("in_progress")
    expect(page.locator("#pace")).to_contain_text("requests/min")
    expect(page.locator("#download-input")).to_contain_text("input: long.jsonl")
    shot(page, "batch-running")
    readme_shot(page, "batch")

    # The workers panel meanwhile: the worker answers and runs items; no alert.
    page.goto("/console/workers/")
    expect(page.locator("#workers tr[data-worker]")).to_have_count(1)
    expect(page.locator("#queues tr[data-queue=celery]")).to_be_visible()
    expect(page.locator("#running tbody tr").first).to_contain_text(re.compile(r":\d+"))
    expect(page.locator("#alerts .alert")).to_have_count(0)
    readme_shot(page, "workers")

    page.goto(f"/console/batches/{batch.id}/")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#cancel-batch button")
    expect(page.locator(".messages")).to_contain_text(re.compile(f"{batch.id} is cancel(ling|led)"))
    # Queued items stop at once, running ones when their workers see the cancel; then it is final.
    expect(page.locator("#batch-status")).to_have_text("cancelled")
    expect(page.locator("#cancel-batch")).to_have_count(0)
    bar = page.locator("#batch-progress .progress")
    expect(bar.locator("span.cancelled")).to_be_visible()
    expect(bar).to_have_attribute("aria-label", re.compile(r"\d+ cancelled of 24$"))
    assert client.batches.retrieve(batch.id).status == "cancelled"
    page.goto("/console/batches/")
    row = page.locator(f"tr[id='{batch.id}']")
    expect(row.locator(".status")).to_have_text("cancelled")
    expect(row.locator(".states")).to_contain_text("cancelled")
    shot(page, "batches")


def test_the_requests_tail_lists_requests_live_and_filters_them(page, platform: Platform, traffic):
    from playwright.sync_api import expect

    page.goto("/console/requests/")  # chats of tenant load and batch items of tenant batcher (traffic)
    expect(page.locator("#requests tbody tr", has_text="/v1/chat/completions").first).to_contain_text("load")
    expect(page.locator("#requests tbody tr", has_text="batcher").first).to_contain_text("batch")
    page.fill("#tail-filter input[name=tenant]", "batcher")
    page.click("#tail-filter button")
    rows = page.locator("#requests tbody tr")
    expect(rows.first).to_contain_text("batch")
    assert all("batcher" in text for text in rows.all_inner_texts())
    # Live: a new request shows up without a reload.
    page.goto("/console/requests/?tenant=load")
    before = page.locator("#requests tbody tr").count()
    run_requests(platform.server, n=1, max_tokens=4).join(timeout=TIMEOUT_MS / 1000)
    expect(page.locator("#requests tbody tr")).to_have_count(before + 1)
    expect(page.locator("#requests tbody tr").first.locator(".status")).to_have_text(re.compile("stop|length"))
    expect(page.locator("#requests tbody tr").first.locator(".captured")).to_have_text("–")  # off by default
    # A refused request leaves no usage row: it shows all the same, its status the HTTP one.
    status, refusal = platform.server.post_json("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 100_000}, platform.server.keys["load"])
    assert status == 400, refusal
    page.goto("/console/requests/?tenant=load&status=refused")
    refused = page.locator("#requests tbody tr.refused")
    expect(refused.first.locator(".status")).to_have_text(f"400 {refusal['error']['code']}")
    expect(refused.first).to_contain_text("sk-" + platform.server.keys["load"].removeprefix("sk-").split("_")[0])
    expect(page.locator("#requests tbody tr:not(.refused)")).to_have_count(0)

    # Debug capture on for tenant load: its next request's messages show in the tail; off again, they are gone.
    page.goto(f"/console/tenants/{platform.server.tenant_ids['load']}/")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#debug-capture button")
    expect(page.locator("#debug-capture-state")).to_have_text("on")
    page.goto("/console/requests/?tenant=load")
    run_requests(platform.server, n=1, max_tokens=4).join(timeout=TIMEOUT_MS / 1000)
    newest = page.locator("#requests tbody tr").first
    expect(newest.locator(".captured")).to_contain_text("prompt")
    newest.locator(".captured summary").click()
    expect(newest.locator(".captured pre")).to_contain_text('"content": "List 5 colours, one per line."')
    readme_shot(page, "requests")
    page.goto(f"/console/tenants/{platform.server.tenant_ids['load']}/")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#debug-capture button")
    expect(page.locator("#debug-capture-state")).to_have_text("off")
    page.goto("/console/requests/?tenant=load")
    assert "List 5 colours" not in page.content()


UNLABELLED = """() => [...document.querySelectorAll("input:not([type=hidden]), select, textarea, button")]
  .filter((el) => !(el.labels && el.labels.length) && !el.getAttribute("aria-label") && !el.textContent.trim())
  .map((el) => el.outerHTML)"""


def test_every_page_follows_a_dark_os_setting_has_labelled_controls_and_a_skip_link(browser, platform: Platform, traffic):
    from playwright.sync_api import expect

    context = staff_context(browser, platform, color_scheme="dark")
    page = context.pages[0]
    tenant_id = platform.server.tenant_ids["load"]
    batch_id = platform.server.django("from batches.models import Batch\nresult = Batch.objects.first().id")
    pages = {"engine": "/console/engine/", "tenants": "/console/tenants/", "tenant": f"/console/tenants/{tenant_id}/",
             "batches": "/console/batches/", "batch": f"/console/batches/{batch_id}/", "workers": "/console/workers/",
             "requests": "/console/requests/", "audit": "/console/audit/", "playground": "/console/playground/"}
    for name, path in pages.items():
        page.goto(path)
        expect(page.locator("body")).to_have_css("background-color", "rgb(20, 24, 29)")
        assert page.evaluate(UNLABELLED) == [], name
        if name == "engine":
            expect(page.locator("#engine-state")).to_have_text("ready")
            page.wait_for_timeout(1500)  # a few snapshots on the charts before the picture (not an assertion)
        if name in ("engine", "tenants", "tenant", "batch", "workers", "requests"):
            readme_shot(page, f"{name}-dark")
        page.keyboard.press("Tab")  # the first stop is the skip link, which moves focus to the content
        expect(page.locator("a.skip")).to_be_focused()
        page.keyboard.press("Enter")
        expect(page.locator("main")).to_be_focused()
    page.goto("/console/playground/")
    page.click("#pick-tenant button")
    assert page.evaluate(UNLABELLED) == []
    readme_shot(page, "playground-dark")
    assert_same_origin(context, platform)
    context.close()


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def console_urls(server: LiveServer) -> list[str]:
    ids = server.django("""
from tenants.models import ApiKey
key = ApiKey.objects.filter(tenant__name="load").first()
result = {"pk": key.tenant_id, "key_pk": key.pk}
""")
    values = {**ids, "batch_id": "batch_0123456789abcdef01234567", "kind": "output"}
    return [reverse(f"console:{p.name}", kwargs={name: values[name] for name in p.pattern.converters})
            for p in urlpatterns]


def status_of(url: str, method: str, cookie: str | None) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method, data=b"name=x&tier=1" if method == "POST" else None,
                                     headers={"Cookie": cookie} if cookie else {})
    try:
        with urllib.request.build_opener(_NoRedirects).open(request, timeout=10) as response:
            return response.status, ""
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Location", "")


def socket_close_code(server: LiveServer, cookie: str | None, origin: str) -> int:
    headers = {"Origin": origin, **({"Cookie": cookie} if cookie else {})}
    with connect(server.ws_url + "/ws/console/engine", additional_headers=headers, open_timeout=10) as ws:
        try:
            ws.recv(timeout=10)
        except ConnectionClosed as closed:
            return closed.rcvd.code
    raise AssertionError("the socket sent a snapshot")


def test_non_staff_and_anonymous_visitors_get_the_login_or_403_on_every_page_and_socket(browser, platform: Platform):
    server = platform.server
    member_cookie = f"sessionid={platform.member_session}"
    for cookie, who in ((None, "anonymous"), (member_cookie, "non-staff")):
        for path in console_urls(server):
            for method in ("GET", "POST"):
                status, location = status_of(server.url + path, method, cookie)
                if path == "/console/" and method == "GET":
                    assert (status, location) == (302, "/console/engine/")  # then the login, as below
                    continue
                # A POST without a CSRF token is refused (403) before the view's login redirect.
                assert status == 403 or (status == 302 and location.startswith("/admin/login/?next=")), \
                    (who, method, path, status, location)
        assert socket_close_code(server, cookie, origin=server.url) == 4403, who

    # The browser tells the same story: a member's session lands on the login page.
    context = browser.new_context(base_url=server.url)
    context.add_cookies([{"name": "sessionid", "value": platform.member_session, "url": server.url}])
    page = context.new_page()
    page.goto("/console/engine/")
    assert "/admin/login/" in page.url
    context.close()

    # Staff get snapshots; another site's page cannot open the socket with a staff member's cookie.
    staff = browser.new_context(base_url=server.url)
    log_in(staff.new_page(), server.url)
    staff_cookie = "; ".join(f"{c['name']}={c['value']}" for c in staff.cookies())
    staff.close()
    with connect(server.ws_url + "/ws/console/engine", open_timeout=10,
                 additional_headers={"Origin": server.url, "Cookie": staff_cookie}) as ws:
        snapshot = json.loads(ws.recv(timeout=10))
        assert snapshot["ready"] is True and snapshot["kv_blocks_total"] > 0 and set(snapshot["latency"]) == {"0", "1", "2"}
    with pytest.raises(InvalidStatus) as refused:
        connect(server.ws_url + "/ws/console/engine", open_timeout=10,
                additional_headers={"Origin": "http://evil.example", "Cookie": staff_cookie})
    assert refused.value.response.status_code == 403
