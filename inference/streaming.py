"""A generation's engine requests: submitting them, reading their outputs, aborting them.

Owns: waiting for the engine, one engine request per choice (`Choice`), reading each
choice's stream into one queue, handing the reader the outputs in batches (each choice's
deltas merged, so a slow reader never builds a backlog), aborting what still runs, and
waiting for the engine's final counters. Also the API's answer to an engine refusal
(`engine_error`) or to a request the engine failed part-way (`engine_failure`).

Not here: turning outputs into OpenAI objects (`inference.formatting`) or into a bill
(`inference.billing`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

from inference import public_errors
from inference.engine.async_engine import EngineNotRunningError, RequestStream
from inference.engine.api import InvalidRequestError, QueueFullError, RequestOutput
from inference.host import LOADING, EngineUnavailable, host
from inference.protocol import GenerationRequest
from tenants import errors
from tenants.errors import ApiError
from tenants.models import Tenant

log = logging.getLogger(__name__)

FINAL_OUTPUT_WAIT_S = 5.0


def engine_error(exc: Exception) -> ApiError:
    """The API's answer to an engine refusal at submit time."""
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, exc.message, code=exc.code, param=exc.param)
    if isinstance(exc, QueueFullError):
        return ApiError(
            429,
            f"The server is at capacity for this priority lane: {exc.message}.",
            type="engine_overloaded",
            code="lane_full",
            headers={"Retry-After": errors.retry_after(exc.retry_after_s)},
        )
    if isinstance(exc, EngineUnavailable):
        loading = exc.state == LOADING
        return ApiError(
            503,
            "The model is still loading; retry shortly." if loading else public_errors.ENGINE_UNAVAILABLE,
            type="server_error",
            code="model_loading" if loading else "engine_unavailable",
            headers={"Retry-After": "5" if loading else "30"},
        )
    if isinstance(exc, EngineNotRunningError):
        return ApiError(503, public_errors.ENGINE_UNAVAILABLE, type="server_error", code="engine_unavailable",
                        headers={"Retry-After": "30"})
    raise exc


def engine_failure(message: str) -> ApiError:
    """A request the engine failed part-way (a step raised; the engine serves on)."""
    return ApiError(500, f"The engine failed while generating: {message}", type="server_error", code="engine_error")


async def ready_engine():
    """The running engine, once it is ready; its absence as the API's 503."""
    try:
        return await host.wait_engine()
    except EngineUnavailable as exc:
        raise engine_error(exc) from None


@dataclass
class Choice:
    index: int
    prompt_index: int
    stream: RequestStream
    num_tokens: int = 0
    finish_reason: str | None = None
    final: RequestOutput | None = None
    error: str | None = None  # the engine failed this choice
    grammar_error: str | None = None  # its structured output reached a dead end (finish_reason "error")


