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

This class only sequences the steps; each job is a module of its own:
`inference.gate` (model, lane, slots, the token reservation and its renewal),
`inference.prompts` (tokenizing, max_tokens), `inference.streaming` (the engine requests
and their outputs) and `inference.billing` (usage, the usage row, settling the reservation).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from django.conf import settings

from inference import billing, drain, gate, prompts, streaming, tool_calls
from inference.billing import Usage
from inference.protocol import GenerationRequest
from inference.streaming import Choice
from tenants import actions, admission, errors
from tenants.limits import Decision
from tenants.models import ApiKey, Tenant

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """Who is asking: the authenticated key's tenant (tier loaded) and the key."""

    tenant: Tenant
    api_key: ApiKey | None = None
    rate_limit: Decision | None = None  # the requests/min decision that admitted this call


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
    endpoint: str = ""  # the usage row's: the API path, "batch" for batch items
    batch_id: str = ""  # the usage row's: a batch item's batch
    # time.monotonic() when the request had arrived whole (config.intake.arrival): its usage row's
    # ttft_ms and latency_ms count from there, the wait for its turn and its admission included;
    # from this object's creation when not given (a WebSocket's start, a batch item).
    arrived_at: float | None = None

    id: str = field(init=False)
    created: int = field(init=False)
    lane: int = field(init=False, default=1)
    model: str = field(init=False, default="")
    prompt_token_ids: list[list[int]] = field(init=False, default_factory=list)
    prompt_texts: list[str] = field(init=False, default_factory=list)  # completions: for `echo`
    usage: Usage = field(init=False, default_factory=Usage)
    texts: dict[int, list[str]] = field(init=False, default_factory=dict)  # after collect()
    logprobs: dict[int, list] = field(init=False, default_factory=dict)  # after collect()
    # Streamed chat with tools: each choice's output split into content and calls as it comes.
    call_parsers: dict[int, tool_calls.CallParser] = field(init=False, default_factory=dict)
    holds: gate.Holds = field(init=False)
    streams: streaming.Streams = field(init=False)
    row: billing.UsageRow = field(init=False)
    _started_at: float = field(init=False)
    _closed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._started_at = time.monotonic() if self.arrived_at is None else self.arrived_at
        self.id = self.request_id or f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.holds = gate.Holds(self.id, self.tenant, self.caller.api_key)
        self.streams = streaming.Streams(self.id)
        self.row = billing.UsageRow(
            key=self.billing_key or self.id, request_id=self.id, tenant_id=self.tenant.pk,
            api_key_id=self.caller.api_key.pk if self.caller.api_key is not None else None, attempt=self.attempt,
            endpoint=self.endpoint, batch=self.batch_id,
        )

    @property
    def tenant(self) -> Tenant:
        return self.caller.tenant

    @property
    def choices(self) -> list[Choice]:
        return self.streams.choices

    @property
    def token_decision(self) -> Decision | None:
        return self.holds.token_decision

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
        drain.refuse_if_draining()  # this replica is shutting down: the balancer retries elsewhere
        request, tier = self.request, self.tenant.tier
        self.model = gate.served_model(request)
        self.lane = gate.lane_for(request, tier, self.header_priority, self.lane_override)
        if self.hold_lease:
            # First, and cheap (one Redis call): a tenant at its concurrency limit is refused before
            # its prompt is tokenized and before two reservations are made and given back.
            await self.holds.take_slots(request)
        engine = await streaming.ready_engine()
        self.prompt_token_ids, self.prompt_texts = await asyncio.to_thread(prompts.tokenize, request)
        if self.tenant.debug_capture:  # off by default: then nothing of the prompt is stored
            await admission.run(actions.capture_prompt, self.tenant.pk, self.id, prompts.as_json(request),
                                caller=admission.tenant_caller(self.tenant.pk), what="prompt capture")
        max_tokens = prompts.max_tokens(request, tier, self.prompt_token_ids, engine.engine)
        choices = request.n * len(self.prompt_token_ids)
        prompt_tokens = sum(len(p) for p in self.prompt_token_ids)
        await self.holds.reserve_tokens(request, prompt_tokens, max_tokens, choices, metered=self.metered)
        # Journaled before the engine sees the request.
        self.row.open(self.lane, self.model, prompt_tokens, lambda: sum(c.num_tokens for c in self.streams.choices))
        await self.streams.submit(engine, request, self.prompt_token_ids, max_tokens, self.lane, self.tenant)

    # -- streaming ------------------------------------------------------------------------

    def events(self, idle_s: float | None = None):
        """Batches of (choice, delta), each choice's deltas merged; an empty batch after
        `idle_s` without output. Ends when every choice has finished. A reader that falls
        STREAM_PAUSE_AFTER_TOKENS behind pauses its choices in the engine until it catches up."""
        self.streams.pause_after_tokens = settings.STREAM_PAUSE_AFTER_TOKENS or None
        return self.streams.events(idle_s)

    async def collect(self) -> None:
        """Read every choice to its end (the non-streaming path) into `texts` and `logprobs`."""
        self.texts, self.logprobs = await self.streams.collect()

    # -- settlement -----------------------------------------------------------------------

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Shielded: a cancelled request (client gone) must still be billed and release its slot.
        await asyncio.shield(self._settle())

    async def _settle(self) -> None:
        await self.streams.abort()
        # The client's stream is over: free its slots now, not after the engine's final counters.
        await self.holds.release()
        written = None
        try:
            await self.streams.wait_finals()
            self.usage = billing.count_usage(self.prompt_token_ids, self.choices)
            written = self.row.record(self.usage, self.choices, self._started_at, self.streams.first_token_at)
        except Exception:
            self.row.untrack()
            log.exception("generation %s: recording usage failed", self.id)
        if self.holds.tokens is not None:
            used = self.usage.total_tokens if self.choices else 0
            await billing.settle_reservation(self.id, self.tenant, self.holds.tokens, used)
        if written is not None:
            await billing.wait_written(written)
        if self.choices:
            log.info("generation %s: tenant %s lane P%d, %d prompt + %d completion tokens (%s)", self.id,
                     self.tenant.pk, self.lane, self.usage.prompt_tokens, self.usage.completion_tokens,
                     billing.finish_reasons(self.choices))
