"""Channels consumers that never wait on asgiref's one shared thread between messages.

Channels 4.2+ (`AsyncConsumer.dispatch`) closes stale database connections before every
message a consumer handles, through `sync_to_async(close_old_connections)`: thread-sensitive,
so every message of every connection of the process queues on one thread. The tenant-facing
consumers do no database work on that thread (tenants.admission's pool holds its own
connections, the usage ledger has its writer), so the hop guards nothing and couples every
tenant's stream to whatever else that thread is doing.
"""
from __future__ import annotations

from channels.consumer import get_handler_name


class NoSharedThreadDispatch:
    """Mix in before a Channels consumer class: dispatch a message straight to its handler."""

    async def dispatch(self, message: dict) -> None:
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)
