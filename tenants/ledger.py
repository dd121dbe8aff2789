"""The usage ledger: every generation's usage row written once, whatever the database does.

A generation hands the ledger two entries: `open` when it is admitted (its prompt, before
the engine sees it) and `close` when it ends (what it used), or `void` when nothing ran.
Each entry is appended to this process's journal file before anything else happens to
it, then written to the database by one writer thread, what arrived together in one
transaction (up to APPLY_BATCH entries: ~6,000 entries a second on local PostgreSQL, where a
transaction per entry wrote ~600, bench/ledger.py):

    Generation --submit--> journal (append) --queue--> writer --apply_usage_batch--> UsageRecord

So a request never waits on the database to be admitted, a write the database refuses
(locked, restarting, gone) is retried with backoff instead of dropped, and a process that
dies leaves its journal behind for the next process on the same database to replay.
Writes are idempotent (`UsageRecord.key`), so a replayed or retried entry lands once.
Entries of one key are applied in order; a key whose write keeps failing holds back only
its own later entries, never other tenants'. An entry refused for a whole day (its tenant
deleted, say) moves to `dead-letter.jsonl` in the outbox folder, logged as an error and
counted in /metrics (`llm_usage_dead_letters`), until `manage.py replay_usage_dead_letters`
writes it once the cause is fixed.

The journal is emptied whenever every entry in it has been applied, so it holds only what
the database has not taken yet. It is fsync'ed before entries are applied: a power cut
loses at most what arrived since the last write (the SQLite setting `synchronous=NORMAL`
makes the same trade for the database itself).

The writer also records `ApiKey.last_used` (advisory, coalesced, never retried), so that
a locked key row delays no request.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import fcntl
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.db import connection

log = logging.getLogger(__name__)

# Backoff between retries of a failed write: doubling from the first, capped so that a
# database back from an outage is caught up within seconds.
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0
# A key row locked by another transaction gets its last_used write a second later.
TOUCH_RETRY_S = 1.0
# An entry the database has refused for this long (its tenant deleted, a schema it cannot
# take) moves to the outbox's dead-letter file for an operator, so that it stops retrying;
# it is never dropped. A day is far past any outage the retries are for.
DEAD_LETTER_AFTER_S = 24 * 3600
DEAD_LETTER = "dead-letter.jsonl"
# Entries written in one transaction at most (tenants.actions.apply_usage_batch): what arrives
# while the last batch was written, so a backlog after an outage is caught up in batches too.
APPLY_BATCH = 200


@dataclass(frozen=True)
class UsageEntry:
    """One step of a usage row's life, as journaled and applied."""

    op: str  # "open" | "close" | "void"
    key: str  # one per generation; one per batch item, whose attempts replace each other
    tenant_id: int
    lane: int
    created: str  # admission time, ISO 8601
    api_key_id: int | None = None
    request_id: str = ""
    model: str = ""
    attempt: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: int | None = None
    latency_ms: int | None = None
    finish_reason: str = ""
    replica: str = ""  # the serving process (inference.fleet.instance()), "" outside the fleet
    endpoint: str = ""  # the API path, "batch" for batch items
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    batch: str = ""  # a batch item's batch id

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> UsageEntry:
        return cls(**json.loads(line))

    @property
    def created_at(self) -> datetime:
        return datetime.fromisoformat(self.created)


def _database_id() -> str:
    """Which database this process writes to: a journal is replayed only into its own."""
    conf = settings.DATABASES["default"]
    return f"{conf['ENGINE']}|{conf.get('HOST', '')}|{conf.get('PORT', '')}|{conf['NAME']}"


@dataclass
class _Pending:
    entry: UsageEntry
    future: concurrent.futures.Future
    from_journal: Path | None = None  # an orphaned journal this entry was replayed from
    tries: int = 0
    not_before: float = 0.0
    first_failure: float | None = None


