"""Limits as an API client sees them: status, headers and body of every refusal."""
import asyncio
import time
from datetime import datetime, timezone as dt_timezone

import pytest
import redis

from inference import gate
from inference.protocol import GenerationRequest
from tenants import actions, errors, quota

pytestmark = pytest.mark.django_db


def test_every_authenticated_request_counts_and_the_refusal_says_when_to_retry(make_tier, make_tenant, client_for):
    tenant, issued = make_tenant("acme", make_tier(requests_per_minute=2, tokens_per_minute=1000))
    client = client_for(issued.plaintext)
    started = time.monotonic()
    first, second = client.get("/v1/models"), client.get("/v1/models")
    assert (first.status_code, second.status_code) == (200, 200)
    assert first["x-ratelimit-limit-requests"] == "2"
    assert (first["x-ratelimit-remaining-requests"], second["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert first["x-ratelimit-limit-tokens"] == "1000"
    assert first["x-ratelimit-remaining-tokens"] == "1000"

    refused = client.get("/v1/models")
    assert refused.status_code == 429
    # Two requests against 2/min: the next slot opens 30 s after the first one.
    assert 30 - (time.monotonic() - started) - 1 <= int(refused["Retry-After"]) <= 30
    assert refused["x-ratelimit-limit-requests"] == "2"
    assert refused["x-ratelimit-remaining-requests"] == "0"
    assert refused["x-ratelimit-reset-requests"] in ("59s", "1m0s")
    assert refused["x-ratelimit-limit-tokens"] == "1000"
    assert refused["x-ratelimit-remaining-tokens"] == "1000"
    assert refused["x-ratelimit-reset-tokens"] == "0ms"
    body = refused.json()
    assert set(body) == {"error"}
    assert body["error"]["type"] == "requests"
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert body["error"]["param"] is None
    assert "requests per minute" in body["error"]["message"]


def test_a_refused_request_is_not_counted_as_admitted_and_a_tier_change_applies_at_once(
    make_tier, make_tenant, client_for
):
    tenant, issued = make_tenant("acme", make_tier(requests_per_minute=1))
    client = client_for(issued.plaintext)
    assert client.get("/v1/models").status_code == 200
    assert client.get("/v1/models").status_code == 429
    actions.change_tier(tenant, make_tier("bigger", requests_per_minute=600))
    assert client.get("/v1/models").status_code == 200


def test_an_unreachable_redis_leaves_requests_per_minute_to_this_process(make_tier, make_tenant, client_for, settings):
    _, issued = make_tenant("acme", make_tier(requests_per_minute=2))
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    client = client_for(issued.plaintext)
    assert [client.get("/v1/models").status_code for _ in range(2)] == [200, 200]
    refused = client.get("/v1/models")
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"
    assert refused["x-ratelimit-remaining-requests"] == "0"


def test_an_unreachable_redis_reads_a_budget_this_process_never_saw_from_the_usage_records(
        make_tier, make_tenant, settings):
    tier = make_tier(monthly_token_budget=1000)
    spent, _ = make_tenant("spent", tier)
    fresh, _ = make_tenant("fresh", tier)
    actions.record_usage(spent, lane=1, prompt_tokens=400, completion_tokens=600)
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    quota.forget_local_limits()
    assert quota.admit_tokens(fresh, prompt_tokens=10, max_tokens=10).budget is not None
    with pytest.raises(errors.ApiError) as refused:
        quota.admit_tokens(spent, prompt_tokens=10, max_tokens=10)
    assert (refused.value.status, refused.value.code) == (429, "insufficient_quota")


def test_with_no_share_an_unreachable_redis_refuses_a_budget_with_503(make_tenant, settings):
    tenant, _ = make_tenant("acme")
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    settings.LIMITS_FALLBACK_SHARE = 0
    with pytest.raises(redis.RedisError):  # the admission pool answers it as a 503 (tests/reliability)
        quota.admit_tokens(tenant, prompt_tokens=10, max_tokens=10)


def test_with_no_share_for_one_process_an_unreachable_redis_refuses_with_503(make_tenant, client_for, settings):
    _, issued = make_tenant("acme")
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    settings.LIMITS_FALLBACK_SHARE = 0
    response = client_for(issued.plaintext).get("/v1/models")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "service_unavailable"
    assert response["Retry-After"] == "1"


def test_token_admission_checks_max_tokens_tokens_per_minute_and_the_monthly_budget(make_tier, make_tenant):
    tenant, _ = make_tenant("acme", make_tier(tokens_per_minute=100, max_tokens_per_request=50,
                                              monthly_token_budget=120))
    with pytest.raises(errors.ApiError) as too_long:
        quota.admit_tokens(tenant, prompt_tokens=10, max_tokens=51)
    assert (too_long.value.status, too_long.value.param) == (400, "max_tokens")

    assert quota.admit_tokens(tenant, prompt_tokens=30, max_tokens=40).decision.bucket("tokens").remaining == 30
    with pytest.raises(errors.ApiError) as per_minute:
        quota.admit_tokens(tenant, prompt_tokens=1, max_tokens=40)
    assert (per_minute.value.status, per_minute.value.type) == (429, "tokens")
    assert 0 < int(per_minute.value.headers["Retry-After"]) <= 7

    actions.record_usage(tenant, lane=1, prompt_tokens=30, completion_tokens=95)
    assert quota.monthly_tokens_used(tenant) == 125
    with pytest.raises(errors.ApiError) as budget:
        quota.check_monthly_budget(tenant)
    assert (budget.value.status, budget.value.code) == (429, "insufficient_quota")


def test_monthly_usage_is_rebuilt_from_the_database_when_redis_lost_it(make_tenant, redis):
    tenant, _ = make_tenant("acme")
    actions.record_usage(tenant, lane=1, prompt_tokens=10, completion_tokens=20)
    actions.record_usage(tenant, lane=1, prompt_tokens=1, completion_tokens=2)
    redis.flushall()
    assert quota.monthly_tokens_used(tenant) == 33
    actions.record_usage(tenant, lane=1, prompt_tokens=0, completion_tokens=7)
    assert quota.monthly_tokens_used(tenant) == 40


def test_the_monthly_budget_refusal_waits_until_the_next_month(make_tier, make_tenant):
    tenant, _ = make_tenant("acme", make_tier(monthly_token_budget=10))
    late_january = datetime(2030, 1, 31, 23, 0, tzinfo=dt_timezone.utc)
    assert quota.monthly_tokens_used(tenant, late_january) == 0
    quota.charge_monthly_tokens(tenant, 10, late_january)
    with pytest.raises(errors.ApiError) as refused:
        quota.check_monthly_budget(tenant, late_january)
    assert refused.value.headers["Retry-After"] == "3600"


def test_concurrent_streams_are_leased_per_tenant(make_tier, make_tenant):
    tenant, _ = make_tenant("acme", make_tier(concurrent_streams=1))
    lease = quota.open_stream(tenant)
    with pytest.raises(errors.ApiError) as refused:
        quota.open_stream(tenant)
    assert (refused.value.status, refused.value.type) == (429, "streams")
    quota.close_stream(lease)
    quota.close_stream(quota.open_stream(tenant))


def test_each_choice_of_a_generation_takes_a_slot_all_or_none(make_tier, make_tenant):
    """Issue 24 item 4: `n` counted as one slot, so 8 streams of n=16 filled the engine."""
    tenant, _ = make_tenant("acme", make_tier(concurrent_streams=8))
    six = quota.open_stream(tenant, count=6)
    assert quota.limiter().leases_held(f"tenant:{tenant.pk}", "streams") == 6
    with pytest.raises(errors.ApiError) as refused:
        quota.open_stream(tenant, count=3)  # 6 + 3 > 8: none of the three is taken
    assert (refused.value.status, refused.value.type) == (429, "streams")
    assert quota.limiter().leases_held(f"tenant:{tenant.pk}", "streams") == 6
    two = quota.open_stream(tenant, count=2)
    quota.close_stream(six)
    assert quota.limiter().leases_held(f"tenant:{tenant.pk}", "streams") == 2
    quota.close_stream(two)
    with pytest.raises(errors.ApiError) as never:
        quota.open_stream(tenant, count=9)  # more choices than the tier's slots: say so, do not wait
    assert (never.value.status, never.value.code, never.value.param) == (400, "too_many_choices", "n")


def test_parallel_generations_cannot_together_overspend_the_monthly_budget(make_tier, make_tenant):
    """Issue 24 item 5: checked before and charged after, 8 parallel requests under a
    100-token budget used 1,856 tokens. Each admission now holds its most against the budget."""
    tenant, _ = make_tenant("acme", make_tier(monthly_token_budget=100, tokens_per_minute=100_000))
    first = quota.admit_tokens(tenant, prompt_tokens=20, max_tokens=200)
    with pytest.raises(errors.ApiError) as held:
        quota.admit_tokens(tenant, prompt_tokens=20, max_tokens=200)
    assert (held.value.status, held.value.code) == (429, "budget_reserved")
    assert held.value.headers["Retry-After"] == str(errors.BUDGET_HELD_RETRY_S)
    quota.settle(tenant, first, used=60)  # it stopped early: 60 of its 220 tokens
    assert quota.monthly_tokens_used(tenant) == 60
    second = quota.admit_tokens(tenant, prompt_tokens=20, max_tokens=200)  # 40 left: admitted
    quota.settle(tenant, second, used=220)
    # Over by at most the one request that was admitted while some budget was left.
    assert quota.monthly_tokens_used(tenant) == 280
    with pytest.raises(errors.ApiError) as spent:
        quota.admit_tokens(tenant, prompt_tokens=1, max_tokens=1)
    assert (spent.value.status, spent.value.code) == (429, "insufficient_quota")


def test_a_client_gone_while_its_tokens_are_reserved_leaves_a_reservation_its_settlement_finds(
        make_tier, make_tenant, redis, settings):
    """Cancelled (its client disconnected) while the admission pool's thread reserved its tokens,
    a request must still hold what the thread took, for its settlement to give back: else the
    tenant's budget stayed held until the hold's TTL and its tokens/min charged for nothing."""
    settings.LIMITS_REDIS_TIMEOUT_S = 5  # the paused call waits for Redis instead of deciding alone
    tenant, _ = make_tenant("acme", make_tier(monthly_token_budget=200, tokens_per_minute=100_000))
    holds = gate.Holds("gen-gone", tenant)
    request = GenerationRequest(kind="chat", model=None, messages=({"role": "user", "content": "Hi"},), max_tokens=200)

    async def client_gone() -> None:
        redis.client_pause(600)  # the reservation's script waits in its thread meanwhile
        reserving = asyncio.create_task(holds.reserve_tokens(request, 20, 200, 1, metered=True))
        await asyncio.sleep(0.2)
        reserving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reserving

    asyncio.run(client_gone())
    assert holds.tokens is not None, "the reservation the thread made was lost with the request"
    with pytest.raises(errors.ApiError) as held:  # it holds the whole budget until settled
        quota.admit_tokens(tenant, prompt_tokens=20, max_tokens=200)
    assert held.value.code == "budget_reserved"
    quota.settle(tenant, holds.tokens, used=0)
    quota.settle(tenant, quota.admit_tokens(tenant, prompt_tokens=20, max_tokens=200), used=0)
    assert quota.monthly_tokens_used(tenant) == 0


def test_a_reservation_whose_holder_died_lapses_and_gives_the_budget_back(make_tier, make_tenant, settings):
    settings.STREAM_LEASE_TTL_S = 0.3
    tenant, _ = make_tenant("acme", make_tier(monthly_token_budget=100))
    quota.admit_unmetered_tokens(tenant, prompt_tokens=10, max_tokens=200)  # never settled: its process died
    with pytest.raises(errors.ApiError):
        quota.admit_unmetered_tokens(tenant, prompt_tokens=10, max_tokens=200)
    time.sleep(0.4)
    quota.settle_budget(tenant, quota.admit_unmetered_tokens(tenant, prompt_tokens=10, max_tokens=20).budget, 30)
    assert quota.monthly_tokens_used(tenant) == 30


@pytest.mark.parametrize("field, call", [
    ("requests_per_minute", lambda tenant: quota.admit_request(tenant)),
    ("tokens_per_minute", lambda tenant: quota.admit_tokens(tenant, prompt_tokens=1, max_tokens=1)),
    ("concurrent_streams", lambda tenant: quota.open_stream(tenant)),
])
def test_a_limit_set_to_zero_refuses_clearly_instead_of_failing(make_tier, make_tenant, field, call):
    """Issue 24 item 10: a limit set to 0 gave a 500."""
    tenant, _ = make_tenant("acme", make_tier(**{field: 0}))
    with pytest.raises(errors.ApiError) as refused:
        call(tenant)
    assert (refused.value.status, refused.value.code) == (403, "limit_is_zero")
    assert field in refused.value.message
    decision, _ = quota.minute_state(tenant)  # the console's read of the buckets works too
    assert decision.bucket("requests") is not None


def test_a_limit_set_to_zero_answers_the_api_client_in_the_openai_shape(make_tier, make_tenant, client_for):
    _, issued = make_tenant("acme", make_tier(requests_per_minute=0))
    response = client_for(issued.plaintext).get("/v1/models")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "limit_is_zero"


@pytest.mark.parametrize(
    "seconds, text", [(0.0, "0ms"), (0.12, "120ms"), (1.0, "1s"), (59.2, "1m0s"), (360, "6m0s"), (3723, "1h2m3s")]
)
def test_reset_durations_use_openais_format(seconds, text):
    assert errors.format_reset(seconds) == text
