"""No fault loses a bill (issue 24 item 6: "A failed usage write at the end of a request (a
locked database) leaves the tokens unbilled").

A generation's usage entries are journaled by its web process before the database sees them
(tenants.ledger) and written by a writer that retries until the database takes them. Here
the database refuses every write to the usage table (a trigger raises), the requests are
served all the same, and their rows appear with the right tokens once writes work again;
and a process killed with entries the database never took leaves its journal to the next
process, which writes them.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from tests.live import ROOT, LiveServer, migrated_database

pytestmark = pytest.mark.slow

TENANT = "outbox"

SQLITE_BLOCK = [
    "CREATE TRIGGER test_block_insert BEFORE INSERT ON tenants_usagerecord BEGIN SELECT RAISE(ABORT, 'blocked'); END",
    "CREATE TRIGGER test_block_update BEFORE UPDATE ON tenants_usagerecord BEGIN SELECT RAISE(ABORT, 'blocked'); END",
]
SQLITE_UNBLOCK = ["DROP TRIGGER test_block_insert", "DROP TRIGGER test_block_update"]
POSTGRES_BLOCK = [
    "CREATE FUNCTION test_block_usage() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'blocked'; END $$ LANGUAGE plpgsql",
    "CREATE TRIGGER test_block_usage BEFORE INSERT OR UPDATE ON tenants_usagerecord "
    "FOR EACH ROW EXECUTE FUNCTION test_block_usage()",
]
POSTGRES_UNBLOCK = ["DROP TRIGGER test_block_usage ON tenants_usagerecord", "DROP FUNCTION test_block_usage()"]

BLOCKING = """
from django.db import connection
statements = {"sqlite": %(sqlite)r, "postgresql": %(postgres)r}[connection.vendor]
with connection.cursor() as cursor:
    for statement in statements:
        cursor.execute(statement)
result = True
"""


BLOCK = BLOCKING % {"sqlite": SQLITE_BLOCK, "postgres": POSTGRES_BLOCK}
UNBLOCK = BLOCKING % {"sqlite": SQLITE_UNBLOCK, "postgres": POSTGRES_UNBLOCK}


def block_usage_writes(run) -> None:
    run(BLOCK)


def unblock_usage_writes(run) -> None:
    run(UNBLOCK)


def _chat(live: LiveServer, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    request = urllib.request.Request(live.url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {live.keys[TENANT]}",
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _rows(live: LiveServer, request_ids: list[str], wait_s: float) -> dict[str, dict]:
    return live.django(f"""
        import time
        from tenants.models import UsageRecord
        deadline = time.monotonic() + {wait_s}
        while True:
            rows = {{r["request_id"]: r for r in UsageRecord.objects.filter(request_id__in={request_ids!r}, closed=True)
                     .values("request_id", "prompt_tokens", "completion_tokens", "finish_reason")}}
            if len(rows) == {len(request_ids)} or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        result = rows
    """)


def test_usage_the_database_refused_is_written_once_it_accepts_writes(hostile_live: LiveServer):
    block_usage_writes(hostile_live.django)
    try:
        replies = [_chat(hostile_live, n) for n in (3, 7)]  # served while no usage row can be written
        ids = [reply["id"] for reply in replies]
        assert _rows(hostile_live, ids, wait_s=0) == {}
    finally:
        unblock_usage_writes(hostile_live.django)
    rows = _rows(hostile_live, ids, wait_s=60)
    assert rows == {reply["id"]: {"request_id": reply["id"], "prompt_tokens": reply["usage"]["prompt_tokens"],
                                  "completion_tokens": reply["usage"]["completion_tokens"], "finish_reason": "length"}
                    for reply in replies}


# --- a journal outlives its process ----------------------------------------------------------

_JOURNAL = """
import django, json, sys, time
django.setup()
from tenants.ledger import UsageEntry, ledger
tenant_id = int(sys.argv[1])
common = dict(key="gen-1", tenant_id=tenant_id, lane=1, created="2030-01-15T10:00:00+00:00", request_id="gen-1")
ledger().submit(UsageEntry(op="open", prompt_tokens=11, **common))
ledger().submit(UsageEntry(op="close", prompt_tokens=11, completion_tokens=29, finish_reason="stop", **common))
print(ledger().path, flush=True)
time.sleep(600)
"""

_REPLAY = """
import django, json, time
django.setup()
from tenants.ledger import ledger
from tenants.models import UsageRecord
deadline = time.monotonic() + 60
while ledger().unapplied() and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps(list(UsageRecord.objects.values("key", "prompt_tokens", "completion_tokens", "closed"))))
"""


def _python(code: str, env: dict, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _django(code: str, env: dict) -> object:
    done = subprocess.run([sys.executable, "-c", "import django, json\ndjango.setup()\n" + textwrap.dedent(code)
                           + "\nprint(json.dumps(result))"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _blocked_database(tmp_path: Path, tenant: str) -> tuple[dict, Path, int]:
    """A fresh SQLite database with a tenant, refusing usage writes: (environment, outbox, tenant id)."""
    outbox = tmp_path / "outbox"
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_ENV"}
    env.update(DJANGO_SETTINGS_MODULE="config.settings", USAGE_OUTBOX_DIR=str(outbox), REDIS_URL="redis://127.0.0.1:1/0")
    env["DATABASE_URL"], _ = migrated_database(tmp_path, env, sqlite=True)
    tenant_id = _django(BLOCK + f"""
