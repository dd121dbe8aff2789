"""What a generation used, and charging it for that exactly once.

Owns: `Usage` (the counts a response reports), counting it from the engine's final
counters (aborted choices included), the generation's usage row in the ledger
(`tenants.ledger`: `open` once admitted, before the engine sees the request; then `close`
with what it used, or `void` when nothing ran), and settling its token reservation
(`tenants.quota.settle`: tokens/min refunded, the monthly budget charged), retried in the
background when Redis refuses.

Not here: taking and renewing the reservation (`inference.gate`), or writing the rows to
the database (the ledger's writer does, idempotently, by the row's key).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone

from inference.streaming import Choice
from tenants import quota
from tenants.errors import ApiError
from tenants.ledger import UsageEntry, ledger
from tenants.models import Tenant

log = logging.getLogger(__name__)

# A settlement Redis refused is tried again this many times, this far apart: a blip of a few
# seconds must not leave a generation's tokens out of its tenant's monthly counter.
SETTLE_RETRIES, SETTLE_RETRY_S = 5, 2.0

# Settlements retried after the generation closed; held here so they are not collected.
_settling: set[asyncio.Task] = set()


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


def count_usage(prompt_token_ids: list[list[int]], choices: Sequence[Choice]) -> Usage:
    """The prompts, plus each choice's output by the engine's final counter (else the tokens it
    streamed); cached tokens per prompt are the fewest any of its choices reused."""
    usage = Usage(prompt_tokens=sum(len(p) for p in prompt_token_ids))
    cached: dict[int, int] = {}
    for choice in choices:
        final = choice.final
        usage.completion_tokens += final.num_output_tokens if final is not None else choice.num_tokens
        hit = final.num_cached_tokens if final is not None else 0
        cached[choice.prompt_index] = min(cached.get(choice.prompt_index, hit), hit)
    usage.cached_tokens = sum(cached.values())
    return usage


def finish_reasons(choices: Sequence[Choice]) -> str:
    """The choices' finish reasons, sorted and joined ("abort" for one that never finished)."""
    return ",".join(sorted({c.finish_reason or "abort" for c in choices}))


# The usage rows this process has open: key -> (attempt, the tokens generated so far). The fleet's
# heartbeat reports them, so a sweep can complete the rows of a replica that died (inference.sweep).
_open_rows: dict[str, tuple[int, Callable[[], int]]] = {}


def open_rows_progress() -> dict[str, str]:
    """Each open row's `attempt:tokens generated so far` (read from the heartbeat's thread)."""
    return {key: f"{attempt}:{generated()}" for key, (attempt, generated) in list(_open_rows.items())}


@dataclass
class UsageRow:
    """One generation's usage row in the ledger: `key` is one per generation unless given (a
    batch item's attempts share one). Opened once, then closed or voided by `record`."""

    key: str
    request_id: str
    tenant_id: int
    api_key_id: int | None = None
    attempt: int = 0
    lane: int = 1
    model: str = ""
    created: str = ""  # admission time, ISO 8601
    journaled: bool = False
    replica: str = ""
    endpoint: str = ""
    batch: str = ""

    def open(self, lane: int, model: str, prompt_tokens: int, generated: Callable[[], int]) -> None:
        """Journal the row before the engine sees the request: whatever happens next, it is
        billed. No journal (disk full, folder gone): a 503, so nothing is served unbilled.
        `generated` counts the tokens so far, for the fleet's heartbeat to report."""
        from inference import fleet  # the fleet reads the engine's host, which reads settings

        self.lane, self.model, self.created = lane, model, timezone.now().isoformat()
        self.replica = fleet.instance()
        try:
            ledger().submit(self._entry("open", Usage(prompt_tokens=prompt_tokens)))
        except OSError as exc:
            log.error("generation %s: could not journal its usage: %s", self.request_id, exc)
            raise ApiError(503, "The service is temporarily unavailable.", type="server_error",
                           code="service_unavailable", headers={"Retry-After": "5"}) from None
        self.journaled = True
        _open_rows[self.key] = (self.attempt, generated)

    def record(self, usage: Usage, choices: Sequence[Choice], started_at: float,
               first_token_at: float | None) -> concurrent.futures.Future | None:
        """Close the row with `usage` (some choice ran), or void it (admitted, nothing ran).
        Returns the close's write, to wait for, or None."""
        self.untrack()
        if choices:
            now = time.monotonic()
            return ledger().submit(self._entry(
                "close", usage,
                ttft_ms=None if first_token_at is None else round((first_token_at - started_at) * 1000),
                latency_ms=round((now - started_at) * 1000),
                finish_reason=finish_reasons(choices),
            ))
        if self.journaled:  # refused after admission (engine, cancel): nothing ran
            ledger().submit(self._entry("void", Usage()))
        return None

    def untrack(self) -> None:
        """No longer report the row's progress (it is recorded, or recording it failed)."""
        _open_rows.pop(self.key, None)

    def _entry(self, op: str, usage: Usage, **timings) -> UsageEntry:
        return UsageEntry(
            op=op, key=self.key, tenant_id=self.tenant_id, lane=self.lane, created=self.created,
            api_key_id=self.api_key_id, request_id=self.request_id, model=self.model, attempt=self.attempt,
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, replica=self.replica,
            cached_tokens=usage.cached_tokens, endpoint=self.endpoint, batch=self.batch, **timings,
        )


async def wait_written(written: concurrent.futures.Future) -> None:
    """Wait for the row's write: normally milliseconds; a locked database must not hold the
    response's end for longer than USAGE_WRITE_WAIT_S (the ledger retries on its own)."""
    with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(written)), settings.USAGE_WRITE_WAIT_S)


async def settle_reservation(gen_id: str, tenant: Tenant, taken: quota.TokenAdmission, used: int) -> None:
    """Settle tokens/min and the monthly budget; if Redis refuses, keep trying in the background
    (a stalled Redis fails the first try within its admission deadline, not the response)."""
    done: set[str] = set()
    try:
        await asyncio.to_thread(quota.settle, tenant, taken, used, done)
        return
    except Exception as exc:
        log.warning("generation %s: could not settle its reservations (%s); retrying", gen_id, exc)

    async def retry() -> None:
        for attempt in range(SETTLE_RETRIES):
            await asyncio.sleep(SETTLE_RETRY_S * (attempt + 1))
            try:
                await asyncio.to_thread(quota.settle, tenant, taken, used, done)
                return
            except Exception as exc:
                last = exc
        # The budget hold lapses by itself; the monthly counter misses these tokens until it is
        # next rebuilt from the usage rows, which have them.
        log.error("generation %s: gave up settling %d tokens: %s", gen_id, used, last)

    task = asyncio.create_task(retry())
    _settling.add(task)
    task.add_done_callback(_settling.discard)
