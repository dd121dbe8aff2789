"""The engine in a process of its own: `EngineProcess` serves the web tier as `AsyncEngine` does,
while the model steps in a child process (`python -m inference.engine.process`).

    web process (daphne)                              engine process
    submit() ---- ("add", id, prompt, params...) ---> command thread: compile the grammar, _Add
    RequestStream <- ("iter", settled, outputs, stats) engine thread: one message per iteration
    abort/pause, the lease ------- ("abort"/"pause") > command thread
    metrics.render() ----- ("render", n) -----------> command thread: ("rendered", n, text)
    shutdown() ----------- ("stop", timeout) -------> in-flight requests ended, ("stopped",), exit

Why apart: in one process, the ~240 kernel calls of a step each give up the GIL and wait to
take it back from whichever web thread holds it. A one-row step beside two busy request-like
threads in its process took 5.2x its quiet time, beside two busy processes 2.3x
(bench/engine_contention.py, 2-core Xeon). On the live platform, side by side: another
tenant's idle first token p50 0.033 -> 0.021 s, its p99 beside an attacker's 16 decoding
streams 0.095 -> 0.063 s and beside a 400-connection burst 0.300 -> 0.208 s (docs/benchmarks.md).

The child reads its config from the socket, loads, and answers "ready" (the shape the web
side checks requests against, and its first stats) or "failed". It ignores SIGINT and SIGTERM:
the web process stops it (its drain ends in-flight requests first), and it exits by itself
when the web process is gone (its socket reads end of file), however that died. A child that
dies under the web process (killed for memory, a crash in native code) fails the requests in
flight with an error and is started again; /readyz reads "failed" meanwhile.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import math
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from inference.engine.api import EngineStats, Lane, RequestOutput, SamplingParams
from inference.engine.async_engine import (AsyncEngine, EngineNotRunningError, RequestStream, _Abort, _Add, _Pause,
                                           _RequestState, _resolve)
from inference.engine.config import EngineConfig
from inference.engine.errors import DuplicateRequestError, EngineError
from inference.engine.request_checks import RequestChecks

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
# Loading the model: the packaged one takes ~5 s; a first GGUF conversion or a large model more.
START_TIMEOUT_S = 600.0
# How often the web side looks for streams whose readers went away or went silent.
SWEEP_EVERY_S = 0.5
# A child that keeps dying is started again after 1, 2, 4... seconds, at most this.
MAX_RESTART_DELAY_S = 30.0
_BUSY = struct.Struct("d")  # the engine thread's busy-since, shared: NaN while it waits for work


# -- errors across the socket ------------------------------------------------------------------

def _encode_error(exc: BaseException) -> tuple:
    """An exception as (class, attributes, message): the engine's errors take constructor
    arguments that pickling them would not pass back."""
    try:
        pickle.dumps(type(exc))
        state = dict(vars(exc))
        pickle.dumps(state)
    except Exception:  # a library's exception that does not travel: its words do
        return EngineError, {}, f"{type(exc).__name__}: {exc}"
    return type(exc), state, str(exc)


def _decode_error(payload: tuple) -> BaseException:
    cls, state, message = payload
    exc = cls.__new__(cls)
    BaseException.__init__(exc, message)
    exc.__dict__.update(state)
    return exc


# -- the engine process ------------------------------------------------------------------------

class _Client:
    """A web process the engine serves: what it is told goes through a writer of its own, so a
    web process that stops reading never holds up the engine thread or the other web processes."""

    def __init__(self, conn: Connection, name: str, limit: int | None = None) -> None:
        self.conn, self.name = conn, name
        self.writer = _Writer(conn.fileno(), limit=limit)

    def send(self, message: tuple) -> None:
        try:
            self.writer.send(message)
        except OSError:  # gone, or past its buffer's bound: its command thread sees the end and cleans up
            pass

    def close(self) -> None:
        self.writer.close()
        self.conn.close()


class _CoreEngine(AsyncEngine):
    """An AsyncEngine whose submitters and readers are in web processes (one, or several sharing
    this engine): each iteration's answers go down each one's socket as one message, outputs to
    the process that submitted the request, stats to all. Submit futures are request ids here."""

    def __init__(self, engine, busy: mmap.mmap, **kw):
        self._busy_map = busy
        super().__init__(engine, lease_s=math.inf, **kw)  # the web side holds the leases
        self._sent_stats: EngineStats | None = None
        self.by_id: dict[str, _RequestState] = {}  # for pauses; pruned as requests finish
        self.owners: dict[str, _Client] = {}  # each request's web process, until it finishes
        self.clients: list[_Client] = []  # replaced, never changed in place: the engine thread iterates it
        self._clients_lock = threading.Lock()  # web processes join and leave on threads of their own

    @property
    def _busy_since(self) -> float | None:
        value = _BUSY.unpack_from(self._busy_map)[0]
        return None if math.isnan(value) else value

    @_busy_since.setter
    def _busy_since(self, value: float | None) -> None:
        _BUSY.pack_into(self._busy_map, 0, math.nan if value is None else value)

    def join(self, client: _Client) -> None:
        with self._clients_lock:
            self.clients = [*self.clients, client]

    def leave(self, client: _Client) -> list[str]:
        """Forget `client`; the ids of its requests still here, for the caller to abort."""
        with self._clients_lock:
            self.clients = [c for c in self.clients if c is not client]
        return [rid for rid, owner in list(self.owners.items()) if owner is client]

    def _settle(self, request_id, exc: BaseException | None) -> None:
        """A refused add, to its web process (added ones go with the iteration's message, _flush)."""
        self.by_id.pop(request_id, None)
        owner = self.owners.pop(request_id, None)
        if owner is not None:
            owner.send(("iter", [(request_id, _encode_error(exc))], [], None))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        messages: dict[_Client, tuple[list, list]] = {}  # web process -> (adds settled, outputs)
        for item in outbox:
            if not isinstance(item, tuple):  # a request id: its add is in the engine
                owner = self.owners.get(item)
                if owner is not None:
                    messages.setdefault(owner, ([], []))[0].append((item, None))
                continue
            out = item[1]
            if out.finished:
                self.by_id.pop(out.request_id, None)
                owner = self.owners.pop(out.request_id, None)
            else:
                owner = self.owners.get(out.request_id)
            if owner is not None:
                messages.setdefault(owner, ([], []))[1].append(out)
        stats = self._snapshot
        if stats != self._sent_stats:
            self._sent_stats = stats
            shared = dataclasses.replace(stats, lanes=dict(stats.lanes))
            for client in self.clients:
                settled, outputs = messages.get(client, ((), ()))
                client.send(("iter", list(settled), list(outputs), shared))
            return
        for client, (settled, outputs) in messages.items():
            client.send(("iter", settled, outputs, None))


class _Compiles:
    """Grammars compiled on a thread of their own, not the command thread: a 64 KiB JSON schema
    (STRUCTURED_MAX_SCHEMA_BYTES) takes ~80 ms to compile (2-core Zen 3), and on the command
    thread every tenant's submits, aborts and pauses queued behind a tenant's batch of them.
    A request's add is posted when its grammar is compiled; an abort or pause for it that
    arrives meanwhile is held and posted after the add, in the order the web process sent
    them (an abort posted first would find nothing, and the request would then run unread)."""

    def __init__(self, core: _CoreEngine) -> None:
        self.core = core
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.lock = threading.Lock()
        self.pending: dict[str, tuple[_RequestState, list]] = {}

    def start(self, state: _RequestState, prompt, params, cache_salt, arrival) -> None:
        with self.lock:
            self.pending[state.request_id] = (state, [])
        self.pool.submit(self._compile, state, prompt, params, cache_salt, arrival)

    def hold(self, request_id: str, command: Callable[[_RequestState], object]) -> bool:
        """Keep `command(state)` for after the add of a request whose grammar is compiling."""
        with self.lock:
            entry = self.pending.get(request_id)
            if entry is None:
                return False
            entry[1].append(command(entry[0]))
            return True

    def _compile(self, state: _RequestState, prompt, params, cache_salt, arrival) -> None:
        core, rid = self.core, state.request_id
        try:
            matcher, error = core.engine.grammars.matcher(params.grammar), None
        except Exception as exc:  # the client's grammar (InvalidRequestError) or llguidance's failure
            matcher, error = None, exc
        with self.lock:
            _, held = self.pending.pop(rid)
            if error is not None:
                core._settle(rid, error)
                return
            core.by_id[rid] = state
            core._post(_Add(state, prompt, params, cache_salt, rid, matcher, arrival_time=arrival))
            for command in held:
                core._post(command)


GONE = "the web process that submitted this request is gone"


def _serve_commands(core: _CoreEngine, client: _Client, compiles: _Compiles, *, shared: bool) -> int:
    """A web process's commands, until it says stop or is gone. Serving it alone (`shared`
    False), the process then exits, as it does when the engine thread stops serving (its rebuild
    failed), for the web process to start another; shared, its requests are aborted and the
    engine serves the others on."""
    conn = client.conn
    while True:
        try:
            if not conn.poll(1.0):
                if not core.is_ready():
                    log.error("the engine stopped serving; its process exits to be started again")
                    return 3
                continue
            command = conn.recv()
        except (EOFError, OSError):
            if not shared:
                log.warning("the web process is gone; the engine process exits")
                return 0
            _forget_client(core, client, compiles)
            log.info("web process %s left", client.name)
            return 0
        kind = command[0]
        if kind == "add":
            _, rid, payload = command
            if core.owners.setdefault(rid, client) is not client:  # another web process's request
                client.send(("iter", [(rid, _encode_error(DuplicateRequestError(rid)))], [], None))
                continue
            try:  # apart from the id: a request that cannot be read here is refused, not lost
                prompt, params, lane, tenant_id, cache_salt, arrival = pickle.loads(payload)
            except Exception as exc:
                log.exception("request %s could not be read", rid)
                core._settle(rid, EngineError(f"the engine could not read this request ({type(exc).__name__})"))
                continue
            if not core.is_ready():
                core._settle(rid, EngineNotRunningError("the engine is not running"))
                continue
            state = _RequestState(rid, None, lane, tenant_id, submitted_at=core._clock(), pulled_at=core._clock())
            matcher = None
            if params is not None and params.grammar is not None and core.engine.grammars is not None:
                try:
                    matcher = core.engine.grammars.cached(params.grammar)
                except Exception as exc:
                    core._settle(rid, exc)
                    continue
                if matcher is None:  # not on the engine thread either, whose every request would wait
                    compiles.start(state, prompt, params, cache_salt, arrival)
                    continue
            core.by_id[rid] = state
            core._post(_Add(state, prompt, params, cache_salt, rid, matcher, arrival_time=arrival))
        elif kind in ("abort", "pause") and core.owners.get(command[1]) is not client:
            continue  # not this web process's request (a finished one's id, or another's)
        elif kind == "abort":
            _abort(core, compiles, command[1], command[2])
        elif kind == "pause":
            rid, paused = command[1], command[2]
            if compiles.hold(rid, lambda state, paused=paused: _Pause(state, paused)):
                continue
            state = core.by_id.get(rid)
            if state is not None:
                core._post(_Pause(state, paused))
        elif kind == "render":
            client.send(("rendered", command[1], core.metrics.render() if core.metrics else b""))
        elif kind == "stop":
            if shared:  # a web process stopping: its requests end, the engine serves the others
                _forget_client(core, client, compiles)
            else:
                core.shutdown(command[1])
            client.send(("stopped",))
            return 0


def _abort(core: _CoreEngine, compiles: _Compiles, rid: str, error: str | None) -> None:
    if not compiles.hold(rid, lambda _state: _Abort(rid, None, error)):
        core._post(_Abort(rid, None, error))


def _forget_client(core: _CoreEngine, client: _Client, compiles: _Compiles) -> None:
    """A web process gone or stopping: nobody reads its requests any more, so they stop."""
    for rid in core.leave(client):
        _abort(core, compiles, rid, GONE)


def _load_apart(config: EngineConfig):
    """The engine, or what loading it raised, loaded on a thread that ends before the engine
    thread starts. libgomp gives each thread that opens a parallel region a team of its own and,
    while it manages more threads than there are CPUs, has their workers sleep between regions
    instead of spinning: loaded on this (main) thread, whose team outlives the load, the engine
    thread's steps each woke a sleeping worker some 300 times, and a one-token step of SmolLM2
    took 25 ms against 13 ms in the engine alone (2-core AMX Xeon, bench/engine_contention.py).
    A team ends with its thread, so nothing here but the engine thread keeps one."""
    from inference.engine.engine import LLMEngine

    result: list = []

    def load() -> None:
        try:
            result.append(LLMEngine.from_config(config))
        except Exception as exc:  # noqa: BLE001 (reported by the caller, as loading on its own thread would)
            result.append(exc)

    loader = threading.Thread(target=load, name="engine-load")
    loader.start()
    loader.join()
    return result[0]


def _start(config: EngineConfig, busy: mmap.mmap) -> tuple[_CoreEngine, dict] | Exception:
    """The engine loaded and serving, with what its web processes are told when they connect;
    or what loading raised."""
    from inference.engine.metrics import EngineMetrics

    loaded = _load_apart(config)
    if isinstance(loaded, Exception):
        return loaded
    engine = loaded
    import gc

    gc.collect()
    gc.freeze()  # the weights and the model's objects are never garbage: full collections skip them
    core = _CoreEngine(engine, busy, metrics=EngineMetrics())
    core.start()
    if engine.grammars is not None:
        # llguidance's tokenizer, built at the first structured request, took 0.33 s of the
        # command thread (2-core Zen 3), where every tenant's submits queue: built now, beside it.
        threading.Thread(target=engine.grammars.tokenizer, name="grammar-tokenizer", daemon=True).start()
    bm = engine.block_manager
    return core, {"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len,
                  "num_blocks": bm.num_blocks, "block_size": bm.block_size, "model_name": engine.model_name}


def _ready(core: _CoreEngine, info: dict) -> tuple:
    # With its first stats: the next ones come with the first iteration, and until a request
    # ran the operator's engine page read a cache of zero blocks.
    stats = core.stats()
    return ("ready", {**info, "stats": dataclasses.replace(stats, lanes=dict(stats.lanes))})


def main(argv: list[str]) -> int:
    """The engine as the child of one web process (`python -m inference.engine.process FD BUSY_FD`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the web process decides when the engine stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(argv[1]))
    busy = mmap.mmap(int(argv[2]), _BUSY.size)
    config, log_level = conn.recv()  # the web process's level: its LOG_LEVEL
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine %(process)d] %(message)s")
    started = _start(config, busy)
    if isinstance(started, Exception):
        log.error("the engine failed to load", exc_info=started)
        conn.send(("failed", _encode_error(started)))
        return 1
    core, info = started
    client = _Client(conn, "parent")  # no bound: the process it serves is its parent, and alone
    client.send(_ready(core, info))
    core.join(client)
    return _serve_commands(core, client, _Compiles(core), shared=False)


# -- one engine for several web processes ------------------------------------------------------

# What an engine shared by web processes buffers for one that stops reading before it drops it
# (that process then fails its requests and connects again): an iteration's message is a few KB.
CLIENT_BUFFER_BYTES = 64 * 1024**2
HELLO_TIMEOUT_S = 10.0


def config_differences(mine: EngineConfig, theirs: EngineConfig) -> list[str]:
    """The settings two processes must agree on to share an engine (not its CPU threads, which
    each process sizes for itself)."""
    return [f.name for f in dataclasses.fields(EngineConfig)
            if f.name != "cpu_threads" and getattr(mine, f.name) != getattr(theirs, f.name)]


class SharedEngine:
    """The engine serving every web process that connects to a Unix socket: one model in memory
    and one batch for all of them (a GPU holds one engine). A web process that goes away
    (its socket's end of file) has its requests aborted; the others are served on.

    `serve()` returns once stopped: `stop()` (SIGTERM) stops taking web processes, waits for
    the connected ones to leave (they drain first) at most `drain_timeout_s`, then ends the
    requests still running."""

    def __init__(self, config: EngineConfig, path: str | os.PathLike, *, drain_timeout_s: float = 30.0) -> None:
        self.config, self.path, self.drain_timeout_s = config, os.fspath(path), drain_timeout_s
        self._stopping = threading.Event()
        self.core: _CoreEngine | None = None

    def serve(self) -> int:
        busy_fd = os.memfd_create("llm-engine-busy")
        os.ftruncate(busy_fd, _BUSY.size)
        busy = mmap.mmap(busy_fd, _BUSY.size)
        _BUSY.pack_into(busy, 0, math.nan)
        started = _start(self.config, busy)
        if isinstance(started, Exception):
            log.error("the engine failed to load", exc_info=started)
            return 1
        self.core, info = started
        # Which engine this is, for the fleet to count an engine its web processes share once.
        info["engine_id"] = f"{socket.gethostname()}:{os.getpid()}"
        compiles = _Compiles(self.core)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound only once loaded: until then a web process's connect is refused and it retries,
        # reading "loading" on its /readyz meanwhile.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        old_umask = os.umask(0o077)  # the socket is this user's alone: it takes any tenant's request
        try:
            listener.bind(self.path)
        finally:
            os.umask(old_umask)
        listener.listen(64)
        listener.settimeout(0.5)
        log.info("engine serving web processes on %s", self.path)
        try:
            while not self._stopping.is_set():
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    continue
                sock.settimeout(None)
                threading.Thread(target=self._welcome, args=(sock, busy_fd, info, compiles), daemon=True,
                                 name="engine-client").start()
        finally:
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        deadline = time.monotonic() + self.drain_timeout_s
        while self.core.clients and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.core.clients:
            log.warning("%d web processes still connected after %.0f s; stopping", len(self.core.clients),
                        self.drain_timeout_s)
        self.core.shutdown()
        for client in self.core.clients:
            client.close()
        return 0

    def stop(self) -> None:
        self._stopping.set()

    def _welcome(self, sock: socket.socket, busy_fd: int, info: dict, compiles: _Compiles) -> None:
        core = self.core
        try:
            socket.send_fds(sock, [b"B"], [busy_fd])
            conn = Connection(sock.detach())
        except OSError:
            sock.close()
            return
        try:
            if not conn.poll(HELLO_TIMEOUT_S):
                raise EOFError
            kind, config, name = conn.recv()
            if kind != "hello":
                raise EOFError
        except (EOFError, OSError, ValueError, TypeError, pickle.UnpicklingError, AttributeError, ImportError):
            conn.close()  # not a web process of ours, or one that died saying hello
            return
        differ = config_differences(self.config, config)
        if differ:
            log.error("web process %s refused: its INFERENCE settings differ from this engine's (%s)", name,
                      ", ".join(differ))
            error = EngineError(f"this web process's INFERENCE settings differ from the engine server's: "
                                f"{', '.join(differ)}")
            with contextlib.suppress(OSError):
                conn.send(("failed", _encode_error(error)))
            conn.close()
            return
        client = _Client(conn, name, limit=CLIENT_BUFFER_BYTES)
        client.send(_ready(core, info))  # before it joins: no iteration reaches it ahead of "ready"
        core.join(client)
        log.info("web process %s connected", name)
        try:
            _serve_commands(core, client, compiles, shared=True)
        finally:
            if client in core.clients:  # not left through its commands (an error here)
                _forget_client(core, client, compiles)
            client.close()


# -- the web process's side --------------------------------------------------------------------

class _Blocks:
    """The KV cache's size, as requests are checked against it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class EngineShape(RequestChecks):
    """What the web tier reads of the engine without its weights: the tokenizer, the context
    length and the cache's size, with the engine's own request checks."""

    grammars = None  # compiled in the engine process

    def __init__(self, info: dict, tokenizer) -> None:
        self.vocab_size, self.max_model_len = info["vocab_size"], info["max_model_len"]
        self.model_name = info["model_name"]
        self.block_manager = _Blocks(info["num_blocks"], info["block_size"])
        self.tokenizer = tokenizer


class _RemoteMetrics:
    def __init__(self, owner: EngineProcess) -> None:
        self._owner = owner

    def render(self) -> bytes:
        """The engine process's Prometheus registry; empty if it does not answer within 5 s."""
        return self._owner._render(timeout=5.0)


class _Writer:
    """Messages that never block the sender (the web tier's event loop, the engine thread): what
    the socket does not take at once waits in a buffer that a thread of its own writes out, in
    order. A stopped or stuck engine process stops reading; its socket fills (~200 KB: a few
    long prompts) and a plain send then blocked the whole web process, probes and console
    included, not just the requests to the engine. Likewise a web process that stops reading
    must not stop an engine that others share: past `limit` bytes it is dropped."""

    def __init__(self, fd: int, limit: int | None = None) -> None:
        self._limit = limit  # bytes buffered past which the peer counts as gone
        # The same socket: MSG_DONTWAIT per call leaves the descriptor, which the reader shares, blocking.
        self._sock = socket.socket(fileno=os.dup(fd))
        self._lock = threading.Condition()
        self._pending = bytearray()
        self._closed = False
        threading.Thread(target=self._drain, name="llm-engine-writer", daemon=True).start()

    def send(self, message: tuple) -> None:
        """Raises OSError once the engine process is gone."""
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = struct.pack("!i", len(body)) + body  # multiprocessing.connection's framing (under 2 GiB)
        with self._lock:
            if self._closed:
                raise BrokenPipeError("the engine process is gone")
            if not self._pending:
                try:
                    sent = self._sock.send(frame, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                if sent == len(frame):
                    return
                frame = frame[sent:]
            if self._limit is not None and len(self._pending) + len(frame) > self._limit:
                self._closed = True
                self._pending.clear()
                self._lock.notify()
                with contextlib.suppress(OSError):  # both ends read the end of file: the peer is dropped
                    self._sock.shutdown(socket.SHUT_RDWR)
                raise BrokenPipeError(f"the peer read nothing of the last {self._limit} bytes")
            self._pending += frame
            self._lock.notify()

    def _drain(self) -> None:
        while True:
            with self._lock:
                while not (self._pending or self._closed):
                    self._lock.wait()
                if self._closed:
                    return
                chunk = bytes(self._pending)  # stays pending meanwhile: later sends queue behind it
            try:
                self._sock.sendall(chunk)
            except OSError:
                self.close()
                return
            with self._lock:
                del self._pending[:len(chunk)]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._pending.clear()
            self._lock.notify()
        self._sock.close()


@dataclasses.dataclass
class _Child:
    proc: subprocess.Popen | None  # None: a shared engine's, not this process's child
    conn: Connection  # what the engine process says, read by the supervisor
    busy: mmap.mmap
    writer: _Writer  # what it is told
    closed: bool = False  # a shared engine's connection ended

    def alive(self) -> bool:
        return not self.closed if self.proc is None else self.proc.poll() is None


class EngineProcess:
    """`AsyncEngine`'s serving interface over an engine in a child process, or, given `shared`
    (a Unix socket's path), over the `SharedEngine` that serves this and other web processes
    there: started by someone else (`manage.py engine_server`), connected to, and connected to
    again when it restarts."""

    def __init__(self, config: EngineConfig, *, lease_s: float = 45.0, clock: Callable[[], float] = time.monotonic,
                 start_timeout_s: float = START_TIMEOUT_S, shared: str | os.PathLike | None = None,
                 name: str = "") -> None:
        self.config, self.lease_s = config, lease_s
        self.shared = None if shared is None else os.fspath(shared)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self._clock = clock  # RequestStream reads it; the lease is on it
        self.start_timeout_s = start_timeout_s
        self.metrics = _RemoteMetrics(self)
        self.engine: EngineShape | None = None
        self.engine_id: str | None = None  # a shared engine's: the same in each web process it serves
        self._lock = threading.Lock()  # _states, _adds, _renders and sending
        self._states: dict[str, _RequestState] = {}
        self._last: dict[str, RequestOutput] = {}  # each request's latest output: its counters so far
        self._adds: dict[str, asyncio.Future] = {}
        self._renders: dict[int, concurrent.futures.Future] = {}
        self._tickets = itertools.count()
        self._aborting: set[str] = set()
        self._child: _Child | None = None
        self._snapshot = EngineStats()
        self._serving = False
        self._stopping = False
        self._restarts = 0
        self._supervisor: threading.Thread | None = None
        self.error = ""

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine process and wait until it serves; raises what its loading raised."""
        if self._supervisor is not None:
            raise RuntimeError("EngineProcess.start() called twice")
        info = self._connect() if self.shared else self._spawn()
        from inference.engine.sources import resolve_source
        from inference.engine.tokenizer import Tokenizer

        # After the child loaded: it converted and cached the tokenizer a GGUF carries.
        tokenizer = Tokenizer.load(resolve_source(self.config.model), self.config.cache_dir)
        self.engine = EngineShape(info, tokenizer)
        self._serving = True
        self._supervisor = threading.Thread(target=self._supervise, name="llm-engine-process", daemon=True)
        self._supervisor.start()

    def _spawn(self) -> dict:
        parent, child = socket.socketpair()
        busy_fd = os.memfd_create("llm-engine-busy")
        os.ftruncate(busy_fd, _BUSY.size)
        busy = mmap.mmap(busy_fd, _BUSY.size)
        _BUSY.pack_into(busy, 0, math.nan)
        try:  # `-m` from ROOT: the checkout is first on the engine process's path, as it is on ours
            proc = subprocess.Popen([sys.executable, "-m", "inference.engine.process", str(child.fileno()), str(busy_fd)],
                                    pass_fds=(child.fileno(), busy_fd), cwd=ROOT, stdin=subprocess.DEVNULL)
        finally:
            child.close()
            os.close(busy_fd)
        conn = Connection(parent.detach())
        try:
            conn.send((self.config, logging.getLogger().getEffectiveLevel()))
            if not conn.poll(self.start_timeout_s):
                raise EngineError(f"the engine process did not load within {self.start_timeout_s:g} s")
            answer = conn.recv()
        except BaseException as exc:
            conn.close()
            proc.kill()
            proc.wait()
            if isinstance(exc, EOFError):
                raise EngineError(f"the engine process exited while loading (exit code {proc.returncode})") from None
            raise
        if answer[0] == "failed":
            conn.close()
            proc.wait()
            raise _decode_error(answer[1])
        self._child = _Child(proc, conn, busy, _Writer(conn.fileno()))
        self._snapshot = answer[1]["stats"]  # the new process's: a restarted one's cache is empty
        log.info("engine process %d serving", proc.pid)
        return answer[1]

    def _connect(self) -> dict:
        """Connect to the shared engine, waiting while it loads (its socket appears once loaded)."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.shared)
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                if not fds:
                    raise ConnectionResetError("the engine server closed the connection")
                sock.settimeout(None)
                break
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError) as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise EngineError(f"no engine server answered on {self.shared} within "
                                      f"{self.start_timeout_s:g} s ({type(exc).__name__})") from None
                time.sleep(0.2)
            except TimeoutError:
                sock.close()
                raise EngineError(f"the engine server on {self.shared} did not answer within "
                                  f"{self.start_timeout_s:g} s") from None
        busy = mmap.mmap(fds[0], _BUSY.size)
        os.close(fds[0])
        conn = Connection(sock.detach())
        try:
            conn.send(("hello", self.config, self.name))
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise EngineError(f"the engine server on {self.shared} did not answer within {self.start_timeout_s:g} s")
            answer = conn.recv()
        except EOFError:
            conn.close()
            raise EngineError(f"the engine server on {self.shared} closed the connection") from None
        except BaseException:
            conn.close()
            raise
        if answer[0] == "failed":
            conn.close()
            raise _decode_error(answer[1])
        self._child = _Child(None, conn, busy, _Writer(conn.fileno()))
        self._snapshot = answer[1]["stats"]
        self.engine_id = answer[1]["engine_id"]
        log.info("connected to the engine server on %s", self.shared)
        return answer[1]

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine process (leave the shared engine); requests still in flight end with
        finish_reason "error"."""
        with self._lock:
            self._stopping = True
            self._serving = False
            child = self._child
        if child is not None:
            try:
                with self._lock:
                    child.writer.send(("stop", timeout))
            except OSError:
                pass
            if self._supervisor is not None and self._supervisor is not threading.current_thread():
                self._supervisor.join(timeout + 5)
            try:
                if child.proc is not None:
                    child.proc.wait(5)
            except subprocess.TimeoutExpired:
                log.error("engine process %d did not stop; killing it", child.proc.pid)
                child.proc.kill()
                child.proc.wait()
            child.writer.close()
            child.conn.close()
        self._fail_all("the engine is shutting down")

    def is_ready(self) -> bool:
        child = self._child
        return self._serving and child is not None and child.alive()

    def busy_for(self) -> float:
        """Seconds the engine thread has spent in its current loop iteration (0 while it waits)."""
        child = self._child
        if child is None or not self._serving:
            return 0.0
        since = _BUSY.unpack_from(child.busy)[0]
        return 0.0 if math.isnan(since) else max(0.0, time.monotonic() - since)

    # -- requests ------------------------------------------------------------------------------

    async def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                     lane: int = Lane.NEAR_REALTIME, tenant_id: str | None = None,
                     cache_salt: str | None = None) -> RequestStream:
        """Queue a request; raises what the engine's add_request raises, as AsyncEngine.submit does."""
        if not self.is_ready():
            raise EngineNotRunningError("the engine is not running")
        loop = asyncio.get_running_loop()
        now = self._clock()
        state = _RequestState(request_id, loop, lane, tenant_id, submitted_at=now, pulled_at=now)
        future = loop.create_future()
        with self._lock:
            if request_id in self._states:
                raise DuplicateRequestError(request_id)
            self._states[request_id] = state
            self._adds[request_id] = future
            try:
                # The engine's own Lane: the web tier's lanes are Django choices, which the engine
                # process (no Django there) could not unpickle.
                payload = pickle.dumps((prompt, params, Lane(int(lane)), None if tenant_id is None else str(tenant_id),
                                        cache_salt, time.monotonic()))
                self._child.writer.send(("add", request_id, payload))
            except (OSError, AttributeError):
                self._forget(request_id)
                raise EngineNotRunningError("the engine is not running") from None
        try:
            await future
        except asyncio.CancelledError:
            self._post(_Abort(request_id, state))  # the add may have happened: it must not run unread
            raise
        except BaseException:
            with self._lock:
                self._forget(request_id)
            raise
        return RequestStream(self, state)

    def abort(self, request_id: str) -> None:
        self._post(_Abort(request_id))

    def stats(self) -> EngineStats:
        snapshot = self._snapshot
        stats = dataclasses.replace(snapshot, ready=self.is_ready(), restarts=snapshot.restarts + self._restarts)
        if self.shared:  # the engine's other web processes' requests are theirs to drain
            with self._lock:
                stats = dataclasses.replace(stats, in_flight=len(self._states))
        return stats

    def _post(self, command) -> None:
        """RequestStream's aborts and pauses, to the engine process."""
        if isinstance(command, _Abort):
            message = ("abort", command.request_id, command.error)
        elif isinstance(command, _Pause):
            message = ("pause", command.state.request_id, command.paused)
        else:
            raise TypeError(command)
        with self._lock:
            if self._child is None or self._stopping:
                return
            try:
                self._child.writer.send(message)
            except OSError:  # the engine process died: its supervisor fails the request
                pass

    def _render(self, timeout: float) -> bytes:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._child is None or not self._serving:
                return b""
            ticket = next(self._tickets)
            self._renders[ticket] = future
            try:
                self._child.writer.send(("render", ticket))
            except OSError:
                self._renders.pop(ticket, None)
                return b""
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._renders.pop(ticket, None)
            return b""

    def _forget(self, request_id: str) -> None:
        """Under the lock."""
        self._states.pop(request_id, None)
        self._last.pop(request_id, None)
        self._adds.pop(request_id, None)
        self._aborting.discard(request_id)

    # -- the supervisor thread -----------------------------------------------------------------

    def _supervise(self) -> None:
        delay = 1.0
        while True:
            child = self._child
            self._read(child)
            if self._stopping:
                return
            if child.proc is None:
                child.closed = True
                self.error = f"the engine server on {self.shared} closed the connection"
            else:
                self.error = f"the engine process exited (code {child.proc.wait()})"
            child.writer.close()
            child.conn.close()
            self._serving = False
            log.error("%s; failing the requests in flight and %s", self.error,
                      "connecting again" if self.shared else "starting another")
            self._fail_all(f"the engine failed while computing this request ({self.error})")
            while not self._stopping:
                time.sleep(delay)
                try:
                    with self._lock:
                        self._child = None
                    self._connect() if self.shared else self._spawn()
                except Exception:
                    log.exception("the engine process could not start again; retrying in %.0f s", delay)
                    delay = min(MAX_RESTART_DELAY_S, delay * 2)
                    continue
                with self._lock:
                    if self._stopping:  # shut down while it loaded
                        self._child.writer.send(("stop", 0))
                        return
                    self._restarts += 1
                    self._serving = True
                    self.error = ""
                break

    def _read(self, child: _Child) -> None:
        """Answers from the engine process until it stops or dies."""
        swept = time.monotonic()
        while True:
            try:
                if child.conn.poll(SWEEP_EVERY_S):
                    message = child.conn.recv()
                else:
                    message = None
            except (EOFError, OSError):
                return
            if message is not None:
                kind = message[0]
                if kind == "iter":
                    self._take(*message[1:])
                elif kind == "rendered":
                    with self._lock:
                        future = self._renders.pop(message[1], None)
                    if future is not None:
                        future.set_result(message[2])
                elif kind == "stopped":
                    return
            if time.monotonic() - swept >= SWEEP_EVERY_S:
                swept = time.monotonic()
                self._sweep()

    def _take(self, settled: list, outputs: list[RequestOutput], stats: EngineStats | None) -> None:
        if stats is not None:
            self._snapshot = stats  # before the outputs: a reader that saw its last one reads stats that count it
        with self._lock:
            for request_id, error in settled:
                future = self._adds.pop(request_id, None)
                if error is not None:
                    self._states.pop(request_id, None)
                if future is not None:
                    _resolve(future, None if error is None else _decode_error(error))
            delivered = []
            for out in outputs:
                state = self._states.get(out.request_id)
                if state is None:
                    continue
                self._last[out.request_id] = out
                if out.finished:
                    self._forget(out.request_id)
                delivered.append((state, out))
        for state, out in delivered:
            try:
                state.loop.call_soon_threadsafe(state.put, out)
            except RuntimeError:  # the reader's loop is closed: nobody will read it
                state.abandoned = True

    def _sweep(self) -> None:
        """Abort requests whose reader went away: closed, collected, or silent past the lease."""
        now = self._clock()
        aborts = []
        with self._lock:
            for rid, state in self._states.items():
                if rid in self._aborting or rid in self._adds:
                    continue
                if state.abandoned:
                    aborts.append((rid, None))
                elif not state.in_pull and now - state.pulled_at > self.lease_s:
                    log.warning("request %s: no read for %.0f s, aborting it", rid, now - state.pulled_at)
                    aborts.append((rid, f"stream lease expired: the consumer did not read for {self.lease_s:g} s"))
            self._aborting.update(rid for rid, _ in aborts)
        for rid, error in aborts:
            self._post(_Abort(rid, None, error))

    def _fail_all(self, message: str) -> None:
        """End every request in flight with an error carrying its counters so far."""
        with self._lock:
            states, self._states = self._states, {}
            last, self._last = self._last, {}
            adds, self._adds = self._adds, {}
            renders, self._renders = self._renders, {}
            self._aborting.clear()
        for future in adds.values():
            _resolve(future, EngineNotRunningError(message))
        for future in renders.values():
            future.set_result(b"")
        for rid, state in states.items():
            if rid in adds:
                continue
            seen = last.get(rid)
            out = RequestOutput(
                request_id=rid, new_token_ids=(), new_text="", finished=True, finish_reason="error",
                num_prompt_tokens=seen.num_prompt_tokens if seen else 0,
                num_cached_tokens=seen.num_cached_tokens if seen else 0,
                num_output_tokens=seen.num_output_tokens if seen else 0, error=message)
            try:
                state.loop.call_soon_threadsafe(state.put, out)
            except RuntimeError:
                pass


if __name__ == "__main__":
    code = main(sys.argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not the interpreter's teardown: Triton's bindings report their objects as leaked there