from tenants import actions
from tenants.models import QuotaTier
result = actions.create_tenant({tenant!r}, QuotaTier.objects.get(name="standard")).pk
""", env)  # one Django process for both: each took ~1 s to start
    return env, outbox, tenant_id


def test_a_journal_left_by_a_killed_process_is_written_by_the_next_one(tmp_path: Path):
    env, outbox, tenant_id = _blocked_database(tmp_path, "journal")

    writer = _python(_JOURNAL, env, str(tenant_id))
    try:
        journal = Path(writer.stdout.readline().strip())
        assert journal.parent == outbox
        lines = journal.read_text().splitlines()
        assert [json.loads(line).get("op") for line in lines[1:]] == ["open", "close"]
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)

    unblock_usage_writes(lambda code: _django(code, env))
    replay = _python(_REPLAY, env)
    out, err = replay.communicate(timeout=120)
    assert replay.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == [
        {"key": "gen-1", "prompt_tokens": 11, "completion_tokens": 29, "closed": True}]
    assert not journal.exists(), "a replayed journal is removed"



# --- a batch the database refuses ----------------------------------------------------------

_ONE_REFUSED = """
import django, json, sys, time
django.setup()
from django.db import connection
from tenants.ledger import UsageEntry, ledger
from tenants.models import UsageRecord
tenant_id = int(sys.argv[1])
with connection.cursor() as cursor:
    cursor.execute("CREATE TRIGGER test_block_one BEFORE INSERT ON tenants_usagerecord WHEN NEW.key = 'gen-bad' "
                   "BEGIN SELECT RAISE(ABORT, 'blocked'); END")

def entry(op, key, **fields):
    return UsageEntry(op=op, key=key, tenant_id=tenant_id, lane=1, created="2030-01-15T10:00:00+00:00",
                      request_id=key, **fields)

def settle(left):
    deadline = time.monotonic() + 60
    while ledger().unapplied() > left and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"unapplied": ledger().unapplied(), "rows": list(UsageRecord.objects.order_by("key").values(
        "key", "prompt_tokens", "completion_tokens", "closed"))}

for key in ("gen-1", "gen-bad", "gen-2"):  # one after another: the writer takes them together
    ledger().submit(entry("open", key, prompt_tokens=5))
for key in ("gen-1", "gen-bad", "gen-2"):
    ledger().submit(entry("close", key, prompt_tokens=5, completion_tokens=9, finish_reason="length"))
refused = settle(2)
with connection.cursor() as cursor:
    cursor.execute("DROP TRIGGER test_block_one")
print(json.dumps({"refused": refused, "accepted": settle(0)}))
"""


def test_an_entry_the_database_refuses_holds_back_no_other_entry_written_with_it(tmp_path: Path):
    """Entries that arrive together are written in one transaction; the database refusing one
    of them (here a trigger, for one key) refuses that transaction, and the others are
    written one by one at once while the refused key's entries wait for the database."""
    env, _, tenant_id = _blocked_database(tmp_path, "one-refused")
    unblock_usage_writes(lambda code: _django(code, env))
    writer = _python(_ONE_REFUSED, env, str(tenant_id))
    out, err = writer.communicate(timeout=180)
    assert writer.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    written = {"prompt_tokens": 5, "completion_tokens": 9, "closed": True}
    assert result["refused"] == {"unapplied": 2, "rows": [{"key": "gen-1", **written}, {"key": "gen-2", **written}]}
    assert result["accepted"] == {"unapplied": 0, "rows": [{"key": "gen-1", **written}, {"key": "gen-2", **written},
                                                           {"key": "gen-bad", **written}]}


