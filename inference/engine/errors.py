"""Typed errors the engine raises at its boundary.

Each carries the request parameter at fault so the API can answer in the OpenAI
error shape without guessing.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request can never be served as given (bad parameter, prompt too long...)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ConfigError(EngineError, ValueError):
    """The engine cannot be built as configured (an unknown kernels choice, a device this
    machine lacks, a model it cannot read...). A startup failure for the operator, never a
    tenant's bad request: it is not an InvalidRequestError, which the API answers with 400.
    A ValueError too, as the plain bad values it replaces were."""

    def __init__(self, message: str, setting: str | None = None):
        super().__init__(message)
        self.message = message
        self.setting = setting


class DuplicateRequestError(InvalidRequestError):
    def __init__(self, request_id: str):
        super().__init__(f"request id {request_id!r} is already in flight", param="request_id", code="duplicate_request_id")


class QueueFullError(EngineError):
    """The request's lane cannot take it now: too many waiting, or the wait would exceed
    the lane's queue timeout. Retry after `retry_after_s` (the API answers 429)."""

    def __init__(self, message: str, retry_after_s: float, lane: int):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.lane = lane
