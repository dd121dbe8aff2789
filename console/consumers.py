"""The engine page's live feed: /ws/console/engine pushes a snapshot twice a second.

Staff only: the socket is mounted behind Channels' session authentication (config.asgi);
anyone else is closed with 4403 before a snapshot is sent. The snapshot comes from this
process's engine host directly, not through the channel layer: the console shows the
engine of the daphne process it is connected to, and every replica's last report to the
fleet (inference.fleet) beside it.
"""
from __future__ import annotations

import asyncio
import json
import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from console import queries
from inference import fleet
from inference.fleet import local_stats

PUSH_INTERVAL_S = 0.5
LATENCY_REFRESH_S = 1.0  # the usage-record query runs at most this often, however many pages are open
FLEET_REFRESH_S = 1.0  # and the fleet's read from Redis
FLEET_FIELDS = ("requests_running", "requests_in_flight", "tokens_per_s", "kv_blocks_used", "kv_blocks_total")
FORBIDDEN = 4403

_latency: dict = {"at": float("-inf"), "value": None}


async def latency_by_lane() -> dict:
    if time.monotonic() - _latency["at"] >= LATENCY_REFRESH_S:
        _latency["at"] = time.monotonic()  # claimed before the query, so concurrent sockets do not repeat it
        _latency["value"] = await database_sync_to_async(queries.latency_by_lane)()
    return _latency["value"]


_fleet: dict = {"at": float("-inf"), "value": None}


def _replicas() -> list[dict] | None:
    """Each replica's row for the page, or None while Redis does not answer."""
    try:
        reports = fleet.replicas()
    except Exception:  # Redis away: the page says so; the snapshot goes on
        return None
    return [{"id": r["id"], "url": r["url"], "state": r["state"], "last_seen": r["last_seen"],
             **{name: r["stats"].get(name) for name in FLEET_FIELDS}} for r in reports]


async def replicas() -> list[dict] | None:
    if time.monotonic() - _fleet["at"] >= FLEET_REFRESH_S:
        _fleet["at"] = time.monotonic()
        _fleet["value"] = await asyncio.to_thread(_replicas)
    return _fleet["value"]


async def snapshot() -> dict:
    return {"at": time.time(), **local_stats(), "latency": await latency_by_lane(), "fleet": await replicas()}


class EngineConsumer(AsyncWebsocketConsumer):
    channel_layer_alias = "console-uses-no-channel-layer"

    async def connect(self) -> None:
        self._pusher: asyncio.Task | None = None
        user = self.scope.get("user")
        # Accepted first so the client sees why: a close before accept is a bare HTTP 403.
        await self.accept()
        if not (user is not None and user.is_authenticated and user.is_active and user.is_staff):
            await self.close(code=FORBIDDEN)
            return
        self._pusher = asyncio.create_task(self._push())

    async def _push(self) -> None:
        while True:
            await self.send(text_data=json.dumps(await snapshot()))
            await asyncio.sleep(PUSH_INTERVAL_S)

    async def disconnect(self, code: int) -> None:
        if self._pusher is not None:
            self._pusher.cancel()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        pass  # the feed is one-way