class Ledger:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._database = _database_id()
        name = f"usage-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self.path = directory / name
        self._file = self.path.open("a+", encoding="utf-8")
        fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours while this process lives
        self._file.write(json.dumps({"database": self._database}) + "\n")
        self._file.flush()
        self._lock = threading.Lock()  # the journal file and the count of its unapplied entries
        self._unapplied = 0
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._touches: dict[int, datetime] = {}
        self._touch_lock = threading.Lock()
        self._orphans: dict[Path, int] = {}  # replayed journal -> its entries not applied yet
        self._orphan_handles: list = []  # their files, locked until replayed
        self._recover()
        self._thread = threading.Thread(target=self._run, name="usage-ledger", daemon=True)
        self._thread.start()
        # Its own thread: a key row locked elsewhere must not hold back anyone's usage rows.
        self._touch_wake = threading.Event()
        threading.Thread(target=self._run_touches, name="key-touches", daemon=True).start()

    # -- producers (any thread) -----------------------------------------------------------

    def submit(self, entry: UsageEntry) -> concurrent.futures.Future:
        """Journal `entry` and queue it for the database; the future resolves once it is there."""
        line = entry.to_json() + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()  # in the kernel: a crash of this process loses nothing
            self._unapplied += 1
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(_Pending(entry, future))
        return future

    def touch_key(self, api_key_id: int, when: datetime) -> None:
        with self._touch_lock:
            self._touches[api_key_id] = when
        self._touch_wake.set()

    def unapplied(self) -> int:
        with self._lock:
            return self._unapplied + sum(self._orphans.values())

    # -- recovery -------------------------------------------------------------------------

    def _recover(self) -> None:
        """Queue the entries of journals whose process died, if they are for this database."""
        for path in sorted(self.directory.glob("usage-*.jsonl")):
            if path == self.path:
                continue
            try:
                handle = path.open("r+", encoding="utf-8")
            except FileNotFoundError:  # another process took it first
                continue
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its process is alive
                handle.close()
                continue
            lines = handle.read().splitlines()
            header = json.loads(lines[0]) if lines else {}
            if header.get("database") != self._database:
                handle.close()
                continue
            entries = []
            for line in lines[1:]:
                try:
                    entries.append(UsageEntry.from_json(line))
                except (ValueError, TypeError):  # a line cut short by the crash
                    log.warning("usage journal %s: skipping an unreadable line", path.name)
            log.warning("usage journal %s: replaying %d entries of a process that stopped", path.name, len(entries))
            self._orphans[path] = len(entries)
            self._orphan_handles.append(handle)
            for entry in entries:
                self._queue.put(_Pending(entry, concurrent.futures.Future(), from_journal=path))
            if not entries:
                self._forget(path)

    def _forget(self, path: Path) -> None:
        self._orphans.pop(path, None)
        path.unlink(missing_ok=True)

    # -- the writer thread ----------------------------------------------------------------

    def _run(self) -> None:
        from tenants import actions

        waiting: dict[str, deque[_Pending]] = {}  # keys with a failed write, in order
        while True:
            timeout = self._next_retry_in(waiting)
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            batch = [item] if item is not None else []
            while True:  # take what else arrived: one fsync for all of it
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is not None:
                    batch.append(more)
            if batch:
                # Not under the lock: `submit` takes it on the event loop, which waited out every
                # fsync (a disk's flush, 1-10 ms here, far longer on a busy or networked volume)
                # with every tenant's streams. The batch's lines were flushed before they were
                # queued, so an fsync begun now covers them; lines written meanwhile are the next
                # batch's to cover.
                os.fsync(self._file.fileno())
            for start in range(0, len(batch), APPLY_BATCH):
                self._apply_batch(actions, batch[start:start + APPLY_BATCH], waiting)
            self._retry(actions, waiting)

    def _apply_batch(self, actions, batch: list[_Pending], waiting: dict[str, deque[_Pending]]) -> None:
        """Entries that arrived together, in one transaction; where the database refuses it,
        one by one, so that an entry it refuses holds back only its own key's later entries.
        A key with a failed write keeps its order: its new entries wait behind it."""
        ready = []
        for pending in batch:
            if pending.entry.key in waiting:
                waiting[pending.entry.key].append(pending)
            else:
                ready.append(pending)
        if len(ready) > 1:
            try:
                actions.apply_usage_batch([pending.entry for pending in ready])
            except Exception:
                connection.close()  # the entries below start on a fresh connection
            else:
                for pending in ready:
                    pending.future.set_result(None)
                    self._applied(pending)
                return
        for pending in ready:
            if pending.entry.key in waiting:
                waiting[pending.entry.key].append(pending)
            elif not self._apply(actions, pending):
                waiting[pending.entry.key] = deque([pending])

    @staticmethod
    def _next_retry_in(waiting: dict[str, deque[_Pending]]) -> float | None:
        if not waiting:
            return None
        return max(0.0, min(q[0].not_before for q in waiting.values()) - time.monotonic())

    def _retry(self, actions, waiting: dict[str, deque[_Pending]]) -> None:
        now = time.monotonic()
        for key in list(waiting):
            entries = waiting[key]
            while entries and entries[0].not_before <= now and self._apply(actions, entries[0]):
                entries.popleft()
            if not entries:
                del waiting[key]

    def _apply(self, actions, pending: _Pending) -> bool:
        try:
            actions.apply_usage(pending.entry)
        except Exception as exc:
            connection.close()  # the next try starts on a fresh connection (the server may have restarted)
            now = time.monotonic()
            pending.tries += 1
            pending.first_failure = pending.first_failure or now
            pending.not_before = now + min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (pending.tries - 1))
            if now - pending.first_failure >= DEAD_LETTER_AFTER_S:
                self._dead_letter(pending, exc)
                return True
            if pending.tries <= 10 or pending.tries % 100 == 0:  # a long outage logs, but not every 5 s
                log.warning("usage %s (%s): write failed (try %d), retrying: %s: %s", pending.entry.key,
                            pending.entry.op, pending.tries, type(exc).__name__, exc)
            return False
        pending.future.set_result(None)
        self._applied(pending)
        return True

    def _dead_letter(self, pending: _Pending, exc: Exception) -> None:
        log.error("usage %s (%s): refused for %d tries since %.0f s ago, moved to %s: %s: %s", pending.entry.key,
                  pending.entry.op, pending.tries, time.monotonic() - pending.first_failure,
                  self.directory / DEAD_LETTER, type(exc).__name__, exc)
        with (self.directory / DEAD_LETTER).open("a", encoding="utf-8") as dead:
            fcntl.flock(dead, fcntl.LOCK_EX)  # not while replay_dead_letters rewrites it
            dead.write(pending.entry.to_json() + "\n")
            dead.flush()
            os.fsync(dead.fileno())
        pending.future.set_exception(exc)
        self._applied(pending)

    def _applied(self, pending: _Pending) -> None:
        if pending.from_journal is not None:
            left = self._orphans.get(pending.from_journal, 0) - 1
            self._orphans[pending.from_journal] = left
            if left <= 0:
                self._forget(pending.from_journal)
            return
        with self._lock:
            self._unapplied -= 1
            if self._unapplied == 0:  # everything journaled is in the database: start afresh
                self._file.seek(0)
                self._file.truncate()
                self._file.write(json.dumps({"database": self._database}) + "\n")
                self._file.flush()

    def _run_touches(self) -> None:
        from tenants import actions

        later: dict[int, datetime] = {}  # rows that were locked: tried again a second later
        while True:
            self._touch_wake.wait(TOUCH_RETRY_S if later else None)
            self._touch_wake.clear()
            with self._touch_lock:
                touches, self._touches = {**later, **self._touches}, {}
            later = {}
            for api_key_id, when in touches.items():
                try:
                    if not actions.touch_key(api_key_id, when):
                        later[api_key_id] = when
                except Exception as exc:  # advisory: the key's next use writes it again
                    log.warning("api key %s: could not record last_used: %s", api_key_id, exc)
            # At most one write a minute per key: no connection is worth keeping open for that.
            connection.close()


