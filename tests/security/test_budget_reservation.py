"""A monthly budget is never exceeded by more than one request's actual use (issue 24 item 5:
"The monthly budget is checked before and charged after: 8 parallel requests under a
100-token budget used 1,856 tokens").

Admission reserves the most a request can use against the budget and the end settles what
it used, so while one request holds what is left, the others are refused (429
`budget_reserved`, retry in seconds) and, once the budget is spent, refused for the month
(429 `insufficient_quota`).
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from tests.live import LiveServer
from tests.serving.rawsse import OPENAI_CHAT, Event, SocketStream, chat_body

TENANT = "budget"  # monthly_token_budget 100 (tests/isolation_env.py)
BUDGET = 100
MAX_TOKENS = 200


def _stream(live: LiveServer) -> tuple[int, dict | None, int | None]:
    """(status, error or None, total tokens from the usage chunk) of one streamed chat read to its end."""
    body = chat_body(MAX_TOKENS, stream=True, stream_options={"include_usage": True})
    stream = SocketStream(live.url, OPENAI_CHAT, live.keys[TENANT], body, timeout=300)
    try:
        total = None
        while (item := stream.next()) is not None:
            if isinstance(item, Event) and item.data not in ("[DONE]",):
                data = item.json()
                if data.get("usage"):
                    total = data["usage"]["total_tokens"]
        status = stream.wire.status
        error = json.loads(stream.wire.body)["error"] if status != 200 else None
        return status, error, total
    finally:
        stream.close()


def _billed(live: LiveServer, rows: int) -> list[int]:
    """The tenant's usage rows' totals, once `rows` of them are closed (or 30 s passed)."""
    return live.django(f"""
        import time
        from tenants.models import UsageRecord
        deadline = time.monotonic() + 30
        while True:
            records = list(UsageRecord.objects.filter(tenant_id={live.tenant_ids[TENANT]}, closed=True))
            if len(records) >= {rows} or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        result = [r.prompt_tokens + r.completion_tokens for r in records]
    """)


def test_parallel_requests_cannot_together_overspend_the_budget(hostile_live: LiveServer):
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda _: _stream(hostile_live), range(8)))
    served = [total for status, _, total in outcomes if status == 200]
    refusals = [error for status, error, _ in outcomes if status != 200]
    assert served, outcomes
    assert all(error["code"] in ("budget_reserved", "insufficient_quota") for error in refusals), refusals

    billed = _billed(hostile_live, len(served))
    assert sorted(billed) == sorted(served), "every admitted request is billed what its usage said"
    assert sum(billed) <= BUDGET + max(billed), f"{sum(billed)} tokens billed under a budget of {BUDGET}"

    # Spent: the next request is refused for the rest of the month.
    status, error, _ = _stream(hostile_live)
    assert status == 429 and error["code"] == "insufficient_quota", error
