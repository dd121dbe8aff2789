"""Request bodies whose checking compiles a grammar, parsed off the event loop.

Checking a `response_format` JSON schema or a tool's parameters (`inference.protocol`) is
llguidance compiling it: ~30 ms for a 55 KB schema on a 2-core Zen 3 (64 KiB is
STRUCTURED_MAX_SCHEMA_BYTES), and a request may carry many tools. On the event loop that time
stopped every stream of every tenant of the process. Such a body is parsed on a pool of its
own instead (llguidance releases the GIL while it compiles: the loop's ticks kept under 14 ms
beside it), and one tenant's are parsed one at a time, so its large schemas queue behind each
other rather than in front of everyone else's. A body with neither is parsed where it is.
Not on the admission pool (tenants.admission): its share of four calls per tenant is for
waiting on the database and Redis; four of a tenant's checks at once took both cores, and
another tenant's first token came after all sixteen of them (tests/security/test_grammar_checks.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_pool = ThreadPoolExecutor(2, thread_name_prefix="grammar-check")


class _Gate:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


_gates: dict[object, _Gate] = {}


def compiles_grammar(data: object) -> bool:
    """Whether parsing `data` (a request body) compiles a grammar to check it."""
    if not isinstance(data, dict):
        return False
    fmt = data.get("response_format")
    return (isinstance(fmt, dict) and fmt.get("type") == "json_schema") or bool(data.get("tools"))


async def parse(parse_fn: Callable[[dict], T], data: dict, caller: object) -> T:
    """`parse_fn(data)`: off the event loop, one at a time per `caller`, if it compiles a grammar."""
    if not compiles_grammar(data):
        return parse_fn(data)
    gate = _gates.get(caller)
    if gate is None:
        gate = _gates[caller] = _Gate()
    gate.users += 1
    try:
        async with gate.lock:
            work = _pool.submit(parse_fn, data)
            done = asyncio.wrap_future(work)
            try:
                return await asyncio.shield(done)
            except asyncio.CancelledError:
                # The client left. A check already compiling runs on in its thread, and the
                # tenant's turn ends when it does: released at once, a tenant that sends and
                # leaves over and over kept every thread of the pool compiling its schemas.
                if not work.cancel():
                    await asyncio.wait([done])
                    if not done.cancelled():
                        done.exception()  # retrieved: nobody is left to be told
                raise
    finally:
        gate.users -= 1
        if gate.users == 0 and _gates.get(caller) is gate:
            del _gates[caller]
