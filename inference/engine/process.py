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

class _CoreEngine(AsyncEngine):
    """An AsyncEngine whose submitters and readers are in the web process: each iteration's
    answers go down the socket as one message. Submit futures are request ids here."""

    def __init__(self, engine, conn: Connection, send_lock: threading.Lock, busy: mmap.mmap, **kw):
        self._busy_map = busy
        super().__init__(engine, lease_s=math.inf, **kw)  # the web side holds the leases
        self._conn = conn
        self._send_lock = send_lock
        self._added: list[str] = []
        self._sent_stats: EngineStats | None = None
        self.by_id: dict[str, _RequestState] = {}  # for pauses; pruned as requests finish

    @property
    def _busy_since(self) -> float | None:
        value = _BUSY.unpack_from(self._busy_map)[0]
        return None if math.isnan(value) else value

    @_busy_since.setter
    def _busy_since(self, value: float | None) -> None:
        _BUSY.pack_into(self._busy_map, 0, math.nan if value is None else value)

    def send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except OSError:  # the web process is gone: the command thread sees it and exits
                pass

    def _settle(self, request_id, exc: BaseException | None) -> None:
        if exc is None:
            self._added.append(request_id)
            return
        self.by_id.pop(request_id, None)
        self.send(("iter", [(request_id, _encode_error(exc))], [], None))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        self._added = []
        outputs = []
        for item in outbox:
            if not isinstance(item, tuple):
                self._settle(item, None)
                continue
            out = item[1]
            if out.finished:
                self.by_id.pop(out.request_id, None)
            outputs.append(out)
        stats = self._snapshot
        if not (outputs or self._added) and stats == self._sent_stats:
            return
        self._sent_stats = stats
        self.send(("iter", [(rid, None) for rid in self._added], outputs,
                   dataclasses.replace(stats, lanes=dict(stats.lanes))))


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


def _serve_commands(core: _CoreEngine, conn: Connection) -> int:
    """The child's main thread: commands from the web process until it says stop or is gone,
    or the engine thread stops serving (its rebuild failed): then the process exits, and the
    web process starts another."""
    compiles = _Compiles(core)
    while True:
        try:
            if not conn.poll(1.0):
                if not core.is_ready():
                    log.error("the engine stopped serving; its process exits for the web process to start another")
                    return 3
                continue
            command = conn.recv()
        except (EOFError, OSError):
            log.warning("the web process is gone; the engine process exits")
            return 0
        kind = command[0]
        if kind == "add":
            _, rid, payload = command
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
        elif kind == "abort":
            rid, error = command[1], command[2]
            if not compiles.hold(rid, lambda _state, rid=rid, error=error: _Abort(rid, None, error)):
                core._post(_Abort(rid, None, error))
        elif kind == "pause":
            rid, paused = command[1], command[2]
            if compiles.hold(rid, lambda state, paused=paused: _Pause(state, paused)):
                continue
            state = core.by_id.get(rid)
            if state is not None:
                core._post(_Pause(state, paused))
        elif kind == "render":
            core.send(("rendered", command[1], core.metrics.render() if core.metrics else b""))
        elif kind == "stop":
            core.shutdown(command[1])
            core.send(("stopped",))
            return 0


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


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the web process decides when the engine stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(argv[1]))
    busy = mmap.mmap(int(argv[2]), _BUSY.size)
    config, log_level = conn.recv()  # the web process's level: its LOG_LEVEL
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine %(process)d] %(message)s")
    from inference.engine.metrics import EngineMetrics

    loaded = _load_apart(config)
    if isinstance(loaded, Exception):
        log.error("the engine failed to load", exc_info=loaded)
        conn.send(("failed", _encode_error(loaded)))
        return 1
    engine = loaded
    import gc

    gc.collect()
    gc.freeze()  # the weights and the model's objects are never garbage: full collections skip them
    core = _CoreEngine(engine, conn, threading.Lock(), busy, metrics=EngineMetrics())
    core.start()
    bm = engine.block_manager
    # With its first stats: the next ones come with the first iteration, and until a request
    # ran the operator's engine page read a cache of zero blocks.
    stats = core.stats()
    core.send(("ready", {"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len,
                         "num_blocks": bm.num_blocks, "block_size": bm.block_size, "model_name": engine.model_name,
                         "stats": dataclasses.replace(stats, lanes=dict(stats.lanes))}))
    if engine.grammars is not None:
        # llguidance's tokenizer, built at the first structured request, took 0.33 s of the
        # command thread (2-core Zen 3), where every tenant's submits queue: built now, beside it.
        threading.Thread(target=engine.grammars.tokenizer, name="grammar-tokenizer", daemon=True).start()
    return _serve_commands(core, conn)


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
    """Messages to the engine process that never block the sender (the web tier's event loop):
    what the socket does not take at once waits in a buffer that a thread of its own writes
    out, in order. A stopped or stuck engine process stops reading; its socket fills (~200 KB:
    a few long prompts) and a plain send then blocked the whole web process, probes and
    console included, not just the requests to the engine."""

    def __init__(self, fd: int) -> None:
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
    proc: subprocess.Popen
    conn: Connection  # what the engine process says, read by the supervisor
    busy: mmap.mmap
    writer: _Writer  # what it is told


class EngineProcess:
    """`AsyncEngine`'s serving interface over an engine in a child process."""

    def __init__(self, config: EngineConfig, *, lease_s: float = 45.0, clock: Callable[[], float] = time.monotonic,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.config, self.lease_s = config, lease_s
        self._clock = clock  # RequestStream reads it; the lease is on it
        self.start_timeout_s = start_timeout_s
        self.metrics = _RemoteMetrics(self)
        self.engine: EngineShape | None = None
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
        info = self._spawn()
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

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine process; requests still in flight end with finish_reason "error"."""
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
        return self._serving and child is not None and child.proc.poll() is None

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
        return dataclasses.replace(snapshot, ready=self.is_ready(), restarts=snapshot.restarts + self._restarts)

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
            code = child.proc.wait()
            child.writer.close()
            child.conn.close()
            self._serving = False
            self.error = f"the engine process exited (code {code})"
            log.error("%s; failing the requests in flight and starting another", self.error)
            self._fail_all(f"the engine failed while computing this request ({self.error})")
            while not self._stopping:
                time.sleep(delay)
                try:
                    with self._lock:
                        self._child = None
                    self._spawn()
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