@dataclass
class Streams:
    """The engine requests of one generation, one per choice, and their outputs as they come."""

    gen_id: str
    choices: list[Choice] = field(default_factory=list)
    first_token_at: float | None = None  # monotonic time of the first token of any choice
    _pumps: list[asyncio.Task] = field(default_factory=list, repr=False)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue, repr=False)
    _open: int = 0  # choices not finished yet
    # Tokens read from the engine that the reader has not taken; past pause_after_tokens per open
    # choice the choices are paused in the engine until it takes them (None: never pause).
    pause_after_tokens: int | None = None
    _unread_tokens: int = 0
    _paused: bool = False

    async def submit(self, engine, request: GenerationRequest, prompt_token_ids: list[list[int]], max_tokens: int,
                     lane: int, tenant: Tenant) -> None:
        """`request.n` engine requests per prompt, each a choice read as it runs. A refusal is
        raised as an `ApiError`; the choices submitted before it stay (abort them)."""
        tier = tenant.tier
        salt = f"tier:{tier.pk}" if tier.share_prefix_cache else f"tenant:{tenant.pk}"
        for p, token_ids in enumerate(prompt_token_ids):
            for j in range(request.n):
                index = len(self.choices)
                try:
                    stream = await engine.submit(
                        f"{self.gen_id}-{index}", token_ids, request.sampling_params(max_tokens, seed_offset=j),
                        lane=lane, tenant_id=tenant.engine_id, cache_salt=salt,
                    )
                except (InvalidRequestError, QueueFullError, EngineNotRunningError) as exc:
                    raise engine_error(exc) from None
                choice = Choice(index, p, stream)
                self.choices.append(choice)
                self._pumps.append(asyncio.create_task(self._pump(choice)))
                self._open += 1

    async def _pump(self, choice: Choice) -> None:
        try:
            async for out in choice.stream:
                self._queue.put_nowait((choice, out))
                self._unread_tokens += len(out.new_token_ids)
                if (self.pause_after_tokens is not None and not self._paused
                        and self._unread_tokens > self.pause_after_tokens * max(1, self._open)):
                    self._hold(True)
        except Exception as exc:  # never expected; end the choice rather than hang the reader
            log.exception("generation %s: reading choice %d failed", self.gen_id, choice.index)
            self._queue.put_nowait((choice, RequestOutput(choice.stream.request_id, (), "", True, "error", 0, 0, 0,
                                                          error=f"internal error: {type(exc).__name__}")))

    async def events(self, idle_s: float | None = None):
        """Batches of (choice, delta), each choice's deltas merged; an empty batch after
        `idle_s` without output. Ends when every choice has finished."""
        while self._open:
            # Not asyncio.wait_for: before Python 3.12 it returns the item, swallowing the
            # cancellation, when the task is cancelled (the client left) just as the item
            # arrives; the stream would then decode on to max_tokens for nobody.
            try:
                async with asyncio.timeout(idle_s or None):
                    first = await self._queue.get()
            except TimeoutError:
                yield []
                continue
            pending = [first]
            while not self._queue.empty():
                pending.append(self._queue.get_nowait())
            self._unread_tokens = 0
            if self._paused:
                self._hold(False)
            yield self._coalesce(pending)

    def _hold(self, paused: bool) -> None:
        """Pause every choice in the engine while the reader is behind, or resume them: a client
        that stops reading then holds its blocks but takes no compute from anyone."""
        self._paused = paused
        for choice in self.choices:
            choice.stream.pause(paused)

    def _coalesce(self, pending: list[tuple[Choice, RequestOutput]]) -> list[tuple[Choice, RequestOutput]]:
        merged: dict[int, tuple[Choice, RequestOutput]] = {}
        for choice, out in pending:
            if out.new_token_ids and self.first_token_at is None:
                self.first_token_at = time.monotonic()
            choice.num_tokens += len(out.new_token_ids)
            if out.error_kind == "grammar":  # the client's grammar, not an engine failure: the choice ends
                choice.grammar_error, out = out.error, replace(out, error=None)
            if out.finished:
                choice.finish_reason = out.finish_reason
                choice.final = out
                choice.error = out.error
                self._open -= 1
            if choice.index in merged:
                prev = merged[choice.index][1]
                out = RequestOutput(
                    out.request_id, prev.new_token_ids + out.new_token_ids, prev.new_text + out.new_text, out.finished,
                    out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens,
                    prev.logprobs + out.logprobs, out.error,
                )
            merged[choice.index] = (choice, out)
        return sorted(merged.values(), key=lambda item: item[0].index)

    async def collect(self) -> tuple[dict[int, list[str]], dict[int, list]]:
        """Read every choice to its end (the non-streaming path): each choice's texts and logprobs."""
        texts: dict[int, list[str]] = {}
        logprobs: dict[int, list] = {}
        async for batch in self.events():
            for choice, out in batch:
                texts.setdefault(choice.index, []).append(out.new_text)
                logprobs.setdefault(choice.index, []).extend(out.logprobs)
        return texts, logprobs

    async def abort(self) -> None:
        """Abort what still runs (a finished stream ignores this) and stop reading."""
        for choice in self.choices:
            await choice.stream.aclose()
        for task in self._pumps:
            task.cancel()

    async def wait_finals(self) -> None:
        """Wait up to FINAL_OUTPUT_WAIT_S for each choice's final counters (aborted ones included)."""
        finals = await asyncio.gather(*(c.stream.final(FINAL_OUTPUT_WAIT_S) for c in self.choices),
                                      return_exceptions=True)
        for choice, final in zip(self.choices, finals):
            if isinstance(final, RequestOutput):
                choice.final = final
                choice.finish_reason = choice.finish_reason or final.finish_reason
