"""An open WebSocket keeps no rights its key has lost (issue 24 item 2: "A revoked key, and a
deactivated tenant, keep generating on a WebSocket opened before the revoke; tier changes
never reach open sockets").

The socket re-reads its key every WS_AUTH_RECHECK_S (1 s on this server, 5 s by default) and
before a `start` whose last read is older: revoked or expired keys and deactivated tenants
are closed with 4401 (their generations aborted and billed), and a `start` runs under the
tier as it is now.
"""
from __future__ import annotations

import asyncio

import pytest

from tests.live import LiveServer
from tests.wsclient import bearer, connect, first_token, run, start, until_closed, until_end, ws_url

RECHECK_S = 1.0  # WS_AUTH_RECHECK_S in tests/isolation_env.py
CLOSE_WITHIN_S = RECHECK_S + 10  # one re-check, with room for a busy 2-core machine


def _usage(live: LiveServer, tenant: str) -> list[dict]:
    return live.django(f"""
        import time
        from tenants.models import UsageRecord
        deadline = time.monotonic() + 30
        while not (rows := list(UsageRecord.objects.filter(tenant_id={live.tenant_ids[tenant]}, closed=True)
                                .values("completion_tokens", "finish_reason"))) and time.monotonic() < deadline:
            time.sleep(0.1)
        result = rows
    """)


@pytest.mark.parametrize("tenant, lose_rights, message", [
    ("reauth-revoked", "actions.revoke_key(ApiKey.objects.get(tenant_id=TENANT))", "revoked"),
    ("reauth-inactive", "Tenant.objects.filter(pk=TENANT).update(is_active=False)", "inactive"),
])
def test_a_socket_whose_key_loses_its_rights_is_closed_and_its_generation_billed(
        hostile_live: LiveServer, tenant: str, lose_rights: str, message: str):
    live = hostile_live

    async def scenario():
        async with connect(ws_url(live), additional_headers=bearer(live.keys[tenant])) as ws:
            await ws.send(start("long", 500))
            await first_token(ws, "long")
            live.django(f"""
                from tenants import actions
                from tenants.models import ApiKey, Tenant
                TENANT = {live.tenant_ids[tenant]}
                {lose_rights}
                result = True
            """)
            return await until_closed(ws, CLOSE_WITHIN_S)

    messages, code = run(scenario())
    assert code == 4401
    assert messages[-1]["type"] == "error" and messages[-1]["error"]["code"] == "invalid_api_key"
    assert message in messages[-1]["error"]["message"]
    rows = _usage(live, tenant)
    assert len(rows) == 1 and 0 < rows[0]["completion_tokens"] < 500, rows  # cut short, and billed


def test_a_tier_change_applies_to_the_next_start_on_an_open_socket(hostile_live: LiveServer):
    live = hostile_live

    def set_max_tokens(value: int) -> None:
        live.django(f"""
            from tenants.models import QuotaTier
            QuotaTier.objects.filter(name="reauth-tier").update(max_tokens_per_request={value})
            result = True
        """)

    async def scenario():
        async with connect(ws_url(live), additional_headers=bearer(live.keys["reauth-tier"])) as ws:
            await ws.send(start("before", 20))
            before = await until_end(ws, "before")
            set_max_tokens(10)
            await asyncio.sleep(RECHECK_S + 0.2)  # the socket's last read of the tier may be this old
            try:
                await ws.send(start("after", 20))
                after = await until_end(ws, "after")
            finally:
                set_max_tokens(512)
            return before, after

    before, after = run(scenario())
    assert before["type"] == "done", before
    assert after["type"] == "error" and after["error"]["code"] == "max_tokens_exceeded", after