def dead_letters(directory: Path) -> int:
    """Entries waiting in the outbox folder's dead-letter file."""
    try:
        with (directory / DEAD_LETTER).open("rb") as dead:
            return sum(1 for _ in dead)
    except FileNotFoundError:
        return 0


def replay_dead_letters(directory: Path) -> tuple[int, int]:
    """Apply the dead-letter file's entries in order, keeping those the database still refuses,
    the later entries of their keys (a key's entries apply in order) and unreadable lines:
    (applied, left). Writes are idempotent, so an entry that had landed after all changes nothing."""
    from tenants import actions

    try:
        handle = (directory / DEAD_LETTER).open("r+", encoding="utf-8")
    except FileNotFoundError:
        return 0, 0
    with handle:
        # Held to the end: a writer dead-lettering meanwhile appends after the rewrite. The file
        # is emptied, never removed, so no writer waits on a lock of a file that is gone.
        fcntl.flock(handle, fcntl.LOCK_EX)
        applied, left, held = 0, [], set()
        for line in handle.read().splitlines():
            try:
                entry = UsageEntry.from_json(line)
            except (ValueError, TypeError):
                left.append(line)
                continue
            if entry.key not in held:
                try:
                    actions.apply_usage(entry)
                except Exception as exc:
                    connection.close()
                    log.warning("usage %s (%s): still refused: %s: %s", entry.key, entry.op, type(exc).__name__, exc)
                    held.add(entry.key)
                else:
                    applied += 1
                    continue
            left.append(line)
        handle.seek(0)
        handle.truncate()
        handle.write("".join(f"{line}\n" for line in left))
        handle.flush()
        os.fsync(handle.fileno())
    return applied, len(left)


_ledger: Ledger | None = None
_ledger_lock = threading.Lock()


def pending() -> int:
    """Entries this process journaled that the database has not taken yet (0 before its first)."""
    return _ledger.unapplied() if _ledger is not None else 0


def ledger() -> Ledger:
    """This process's ledger, started at first use (so `manage.py` commands never start one)."""
    global _ledger
    with _ledger_lock:
        if _ledger is None:
            _ledger = Ledger(Path(settings.USAGE_OUTBOX_DIR))
        return _ledger
