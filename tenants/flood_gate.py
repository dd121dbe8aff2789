"""A tenant's generation requests past its in-flight bound, and requests whose key cannot
authenticate (none, malformed, a wrong secret for a known prefix), refused before daphne builds
them an application.

`tenants.middleware` refuses a request of a tenant that already has as many generation requests
in flight in this process as could run or wait for a slot (its tier's concurrent generations
plus SLOT_WAITERS_PER_TENANT), on the event loop, with no thread or Redis call. Answered there,
each refusal of a 400-request burst still paid for daphne's request processing, an ASGI
application instance, the middleware stack and the response messages, and another tenant's
request that arrived among them waited for all of it. This hook gives the same answer from the
request's headers once daphne has read it, writing the response on the connection itself.

It also counts a request it lets through in flight at once. Counted only when its application
first ran, a burst's requests (all read in one pass of the reactor) passed a bound nobody had
been counted against yet, and 2 of 3 refusals of a 400-request burst still went through the
application; 1 of 17 now. The middleware counts requests of keys not known yet itself.
"""
from __future__ import annotations

import uuid

from config import intake
from config.raw_errors import response_bytes
from config.request_ids import _SANE
from inference import http_metrics, refusals
from tenants import middleware

# Request path -> its route, as /metrics labels it (inference.routing).
GATED = {"/v1/chat/completions": "v1/chat/completions", "/v1/completions": "v1/completions",
         "/api/v1/inference/chat": "api/v1/inference/chat"}


def _response(error, request_id: str) -> bytes:
    return response_bytes(error.status, error.body(),
                          {**error.headers, "X-Request-Id": request_id, "openai-processing-ms": "0"})


def _refuse(request, path: str, error, tenant_id: str | None) -> None:
    header = request.getHeader(b"authorization")
    given = request.getHeader(b"x-request-id")
    request_id = given.decode("ascii") if given and _SANE.fullmatch(given) else f"req_{uuid.uuid4().hex}"
    http_metrics.count_response(GATED[path], error.status, tenant_id)
    http_metrics.count_refusal(error)
    refusals.note(tenant_id=tenant_id, key=refusals.key_prefix(header.decode("latin-1") if header else None),
                  endpoint=path, status=error.status, error=error.body()["error"])
    transport = request.channel.transport if request.channel is not None else None
    if transport is not None:
        transport.write(_response(error, request_id))
        transport.loseConnection()


def install() -> None:
    """Hook daphne's request class (once per process)."""
    from daphne.http_protocol import WebRequest

    if getattr(WebRequest, "_flood_gate_installed", False):
        return
    process = WebRequest.process

    def gated_process(self):
        path = self.path.split(b"?", 1)[0].rstrip(b"/").decode("latin-1")
        if self.method != b"POST" or path not in GATED:
            return process(self)
        intake.settle(self.channel)  # bounded here from now on, not by its caller's intake
        header = self.getHeader(b"authorization")
        caller, refusal = middleware.gate(header.decode("latin-1") if header else None)
        if refusal is not None:
            return _refuse(self, path, *refusal)
        if caller is None:
            return process(self)
        # daphne creates the application (and its task, which copies this context) before
        # process() returns; the count ends with that task, even one cancelled before it ran.
        token = middleware.counted_at_gate.set(True)
        try:
            result = process(self)
        finally:
            middleware.counted_at_gate.reset(token)
            task = self.server.connections.get(self, {}).get("application_instance") if self.server else None
            if task is None:  # refused by daphne (a bad header), or the client already gone
                middleware.leave(caller)
            else:
                task.add_done_callback(lambda _task: middleware.leave(caller))
        return result

    WebRequest.process = gated_process
    WebRequest._flood_gate_installed = True