_DEAD_LETTERING = """
import django, json, sys, time
django.setup()
from tenants import ledger as module
from tenants.ledger import UsageEntry, ledger
module.DEAD_LETTER_AFTER_S = 0  # the first refusal: as if the database had refused it for a day
tenant_id = int(sys.argv[1])
common = dict(key="gen-dead", tenant_id=tenant_id, lane=1, created="2030-01-15T10:00:00+00:00", request_id="gen-dead")
ledger().submit(UsageEntry(op="open", prompt_tokens=7, **common))
ledger().submit(UsageEntry(op="close", prompt_tokens=7, completion_tokens=13, finish_reason="length", **common))
deadline = time.monotonic() + 60
while ledger().unapplied() and time.monotonic() < deadline:
    time.sleep(0.05)
from inference import http_metrics
print(json.dumps([line for line in http_metrics.render().decode().splitlines() if line.startswith("llm_usage_")]))
"""


def test_usage_refused_for_a_day_is_counted_for_the_operator_and_written_by_the_replay_command(tmp_path: Path):
    """An entry the database refuses for DEAD_LETTER_AFTER_S moves to the dead-letter file, where
    it was billed by no one and seen only in a log line: /metrics counts it, and
    `manage.py replay_usage_dead_letters` writes it once the database takes it (while it still
    refuses, the command fails and keeps every entry)."""
    env, outbox, tenant_id = _blocked_database(tmp_path, "dead")
    writer = _python(_DEAD_LETTERING, env, str(tenant_id))
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == ["llm_usage_outbox_pending 0.0", "llm_usage_dead_letters 2.0"]

    def replay() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "manage.py", "replay_usage_dead_letters"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)

    refused = replay()
    assert refused.returncode != 0 and "0 usage entries written, 2 left" in refused.stdout, (refused.stdout, refused.stderr)
    assert len((outbox / "dead-letter.jsonl").read_text().splitlines()) == 2

    unblock_usage_writes(lambda code: _django(code, env))
    done = replay()
    assert done.returncode == 0 and "2 usage entries written, 0 left" in done.stdout, (done.stdout, done.stderr)
    assert (outbox / "dead-letter.jsonl").read_text() == ""
    assert _django("""
        from tenants.models import UsageRecord
        result = list(UsageRecord.objects.values("key", "prompt_tokens", "completion_tokens", "finish_reason", "closed"))
    """, env) == [{"key": "gen-dead", "prompt_tokens": 7, "completion_tokens": 13, "finish_reason": "length", "closed": True}]
    assert "llm_usage_dead_letters 0.0" in _django("""
        from inference import http_metrics
        result = http_metrics.render().decode()
    """, env)


_SLOW_DISK = """
import django, json, sys, threading
django.setup()
from tenants import ledger as module
from tenants.ledger import UsageEntry, ledger
real_fsync, started, release, done = module.os.fsync, threading.Event(), threading.Event(), threading.Event()
def slow_fsync(fd):  # a disk whose flush takes until the test lets it go (10 s at most)
    started.set()
    release.wait(10)
    real_fsync(fd)
    done.set()
module.os.fsync = slow_fsync
common = dict(tenant_id=int(sys.argv[1]), lane=1, created="2030-01-15T10:00:00+00:00", prompt_tokens=3)
ledger().submit(UsageEntry(op="open", key="gen-1", request_id="gen-1", **common))
started.wait(10)  # the ledger's thread is in the journal's fsync
ledger().submit(UsageEntry(op="open", key="gen-2", request_id="gen-2", **common))
print(json.dumps({"flush_still_running": started.is_set() and not done.is_set()}))
release.set()
"""


def test_journaling_an_entry_does_not_wait_for_the_disk_to_flush_the_journal(tmp_path: Path):
    """`submit` runs on the web process's event loop (a generation's usage row opens and closes
    there); it held the journal's lock while the ledger's thread fsync'ed under it, so a slow
    disk stopped every tenant's streams for each flush."""
    env, _, tenant_id = _blocked_database(tmp_path, "slow-disk")
    writer = _python(_SLOW_DISK, env, str(tenant_id))
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"flush_still_running": True}
