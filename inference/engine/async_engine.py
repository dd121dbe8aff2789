"""`AsyncEngine`: one `LLMEngine` stepped by its own thread, streamed to asyncio callers.

The `LLMEngine` is not thread-safe, so exactly one thread touches it: the engine
thread. Everything else talks to that thread through a command queue (add, abort)
and gets answers back through its event loop (`loop.call_soon_threadsafe`):

    caller (event loop)                        engine thread
    await submit() -- _Add + future ------->   add_request(); resolve the future
    async for out in stream  <--- deltas ---   step(); route outputs to streams
    abort() / aclose() -- _Abort ---------->   engine.abort() before the next step

Each iteration of the engine thread: apply queued commands, abort requests whose
consumer is gone (closed, garbage-collected, or silent for longer than the lease),
step once, publish a stats snapshot. With nothing to do it sleeps on a condition.

When a consumer reads slower than the engine writes, the deltas waiting for it
are merged into one on the next read, so a slow client costs one pending list
per request (bounded by max_tokens) and never a queue of events.

Failures: an exception from `step()` ends the requests that were in that step
with finish_reason "error" (their blocks freed) and the loop serves on. If the
engine looks unusable afterwards (blocks held with nothing running, or several
failed steps in a row), every request in flight is failed and the engine is
rebuilt from its config, model and tokenizer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inference.engine.errors import EngineError
from inference.engine.api import EngineStats, Lane, RequestOutput, SamplingParams
from inference.engine.metrics import EngineMetrics
from inference.engine.sequence import Sequence

# The engine (and torch) only where one is stepped: the web process imports this module for an
# engine process's streams and never builds one.
if TYPE_CHECKING:
    from inference.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

# Failed steps in a row after which the engine counts as broken and is rebuilt.
MAX_CONSECUTIVE_STEP_FAILURES = 3
# How long the thread naps after a step that computed nothing while work remains
# (nothing admissible yet): long enough not to spin, short enough to recheck leases.
IDLE_STEP_WAIT_S = 0.01


class EngineNotRunningError(EngineError):
    """The engine thread is not serving (not started, shut down, or dead after a failed restart)."""


class _EngineUnusable(Exception):
    """Raised inside the engine thread to make its supervisor rebuild the engine."""


@dataclass(eq=False)
class _RequestState:
    """One request as both threads see it. The consumer's `RequestStream` holds it; the engine
    thread holds it too, but never the stream, so a stream dropped by its consumer is collected."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    lane: int
    tenant_id: str | None
    submitted_at: float
    # Written by the consumer's loop thread, read by the engine thread (plain attribute
    # stores are atomic under the GIL; pulled_at is stored before in_pull is cleared).
    pulled_at: float = 0.0
    in_pull: bool = False
    abandoned: bool = False
    # Loop thread only.
    pending: list[RequestOutput] = field(default_factory=list)
    waiter: asyncio.Future | None = None
    # Engine thread only.
    seq: Sequence | None = None
    num_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None

    def put(self, out: RequestOutput) -> None:
        """On the consumer's loop: queue a delta and wake the reader."""
        self.pending.append(out)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


@dataclass(frozen=True)
class _Add:
    state: _RequestState
    prompt: str | list[int]
    params: SamplingParams | None
    cache_salt: str | None
    future: asyncio.Future
    matcher: object = None  # the grammar's matcher, built before the command reaches the engine thread
    # On the engine's clock, read at submit: the request waits from then, not from when the
    # engine thread, busy with a step, gets to the command.
    arrival_time: float | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str
    state: _RequestState | None = None  # only abort if the id still belongs to this request
    error: str | None = None


@dataclass(frozen=True)
class _Pause:
    state: _RequestState
    paused: bool


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return dataclasses.replace(
        last,
        new_token_ids=tuple(t for o in outputs for t in o.new_token_ids),
        new_text="".join(o.new_text for o in outputs),
        logprobs=tuple(lp for o in outputs for lp in o.logprobs),
    )


def _resolve(future: asyncio.Future, exc: BaseException | None) -> None:
    """Settle a submit's future on its loop, unless the submitter already gave up."""

    def settle():
        if future.done():
            return
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)

    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:  # the submitter's loop is closed: nobody to tell
        pass


