"""One API call's generation, from admission to settlement, whatever the transport.

The SSE consumers, the plain-JSON path and the WebSocket consumer all drive a
`Generation` the same way:

    gen = Generation(request, caller, ...)
    await gen.start()              # admission: engine, model, lane, tokens, quota, lease, submit
    async for batch in gen.events(idle_s): ...   # coalesced deltas; [] after idle_s of silence
    await gen.close()              # always, in `finally`: abort what runs, bill, refund, release

`start` raises `ApiError` (the OpenAI error shape) for every refusal, having released
whatever it took. Admitting reserves the most the request can use against tokens/min and
the monthly budget, takes one concurrent-generation slot per choice, and journals the usage
row (`tenants.ledger`) before the engine sees the request. `close` is safe to call more
than once and after a cancellation: it aborts the engine requests still open, releases the
slots, waits briefly for their final counters, completes the usage row with the tokens
actually generated (aborted requests included) and settles both reservations.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from django.conf import settings
from django.utils import timezone

from inference import catalog, public_errors
from inference.engine.async_engine import EngineNotRunningError, RequestStream
from inference.engine.errors import InvalidRequestError, QueueFullError
from inference.engine.api import RequestOutput
from inference.host import LOADING, EngineUnavailable, host
from inference.protocol import GenerationRequest, bad_request
from tenants import admission, errors, quota
from tenants.errors import ApiError
from tenants.ledger import UsageEntry, ledger
from tenants.limits import Decision, Lease
from tenants.models import ApiKey, Tenant

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the legacy completions API's default
FINAL_OUTPUT_WAIT_S = 5.0
# A settlement Redis refused is tried again this many times, this far apart: a blip of a few
# seconds must not leave a generation's tokens out of its tenant's monthly counter.
SETTLE_RETRIES, SETTLE_RETRY_S = 5, 2.0

# Settlements retried after the generation closed; held here so they are not collected.
_settling: set[asyncio.Task] = set()


class _SlotWaiters:
    """Requests of a tenant waiting for its generation slots in this process, first come first
    woken: a generation that ends wakes as many as it held slots, so a waiting request costs no
    Redis call until a slot may be free."""

    def __init__(self) -> None:
        self._waiting: dict[int, deque[asyncio.Future]] = {}

    async def wait(self, tenant_id: int, timeout: float) -> None:
        """Return when woken or after `timeout`, whichever comes first."""
        waiter = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(tenant_id, deque())
        queue.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            pass
        finally:
            with contextlib.suppress(ValueError):
                queue.remove(waiter)
            if not queue and self._waiting.get(tenant_id) is queue:
                del self._waiting[tenant_id]

    def freed(self, tenant_id: int, slots: int) -> None:
        queue = self._waiting.get(tenant_id)
        while queue and slots > 0:
            waiter = queue.popleft()
            if not waiter.done():
                waiter.set_result(None)
                slots -= 1


_slot_waiters = _SlotWaiters()


@dataclass(frozen=True)
class Caller:
    """Who is asking: the authenticated key's tenant (tier loaded) and the key."""

    tenant: Tenant
    api_key: ApiKey | None = None
    rate_limit: Decision | None = None  # the requests/min decision that admitted this call


def resolve_lane(tier_lane: int, requested: int | None, param: str = "priority") -> int:
    """The tier's lane is the best a tenant gets; it may ask for a worse one, never a better one."""
    if requested is None:
        return tier_lane
    if requested < tier_lane:
        raise ApiError(
            403,
            f"This key's tier may use lane P{tier_lane} or a lower-priority one (P{tier_lane}..P2); "
            f"P{requested} was asked for.",
            type="permission_error",
            code="priority_not_allowed",
            param=param,
        )
    return requested


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


