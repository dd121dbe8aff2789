"""Admission of one generation, and what it holds of its tenant's limits while it runs.

Owns: the served-model check, the lane (the tier's, or a worse one the request asks for),
the tenant's concurrent-generation slots (one per choice, all or none, with a short
in-process wait for a slot to free), the token reservation against tokens/min and the
monthly budget, renewing both while the generation runs, and giving the slots back.

Not here: the limits themselves (`tenants.quota` says what a tier allows, `tenants.limits`
keeps the counts in Redis), the pool those calls run on (`tenants.admission`; this module
is named `gate` to keep the two apart), and settling the reservation once the tokens are
counted (`inference.billing`). Every refusal is an `ApiError` in the OpenAI shape.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from django.conf import settings

from inference import catalog, protocol
from inference.protocol import GenerationRequest
from tenants import admission, errors, quota
from tenants.errors import ApiError
from tenants.limits import Decision, Lease
from tenants.models import ApiKey, QuotaTier, Tenant

log = logging.getLogger(__name__)


def served_model(request: GenerationRequest) -> str:
    """The model this server serves; a request naming another one is refused (404)."""
    model = catalog.served_model_id()
    if request.model is not None and request.model != model:
        raise ApiError(404, f"The model '{request.model}' does not exist; this server serves '{model}'.",
                       code="model_not_found", param="model")
    return model


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


def lane_for(request: GenerationRequest, tier: QuotaTier, header_priority: int | None, override: int | None) -> int:
    """The request's lane: `override` when given (batch items), else the body's `priority` (403
    past the tier's), else the X-Priority header (the same), else `service_tier` (capped to the
    tier's lane), else the tier's."""
    if override is not None:
        return override
    if request.priority is not None:
        return resolve_lane(tier.lane, request.priority, "priority")
    if header_priority is None and request.service_tier is not None:
        # A preference, as OpenAI treats it: "priority" on a tier without P0 runs at the tier's lane.
        wanted = protocol.SERVICE_TIERS[request.service_tier]
        return tier.lane if wanted is None else max(tier.lane, wanted)
    return resolve_lane(tier.lane, header_priority, "X-Priority")


class _SlotWaiters:
    """Requests of a tenant waiting for its generation slots in this process, first come first
    woken: a generation that ends wakes as many as it held slots, so a waiting request costs no
    Redis call until a slot may be free. At most SLOT_WAITERS_PER_TENANT of a tenant wait; past
    that its requests are refused at once, without asking Redis."""

    def __init__(self) -> None:
        self._waiting: dict[int, deque[asyncio.Future]] = {}

    def full(self, tenant_id: int) -> bool:
        """Whether another request of the tenant may not wait (with the bound at 0, none waits)."""
        return len(self._waiting.get(tenant_id, ())) >= settings.SLOT_WAITERS_PER_TENANT

    def queued(self, tenant_id: int) -> bool:
        return bool(self._waiting.get(tenant_id))

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


@dataclass
class Holds:
    """One generation's slots and token reservation: taken at admission, renewed while it runs.

    `release` stops the renewal and gives the slots back; the reservation stays in `tokens`
    for billing to settle with the tokens actually used."""

    gen_id: str
    tenant: Tenant
    api_key: ApiKey | None = None  # its own limits apply beside the tenant's
    lease: Lease | None = None
    tokens: quota.TokenAdmission | None = None
    _renewer: asyncio.Task | None = field(default=None, repr=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)  # renewal vs release
    _released: bool = False

    @property
    def caller(self) -> str:
        """Whose share of the admission pool these calls use."""
        return admission.tenant_caller(self.tenant.pk)

    @property
    def token_decision(self) -> Decision | None:
        """The tokens/min decision that admitted the generation (None outside tokens/min)."""
        return self.tokens.decision if self.tokens is not None else None

    async def take_slots(self, request: GenerationRequest) -> None:
        """One concurrent-generation slot per choice, all or none. A tenant at its limit waits up to
        SLOT_WAIT_S for slots to free, woken when one of its generations in this process ends, and
        tries once more at the end (a generation elsewhere may have ended); then the 429. Past
        SLOT_WAITERS_PER_TENANT waiting requests, the 429 comes at once."""
        choices = request.n * request.num_prompts
        param = "n" if request.n > 1 else ("prompt" if request.kind == "completion" else "n")
        if _slot_waiters.queued(self.tenant.pk) and _slot_waiters.full(self.tenant.pk):
            # Its generations are all running and as many requests wait already: a burst of a
            # tenant's requests is answered without a Redis call or a second of waiting each
            # (400 at once had another tenant's first token wait 4.4 s).
            raise self._queue_full()
        deadline = time.monotonic() + settings.SLOT_WAIT_S
        while True:
            try:
                self.lease = await self._take(choices, param)
                return
            except ApiError as error:
                left = deadline - time.monotonic()
                if error.status != 429 or left <= 0:
                    raise
                if _slot_waiters.full(self.tenant.pk):
                    raise self._queue_full() from None
            await _slot_waiters.wait(self.tenant.pk, left)

    def _queue_full(self) -> ApiError:
        return errors.slot_queue_full(self.tenant.tier.concurrent_streams, settings.SLOT_WAITERS_PER_TENANT)

    async def _take(self, choices: int, param: str) -> Lease:
        # Left while its slots were being taken, the request keeps them so that release() gives
        # them back, rather than leave them held for their TTL.
        return await admission.run(quota.open_stream, self.tenant, None, choices, param, caller=self.caller,
                                   what="generation slots", keep=lambda lease: setattr(self, "lease", lease))

    async def reserve_tokens(self, request: GenerationRequest, prompt_tokens: int, max_tokens: int, choices: int,
                             metered: bool) -> None:
        """Reserve the most the request can use against tokens/min (when `metered`) and the
        monthly budget, then keep the reservation and the slots alive until `release`."""
        admit = quota.admit_tokens if metered else quota.admit_unmetered_tokens
        try:
            # Left meanwhile, it keeps the reservation so that its settlement gives it back, rather
            # than leave the budget held until its TTL and tokens/min charged for nothing.
            self.tokens = await admission.run(admit, self.tenant, prompt_tokens, max_tokens, choices, self.api_key,
                                              caller=self.caller, what="token admission",
                                              keep=lambda tokens: setattr(self, "tokens", tokens))
        except ApiError as error:
            if error.param == "max_tokens":  # name the field the client sent
                error.param = request.max_tokens_param
            raise
        self._renewer = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        period = settings.STREAM_LEASE_TTL_S / 3
        while True:
            await asyncio.sleep(period)
            async with self._lock:
                if self._released:
                    return
                try:
                    live = await asyncio.to_thread(self._renew_now)
                except Exception as exc:  # Redis blipped: renewal puts lapsed slots back next time
                    log.warning("generation %s: could not renew its slots and budget hold: %s", self.gen_id, exc)
                    continue
                if not live:
                    log.warning("generation %s: its slots had lapsed (Redis was away longer than their TTL); "
                                "they count again", self.gen_id)

    def _renew_now(self) -> bool:
        live = quota.renew_stream(self.lease) if self.lease is not None else True
        if self.tokens is not None:
            for hold in self.tokens.holds:
                quota.renew_budget(hold)
        return live

    async def release(self) -> None:
        """Stop renewing; give the slots back and wake this tenant's waiting requests."""
        async with self._lock:
            self._released = True
            if self._renewer is not None:
                self._renewer.cancel()
            if self.lease is not None:
                try:
                    await asyncio.to_thread(quota.close_stream, self.lease)
                except Exception as exc:  # the slots expire by themselves after their TTL
                    log.warning("generation %s: could not release its slots: %s", self.gen_id, exc)
                else:
                    _slot_waiters.freed(self.tenant.pk, self.lease.count)