class RequestStream:
    """Async iterator of one request's `RequestOutput` deltas, ending after the finished one.

    Closing it early (`aclose()`, cancelling the task that reads it, or dropping the last
    reference, as `break` out of `async for` does) aborts the request.
    """

    def __init__(self, owner: AsyncEngine, state: _RequestState):
        self._owner = owner
        self._state = state
        self._closed = False
        self._final: RequestOutput | None = None

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        st = self._state
        clock = self._owner._clock
        st.in_pull = True
        st.pulled_at = clock()
        try:
            while not st.pending:
                st.waiter = st.loop.create_future()
                await st.waiter
        except BaseException:  # cancelled while waiting: the reader is gone
            self._close()
            raise
        finally:
            st.waiter = None
            st.pulled_at = clock()
            st.in_pull = False
        out = _merge(st.pending)
        st.pending.clear()
        if out.finished:
            self._closed = True
            self._final = out
        return out

    async def final(self, timeout: float = 5.0) -> RequestOutput | None:
        """The request's last output, whose counters are its totals (tokens generated, prompt
        and cached tokens). Closes the stream first if it is still open (aborting the request)
        and waits for the engine's answer to that; None if none comes within `timeout`."""
        if self._final is not None:
            return self._final
        self._close()
        st = self._state
        deadline = st.loop.time() + timeout
        while (done := next((o for o in st.pending if o.finished), None)) is None:
            remaining = deadline - st.loop.time()
            if remaining <= 0:
                return None
            st.waiter = st.loop.create_future()
            try:
                await asyncio.wait_for(st.waiter, remaining)
            except asyncio.TimeoutError:
                return None
            finally:
                st.waiter = None
        st.pending.clear()
        self._final = done
        return done

    def pause(self, paused: bool = True) -> None:
        """Hold the request out of the engine's steps while its consumer catches up (`paused`),
        or let it run again. It keeps its blocks; a finished or closed request ignores this."""
        if not self._closed:
            self._owner._post(_Pause(self._state, paused))

    async def aclose(self) -> None:
        self._close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._owner._post(_Abort(self._state.request_id, self._state))

    def __del__(self):
        # No lock here: __del__ may run on any thread, even inside the engine thread's
        # critical section. The engine thread sweeps abandoned requests every iteration.
        if not self._closed:
            self._state.abandoned = True


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        lease_s: float = 45.0,
        clock: Callable[[], float] = time.monotonic,
        metrics: EngineMetrics | None = None,
    ):
        self.engine = engine
        self.lease_s = lease_s
        self._clock = clock
        self.metrics = metrics
        self._cond = threading.Condition(threading.RLock())
        self._commands: deque = deque()
        self._states: dict[str, _RequestState] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._serving = False
        self._consecutive_failures = 0
        self._step_errors = 0
        self._restarts = 0
        self._snapshot = EngineStats()
        # The engine thread's heartbeat: when its current loop iteration began, or None while
        # it waits for work. Written by the engine thread only; read by readiness probes.
        self._busy_since: float | None = None
        # Outputs of this iteration, handed to their loops only after the stats snapshot is
        # published: a consumer that saw its final output then reads stats that include it.
        self._outbox: list[tuple[_RequestState, RequestOutput] | asyncio.Future] = []

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._publish()
        self._serving = True
        self._thread = threading.Thread(target=self._supervise, name="llm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; requests still in flight end with finish_reason "error"."""
        with self._cond:
            self._stopping = True
            self._serving = False
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                # A step is stuck; touching the engine now would race it. Fail the streams only.
                logger.error("engine thread did not stop within %.0f s", timeout)
                self._fail_all("the engine is shutting down", touch_engine=False, pending_adds=True)
                return
        self._fail_all("the engine is shutting down", touch_engine=True, pending_adds=True)

    def is_ready(self) -> bool:
        return self._serving and self._thread is not None and self._thread.is_alive()

    def busy_for(self) -> float:
        """Seconds the engine thread has spent in its current loop iteration (0 while it waits
        for work). A step that never returns shows here as a number that keeps growing."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, self._clock() - since)

    # -- requests ------------------------------------------------------------------------------

    async def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        lane: int = Lane.NEAR_REALTIME,
        tenant_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request; raises InvalidRequestError (DuplicateRequestError) as add_request does."""
        if not self.is_ready():
            raise EngineNotRunningError("the engine is not running")
        loop = asyncio.get_running_loop()
        now = self._clock()
        matcher = None
        if params is not None and params.grammar is not None and self.engine.grammars is not None:
            # Compiling a new grammar takes milliseconds to (for a large schema) a second: on a
            # thread of its own, not the engine's, whose every request would wait for it.
            matcher = await asyncio.to_thread(self.engine.grammars.matcher, params.grammar)
        state = _RequestState(request_id, loop, lane, tenant_id, submitted_at=now, pulled_at=now)
        future = loop.create_future()
        self._post(_Add(state, prompt, params, cache_salt, future, matcher, arrival_time=self.engine.clock()))
        try:
            await future
        except asyncio.CancelledError:
            # The add may still happen (or have happened): make sure it does not run unread.
            self._post(_Abort(request_id, state))
            raise
        return RequestStream(self, state)

    def abort(self, request_id: str) -> None:
        """Abort from any thread; the request's blocks are free before the next step."""
        self._post(_Abort(request_id))

    def stats(self) -> EngineStats:
        """The snapshot the engine thread published after its last iteration."""
        return dataclasses.replace(self._snapshot, ready=self.is_ready())

    def _post(self, command) -> None:
        with self._cond:
            if self._stopping:
                if isinstance(command, _Add):
                    self._settle(command.future, EngineNotRunningError("the engine is shutting down"))
                return
            self._commands.append(command)
            if isinstance(command, _Add):  # a step in flight that would make way for it ends early
                self.engine.note_arrival(command.state.tenant_id, command.state.lane)
            self._cond.notify()

    # -- the engine thread ---------------------------------------------------------------------

    def _supervise(self) -> None:
        try:
            self._supervised()
        except BaseException:  # KeyboardInterrupt, SystemExit: no stream may wait forever
            self._serving = False
            self._fail_all("the engine thread died", touch_engine=False, pending_adds=True)
            raise

    def _supervised(self) -> None:
        while True:
            try:
                self._serve()
                return
            except Exception as exc:  # a bug, or an engine left broken: restart with a fresh one
                logger.exception("engine loop failed; failing requests in flight and rebuilding the engine")
                self._restarts += 1
                self._fail_all(f"the engine restarted after an internal error ({type(exc).__name__})", touch_engine=True)
                try:
                    self._rebuild_engine()
                except Exception:
                    logger.exception("could not rebuild the engine; it stops serving")
                    self._serving = False
                    self._fail_all("the engine stopped after an internal error", touch_engine=False, pending_adds=True)
                    return
                self._consecutive_failures = 0
                self._publish()
                self._flush()

    def _serve(self) -> None:
        idle_step = False
        while True:
            with self._cond:
                self._busy_since = None
                while not (self._commands or self._stopping or self.engine.has_unfinished()):
                    self._cond.wait()
                if idle_step and not (self._commands or self._stopping):
                    self._cond.wait(IDLE_STEP_WAIT_S)
                if self._stopping:
                    return
                self._busy_since = self._clock()
                commands = list(self._commands)
                self._commands.clear()
                self.engine.arrivals.clear()  # added below, before the next step
            for command in commands:
                self._apply(command)
            self._sweep()
            idle_step = False
            if self.engine.has_unfinished():
                computed = self.engine.counters.computed_tokens
                started = self._clock()
                self._step()
                idle_step = self.engine.counters.computed_tokens == computed
                if self.metrics and not idle_step:  # an idle step's microseconds would hide the real ones
                    self.metrics.observe_step(self._clock() - started)
            self._publish()
            self._flush()

    def _apply(self, command) -> None:
        if isinstance(command, _Pause):
            if self._states.get(command.state.request_id) is command.state:
                self.engine.pause(command.state.request_id, command.paused)
            return
        if isinstance(command, _Abort):
            state = self._states.get(command.request_id)
            if state is not None and (command.state is None or command.state is state):
                self._abort(state, command.error)
            return
        state = command.state
        try:
            state.seq = self.engine.add_request(
                state.request_id, command.prompt, command.params, cache_salt=command.cache_salt, lane=state.lane,
                tenant_id=state.tenant_id, matcher=command.matcher, arrival_time=command.arrival_time,
            )
        except Exception as exc:  # InvalidRequestError and friends belong to the submitter
            self._settle(command.future, exc)
            return
        self._states[state.request_id] = state
        if self.metrics:
            self.metrics.observe_prompt(state.tenant_id, state.seq.num_prompt_tokens)
        self._outbox.append(command.future)  # resolved once the snapshot counts the request

    def _sweep(self) -> None:
        """Abort requests whose consumer went away: closed, collected, or silent past the lease."""
        now = self._clock()
        for state in list(self._states.values()):
            if state.abandoned:
                self._abort(state, None)
            elif not state.in_pull and now - state.pulled_at > self.lease_s:
                logger.warning("request %s: no read for %.0f s, aborting it", state.request_id, now - state.pulled_at)
                self._abort(state, f"stream lease expired: the consumer did not read for {self.lease_s:g} s")

    def _abort(self, state: _RequestState, error: str | None) -> None:
        out = self.engine.abort(state.request_id)
        if out is None:  # not in the engine (already finished there): still end the stream
            out = self._final_output(state, "abort")
        self._deliver(state, dataclasses.replace(out, error=error) if error else out)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._step_failed(exc)
            return
        self._consecutive_failures = 0
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is not None:
                self._deliver(state, out)

    def _step_failed(self, exc: Exception) -> None:
        self._step_errors += 1
        self._consecutive_failures += 1
        engine = self.engine
        # The step computed the running batch; waiting requests were not in it and go on.
        # A request the engine no longer knows finished inside the failed postprocess.
        in_step = {s.request_id for s in engine.scheduler.running}
        victims = [s for rid, s in self._states.items() if rid in in_step or rid not in engine.requests]
        logger.error(
            "engine step failed (%s); failing %d request(s): %s",
            type(exc).__name__,
            len(victims),
            ", ".join(s.request_id for s in victims),
            exc_info=exc,
        )
        message = f"the engine failed while computing this request ({type(exc).__name__}); it was stopped"
        for state in victims:
            self._fail(state, message)
        if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise _EngineUnusable(f"{self._consecutive_failures} failed steps in a row") from exc
        if not engine.scheduler.running and engine.block_manager.num_used_blocks:
            raise _EngineUnusable(f"{engine.block_manager.num_used_blocks} blocks held with nothing running") from exc

    def _fail(self, state: _RequestState, message: str, touch_engine: bool = True) -> None:
        out = self.engine.abort(state.request_id) if touch_engine else None
        if out is None:
            out = self._final_output(state, "error")
        self._deliver(state, dataclasses.replace(out, finish_reason="error", error=message))

    def _fail_all(self, message: str, touch_engine: bool, pending_adds: bool = False) -> None:
        """End every request in flight with an error; with pending_adds, refuse queued submits too."""
        for state in list(self._states.values()):
            try:
                self._fail(state, message, touch_engine)
            except Exception:  # the engine is broken: the stream must end all the same
                logger.exception("request %s: abort failed while failing it", state.request_id)
                self._deliver(state, dataclasses.replace(self._final_output(state, "error"), error=message))
        self._flush()
        if not pending_adds:
            return
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            if isinstance(command, _Add):
                self._settle(command.future, EngineNotRunningError(message))

    def _final_output(self, state: _RequestState, reason: str) -> RequestOutput:
        seq = state.seq
        return RequestOutput(
            request_id=state.request_id,
            new_token_ids=(),
            new_text="",
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens if seq else 0,
            num_cached_tokens=seq.num_cached_tokens if seq else 0,
            num_output_tokens=seq.num_output_tokens if seq else 0,
        )

    def _deliver(self, state: _RequestState, out: RequestOutput) -> None:
        """Account for `out` and hand it to the consumer's loop; the last one retires the request."""
        now = self._clock()
        if out.new_token_ids:
            if state.first_token_at is None:
                state.first_token_at = now
                if self.metrics:
                    self.metrics.observe_first_token(state.lane, now - state.submitted_at)
            state.last_token_at = now
            state.num_tokens += len(out.new_token_ids)
            if self.metrics:
                self.metrics.observe_tokens(state.tenant_id, len(out.new_token_ids))
        if out.finished:
            self._states.pop(state.request_id, None)
            if self.metrics:
                queued = self._queue_time(state.seq, out)
                self.metrics.observe_finished(state.lane, out.finish_reason, state.num_tokens, state.first_token_at,
                                              state.last_token_at, latency_s=now - state.submitted_at, queue_s=queued)
        self._outbox.append((state, out))

    def _queue_time(self, seq: Sequence | None, out: RequestOutput) -> float | None:
        """A request's wait before it was first scheduled, on the scheduler's clock; the whole
        wait of one that timed out in its queue; None for one aborted before it ran (its
        client's choice)."""
        if seq is None:
            return None
        if seq.first_scheduled_at is not None:
            return seq.first_scheduled_at - seq.arrival_time
        if out.error_kind == "queue_timeout":
            return self.engine.scheduler.clock() - seq.arrival_time
        return None

    def _settle(self, future, exc: BaseException | None) -> None:
        """Answer a submit: added (exc None) or refused. Overridden where submitters are elsewhere."""
        _resolve(future, exc)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        for item in outbox:
            if not isinstance(item, tuple):  # a submit's future: the request is in the engine
                self._settle(item, None)
                continue
            state, out = item
            try:
                state.loop.call_soon_threadsafe(state.put, out)
            except RuntimeError:  # the consumer's loop is closed: nobody will read this request
                state.abandoned = True

    def _rebuild_engine(self) -> None:
        old = self.engine
        # Drop the old KV cache before allocating the new one, or a device briefly needs two.
        old.runner = None
        old.block_manager = None
        from inference.engine.engine import LLMEngine

        self.engine = LLMEngine(old.config, old.loaded)  # the same weights, a fresh ModelRunner and cache
        self._states.clear()
        if self.metrics:
            self.metrics.reset_totals()

    def _publish(self) -> None:
        stats = dataclasses.replace(self.engine.stats(), in_flight=len(self._states), step_errors=self._step_errors,
                        restarts=self._restarts)
        self._snapshot = stats
        if self.metrics:
            self.metrics.observe_stats(stats)