@dataclass
class Choice:
    index: int
    prompt_index: int
    stream: RequestStream
    num_tokens: int = 0
    finish_reason: str | None = None
    final: RequestOutput | None = None
    error: str | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class Generation:
    request: GenerationRequest
    caller: Caller
    header_priority: int | None = None
    hold_lease: bool = False
    id_prefix: str = "chatcmpl"
    lane_override: int | None = None  # batch items: always P2, whatever they ask for
    metered: bool = True  # False: outside tokens/min (batch items); max_tokens and the monthly budget still hold
    request_id: str | None = None
    # The usage row's key: one per generation unless given (a batch item's attempts share one).
    billing_key: str | None = None
    attempt: int = 0

    id: str = field(init=False)
    created: int = field(init=False)
    lane: int = field(init=False, default=1)
    model: str = field(init=False, default="")
    prompt_token_ids: list[list[int]] = field(init=False, default_factory=list)
    prompt_texts: list[str] = field(init=False, default_factory=list)  # completions: for `echo`
    choices: list[Choice] = field(init=False, default_factory=list)
    usage: Usage = field(init=False, default_factory=Usage)
    token_decision: Decision | None = field(init=False, default=None)
    _admission: quota.TokenAdmission | None = field(init=False, default=None)
    _lease: Lease | None = field(init=False, default=None)
    _renewer: asyncio.Task | None = field(init=False, default=None)
    _holds: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)  # renewal vs release
    _released: bool = field(init=False, default=False)
    _admitted_at: str = field(init=False, default="")
    _journaled: bool = field(init=False, default=False)
    _pumps: list[asyncio.Task] = field(init=False, default_factory=list)
    _queue: asyncio.Queue = field(init=False, default_factory=asyncio.Queue)
    _open: int = field(init=False, default=0)
    _started_at: float = field(init=False, default_factory=time.monotonic)
    _first_token_at: float | None = field(init=False, default=None)
    _closed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.id = self.request_id or f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    @property
    def tenant(self) -> Tenant:
        return self.caller.tenant

    def rate_limit_headers(self) -> dict[str, str]:
        headers = {}
        for decision in (self.caller.rate_limit, self.token_decision):
            if decision is not None:
                headers.update(errors.rate_limit_headers(decision))
        return headers

    # -- admission ------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        request, tier = self.request, self.tenant.tier
        self.model = catalog.served_model_id()
        if request.model is not None and request.model != self.model:
            raise ApiError(404, f"The model '{request.model}' does not exist; this server serves '{self.model}'.",
                           code="model_not_found", param="model")
        if self.lane_override is not None:
            self.lane = self.lane_override
        else:
            self.lane = resolve_lane(tier.lane, request.priority if request.priority is not None else self.header_priority,
                                     "priority" if request.priority is not None else "X-Priority")
        if self.hold_lease:
            # First, and cheap (one Redis call): a tenant at its concurrency limit is refused before
            # its prompt is tokenized and before two reservations are made and given back.
            await self._open_lease(request.n * request.num_prompts)
        try:
            engine = await host.wait_engine()
        except EngineUnavailable as exc:
            raise engine_error(exc) from None
        self.prompt_token_ids = await asyncio.to_thread(self._tokenize)
        max_tokens = self._max_tokens(engine.engine.max_model_len)
        choices = request.n * len(self.prompt_token_ids)
        prompt_tokens = sum(len(p) for p in self.prompt_token_ids)
        caller = f"tenant:{self.tenant.pk}"
        admit = quota.admit_tokens if self.metered else quota.admit_unmetered_tokens
        try:
            self._admission = await admission.run(admit, self.tenant, prompt_tokens, max_tokens, choices,
                                                  caller=caller, what="token admission")
        except ApiError as error:
            if error.param == "max_tokens":  # name the field the client sent
                error.param = request.max_tokens_param
            raise
        self.token_decision = self._admission.decision
        self._renewer = asyncio.create_task(self._renew_holds())
        self._admitted_at = timezone.now().isoformat()
        # Journaled before the engine sees the request: whatever happens next, it is billed.
        try:
            ledger().submit(self._usage_entry("open", Usage(prompt_tokens=prompt_tokens)))
        except OSError as exc:  # no journal (disk full, folder gone): serve nothing we could not bill
            log.error("generation %s: could not journal its usage: %s", self.id, exc)
            raise ApiError(503, "The service is temporarily unavailable.", type="server_error",
                           code="service_unavailable", headers={"Retry-After": "5"}) from None
        self._journaled = True
        salt = f"tier:{tier.pk}" if tier.share_prefix_cache else f"tenant:{self.tenant.pk}"
        for p, token_ids in enumerate(self.prompt_token_ids):
            for j in range(request.n):
                index = len(self.choices)
                try:
                    stream = await engine.submit(
                        f"{self.id}-{index}", token_ids, request.sampling_params(max_tokens, seed_offset=j),
                        lane=self.lane, tenant_id=self.tenant.engine_id, cache_salt=salt,
                    )
                except (InvalidRequestError, QueueFullError, EngineNotRunningError) as exc:
                    raise engine_error(exc) from None
                choice = Choice(index, p, stream)
                self.choices.append(choice)
                self._pumps.append(asyncio.create_task(self._pump(choice)))
                self._open += 1

    def _tokenize(self) -> list[list[int]]:
        tokenizer = host.tokenizer
        if self.request.kind == "chat":
            try:
                return [tokenizer.encode_chat(list(self.request.messages))]
            except Exception as exc:  # the template refused the conversation (e.g. roles out of order)
                raise bad_request(f"The conversation could not be rendered with the model's chat template: {exc}",
                                  "messages", "invalid_messages") from None
        vocab = host.engine().engine.vocab_size
        out = []
        for prompt in self.request.prompts:
            if isinstance(prompt, str):
                out.append(tokenizer.encode(prompt))
                self.prompt_texts.append(prompt)
                continue
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"Token id {bad} is outside the vocabulary (0..{vocab - 1}).", "prompt", "invalid_token_id")
            out.append(list(prompt))
            self.prompt_texts.append(tokenizer.decode(prompt) if self.request.echo else "")
        if any(not ids for ids in out):
            raise bad_request("A prompt encodes to no tokens.", "prompt", "empty_prompt")
        return out

    def _max_tokens(self, max_model_len: int) -> int:
        """The request's max_tokens, or the most its context, tier and rate limit allow."""
        tier = self.tenant.tier
        longest = max(len(p) for p in self.prompt_token_ids)
        param = "messages" if self.request.kind == "chat" else "prompt"
        if longest >= max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens, but the prompt has {longest} tokens.",
                param, "context_length_exceeded",
            )
        asked = self.request.max_tokens
        if asked is not None:
            if longest + asked > max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {max_model_len} tokens, but {longest + asked} were requested "
                    f"({longest} in the prompt, {asked} for the completion). Lower max_tokens or shorten the prompt.",
                    "max_tokens", "context_length_exceeded",
                )
            return asked
        choices = self.request.n * len(self.prompt_token_ids)
        by_rate = (tier.tokens_per_minute - sum(len(p) for p in self.prompt_token_ids)) // choices
        default = tier.max_tokens_per_request if self.request.kind == "chat" else DEFAULT_COMPLETION_MAX_TOKENS
        # An implicit max_tokens obeys the same n x max_tokens bound as an explicit one (protocol).
        by_request = settings.MAX_REQUEST_TOKENS // choices
        return max(1, min(default, tier.max_tokens_per_request, max_model_len - longest, by_rate, by_request))

    async def _open_lease(self, choices: int) -> None:
        """One concurrent-generation slot per choice, all or none. A tenant at its limit waits up to
        SLOT_WAIT_S for slots to free, woken when one of its generations in this process ends, and
        tries once more at the end (a generation elsewhere may have ended); then the 429."""
        deadline = time.monotonic() + settings.SLOT_WAIT_S
        while True:
            try:
                self._lease = await self._take_slots(choices)
                return
            except ApiError as error:
                left = deadline - time.monotonic()
                if error.status != 429 or left <= 0:
                    raise
            await _slot_waiters.wait(self.tenant.pk, left)

    async def _take_slots(self, choices: int) -> Lease:
        param = "n" if self.request.n > 1 else ("prompt" if self.request.kind == "completion" else "n")
        taking = asyncio.ensure_future(admission.run(quota.open_stream, self.tenant, None, choices, param,
                                                     caller=f"tenant:{self.tenant.pk}", what="generation slots"))
        try:
            return await asyncio.shield(taking)
        except asyncio.CancelledError:
            # The client left while its slots were being taken: the thread takes them all the same.
            # Wait for it so that close() gives them back, rather than leave them held for their TTL.
            with contextlib.suppress(Exception):
                self._lease = await taking
            raise

    async def _renew_holds(self) -> None:
        """Keep the slots and the budget reservation alive while the generation runs."""
        period = settings.STREAM_LEASE_TTL_S / 3
        while True:
            await asyncio.sleep(period)
            async with self._holds:
                if self._released:
                    return
                try:
                    live = await asyncio.to_thread(self._renew_now)
                except Exception as exc:  # Redis blipped: renewal puts lapsed slots back next time
                    log.warning("generation %s: could not renew its slots and budget hold: %s", self.id, exc)
                    continue
                if not live:
                    log.warning("generation %s: its slots had lapsed (Redis was away longer than their TTL); "
                                "they count again", self.id)

    def _renew_now(self) -> bool:
        live = quota.renew_stream(self._lease) if self._lease is not None else True
        if self._admission is not None:
            quota.renew_budget(self._admission.budget)
        return live

    async def _pump(self, choice: Choice) -> None:
        try:
            async for out in choice.stream:
                self._queue.put_nowait((choice, out))
        except Exception as exc:  # never expected; end the choice rather than hang the reader
            log.exception("generation %s: reading choice %d failed", self.id, choice.index)
            self._queue.put_nowait((choice, RequestOutput(choice.stream.request_id, (), "", True, "error", 0, 0, 0,
                                                          error=f"internal error: {type(exc).__name__}")))

    # -- streaming ------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._open == 0

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
            yield self._coalesce(pending)

    def _coalesce(self, pending: list[tuple[Choice, RequestOutput]]) -> list[tuple[Choice, RequestOutput]]:
        merged: dict[int, tuple[Choice, RequestOutput]] = {}
        for choice, out in pending:
            if out.new_token_ids and self._first_token_at is None:
                self._first_token_at = time.monotonic()
            choice.num_tokens += len(out.new_token_ids)
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

    async def collect(self) -> None:
        """Read every choice to its end (the non-streaming path)."""
        self.texts: dict[int, list[str]] = {}
        self.logprobs: dict[int, list] = {}
        async for batch in self.events():
            for choice, out in batch:
                self.texts.setdefault(choice.index, []).append(out.new_text)
                self.logprobs.setdefault(choice.index, []).extend(out.logprobs)

    # -- settlement -----------------------------------------------------------------------

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Shielded: a cancelled request (client gone) must still be billed and release its slot.
        await asyncio.shield(self._settle())

    async def _settle(self) -> None:
        for choice in self.choices:  # abort what still runs (a finished stream ignores this)
            await choice.stream.aclose()
        for task in self._pumps:
            task.cancel()
        # The client's stream is over: free its slots now, not after the engine's final counters.
        await self._release_holds()
        written = None
        try:
            finals = await asyncio.gather(*(c.stream.final(FINAL_OUTPUT_WAIT_S) for c in self.choices), return_exceptions=True)
            for choice, final in zip(self.choices, finals):
                if isinstance(final, RequestOutput):
                    choice.final = final
                    choice.finish_reason = choice.finish_reason or final.finish_reason
            self.usage = self._usage()
            if self.choices:
                written = ledger().submit(self._usage_entry("close", self.usage))
            elif self._journaled:  # refused after admission (engine, cancel): nothing ran
                ledger().submit(self._usage_entry("void", Usage()))
        except Exception:
            log.exception("generation %s: recording usage failed", self.id)
        if self._admission is not None:
            used = self.usage.total_tokens if self.choices else 0
            await _settle_quota(self.id, self.tenant, self._admission, used)
        if written is not None:
            # Normally milliseconds; a locked database must not hold the response's end for long.
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(written)), settings.USAGE_WRITE_WAIT_S)
        if self.choices:
            reasons = ",".join(sorted({c.finish_reason or "abort" for c in self.choices}))
            log.info("generation %s: tenant %s lane P%d, %d prompt + %d completion tokens (%s)", self.id,
                     self.tenant.pk, self.lane, self.usage.prompt_tokens, self.usage.completion_tokens, reasons)

    async def _release_holds(self) -> None:
        async with self._holds:
            self._released = True
            if self._renewer is not None:
                self._renewer.cancel()
            if self._lease is not None:
                try:
                    await asyncio.to_thread(quota.close_stream, self._lease)
                except Exception as exc:  # the slots expire by themselves after their TTL
                    log.warning("generation %s: could not release its slots: %s", self.id, exc)
                else:
                    _slot_waiters.freed(self.tenant.pk, self._lease.count)

    def _usage_entry(self, op: str, usage: Usage) -> UsageEntry:
        now = time.monotonic()
        return UsageEntry(
            op=op,
            key=self.billing_key or self.id,
            tenant_id=self.tenant.pk,
            lane=self.lane,
            created=self._admitted_at,
            api_key_id=self.caller.api_key.pk if self.caller.api_key is not None else None,
            request_id=self.id,
            model=self.model,
            attempt=self.attempt,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            ttft_ms=None if self._first_token_at is None else round((self._first_token_at - self._started_at) * 1000),
            latency_ms=round((now - self._started_at) * 1000) if op == "close" else None,
            finish_reason=",".join(sorted({c.finish_reason or "abort" for c in self.choices})) if op == "close" else "",
        )

    def _usage(self) -> Usage:
        usage = Usage(prompt_tokens=sum(len(p) for p in self.prompt_token_ids))
        cached: dict[int, int] = {}
        for choice in self.choices:
            final = choice.final
            usage.completion_tokens += final.num_output_tokens if final is not None else choice.num_tokens
            hit = final.num_cached_tokens if final is not None else 0
            cached[choice.prompt_index] = min(cached.get(choice.prompt_index, hit), hit)
        usage.cached_tokens = sum(cached.values())
        return usage


async def _settle_quota(gen_id: str, tenant: Tenant, taken: quota.TokenAdmission, used: int) -> None:
    """Settle tokens/min and the monthly budget; if Redis refuses, keep trying in the background."""
    try:
        await asyncio.to_thread(quota.settle, tenant, taken, used)
        return
    except Exception as exc:
        log.warning("generation %s: could not settle its reservations (%s); retrying", gen_id, exc)

    async def retry() -> None:
        for attempt in range(SETTLE_RETRIES):
            await asyncio.sleep(SETTLE_RETRY_S * (attempt + 1))
            try:
                await asyncio.to_thread(quota.settle, tenant, taken, used)
                return
            except Exception as exc:
                last = exc
        # The budget hold lapses by itself; the monthly counter misses these tokens until it is
        # next rebuilt from the usage rows, which have them.
        log.error("generation %s: gave up settling %d tokens: %s", gen_id, used, last)

    task = asyncio.create_task(retry())
    _settling.add(task)
    task.add_done_callback(_settling.discard)
