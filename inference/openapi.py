"""The OpenAPI schema (drf-spectacular) of the whole HTTP API, served at /api/schema/.

The generation endpoints are Channels consumers (they stream), which drf-spectacular
cannot see. They are described here by DRF views that exist only in `urlpatterns` of
this module, which is the urlconf the schema view reads; the real router never routes to
them. Their request serializers mirror `inference.protocol`, which stays the one place
that validates: the tests fuzz the live server from this schema to keep them in step.
"""
from __future__ import annotations

from django.conf import settings
from django.urls import include, path
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field,
                                   inline_serializer)
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.views import APIView

from batches import views as batch_views
from inference import protocol
from inference.engine.api import LIMITS, MAX_N
from inference.views import Detokenize, ModelDetail, ModelList, Tokenize, Version
from tenants import urls as tenant_urls, views as tenant_views


# --- requests ------------------------------------------------------------------------------
# The request bodies are closed (additionalProperties: false; see `close_request_bodies`):
# `protocol` refuses unknown fields, as OpenAI does.

# Numeric ranges come from the engine's table (`LIMITS`), as `protocol` checks them. The request
# bounds are settings, read here (at import, like the schema) under the same names `protocol` reads.


def _bounded(name: str, cap: int | None = None, **kwargs) -> serializers.Field:
    """An optional numeric field with `LIMITS[name]` as its range, its top lowered to `cap` where a
    request bound over several fields already binds the field alone (n x max_tokens with n = 1).
    An open low end is marked by `close_request_bodies`: OpenAPI 3.0 states it apart from `minimum`."""
    limit = LIMITS[name]
    field = serializers.IntegerField if limit.integer else serializers.FloatField
    high = limit.high if cap is None else min(limit.high, cap)
    return field(required=False, min_value=limit.low, max_value=high, **kwargs)

# Bounds over several fields, which JSON Schema cannot state: published on each request body as
# `x-request-bounds` (see `close_request_bodies`) and in the fields' descriptions.
REQUEST_BOUNDS = {
    "max_request_tokens": settings.MAX_REQUEST_TOKENS,  # n x max_tokens (x prompts)
    "max_request_logprobs": settings.MAX_REQUEST_LOGPROBS,  # n x top_logprobs / logprobs (x prompts)
    "max_prompt_chars": settings.MAX_PROMPT_CHARS,  # all messages' or text prompts' characters
    "max_choices": settings.MAX_CHOICES,  # prompts x n
}

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


@extend_schema_field({"oneOf": [
    {"type": "string", "maxLength": settings.MAX_PROMPT_CHARS},
    {"type": "array", "items": {"type": "object", "additionalProperties": False, "required": ["type", "text"],
                                "properties": {"type": {"type": "string", "enum": ["text"]},
                                               "text": {"type": "string", "maxLength": settings.MAX_PROMPT_CHARS}}}},
]})
class ContentField(serializers.JSONField):
    """A message's content: a string, or an array of text parts."""


@extend_schema_field({"oneOf": [
    {"type": "string", "minLength": 1, "maxLength": settings.MAX_STOP_CHARS},
    {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": settings.MAX_STOP_CHARS},
     "maxItems": settings.MAX_STOP},
]})
class StopField(serializers.JSONField):
    """`stop`: one string or up to MAX_STOP strings of at most MAX_STOP_CHARS characters."""


@extend_schema_field({"oneOf": [
    {"type": "string", "minLength": 1, "maxLength": settings.MAX_PROMPT_CHARS},
    {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": settings.MAX_PROMPT_CHARS},
     "minItems": 1, "maxItems": protocol.MAX_PROMPTS},
    _TOKEN_IDS,
    {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": protocol.MAX_PROMPTS},
]})
class PromptField(serializers.JSONField):
    """`prompt`: a string, strings, token ids, or arrays of token ids."""


def _format(kind: str, **properties) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["type", *properties],
            "properties": {"type": {"type": "string", "enum": [kind]}, **properties}}


@extend_schema_field({"oneOf": [
    _format("text"),
    _format("json_object"),
    _format("json_schema", json_schema={
        "type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": f"^[A-Za-z0-9_-]{{1,{protocol.SCHEMA_NAME_CHARS}}}$"},
            "description": {"type": "string"},
            "schema": {"type": "object", "description": (
                f"A JSON schema of at most {settings.STRUCTURED_MAX_SCHEMA_BYTES} bytes as compact JSON; one the "
                "grammar engine cannot compile is a 400 naming what it cannot use.")},
            "strict": {"type": "boolean"},
        },
    }),
]})
class ResponseFormatField(serializers.JSONField):
    """`response_format`: text, any JSON object, or JSON that validates against a schema."""


class ChatMessage(serializers.Serializer):
    role = serializers.ChoiceField(choices=list(protocol.ROLES))
    content = ContentField(help_text="A string, or an array of text parts.")


class StreamOptions(serializers.Serializer):
    include_usage = serializers.BooleanField(required=False)


class _Sampling(serializers.Serializer):
    model = serializers.CharField(required=False, help_text="The served model's id (GET /v1/models).")
    n = _bounded("n", help_text="Each choice takes one of the tier's concurrent generations.")
    max_tokens = _bounded("max_tokens", settings.MAX_REQUEST_TOKENS, help_text=f"n x max_tokens (x prompts) at most {settings.MAX_REQUEST_TOKENS}.")
    temperature = _bounded("temperature")
    top_p = _bounded("top_p")
    top_k = _bounded("top_k")
    min_p = _bounded("min_p")
    presence_penalty = _bounded("presence_penalty")
    frequency_penalty = _bounded("frequency_penalty")
    repetition_penalty = _bounded("repetition_penalty")
    seed = _bounded("seed", help_text=f"Choice i samples with seed + i, so the top {MAX_N} seeds are refused.")
    stop = StopField(required=False, help_text=f"A string or up to {settings.MAX_STOP} strings, "
                                               f"each of at most {settings.MAX_STOP_CHARS} characters.")
    stop_token_ids = serializers.ListField(child=serializers.IntegerField(min_value=0), required=False,
                                           max_length=settings.MAX_STOP_TOKEN_IDS)
    ignore_eos = serializers.BooleanField(required=False)
    speculative = serializers.BooleanField(required=False, help_text=(
        "false: never decode this request speculatively (INFERENCE_SPECULATIVE). Speculation does not change "
        "what is sampled, only how fast; the engine leaves out requests with penalties, logprobs or a "
        "response_format itself."))
    stream = serializers.BooleanField(required=False)
    stream_options = StreamOptions(required=False)
    priority = _bounded("priority", help_text="Scheduling lane: 0 realtime, 1 near-realtime, 2 batch. "
                                              "Never better than the key's tier.")
    user = serializers.CharField(required=False)
    response_format = ResponseFormatField(required=False, help_text=(
        "Decoding is held to the format: the output parses unless max_tokens cuts it (finish_reason length); a "
        "grammar that reaches a dead end ends its choice with finish_reason error and the choice's `error`."))
    prompt_cache_key = serializers.CharField(
        required=False, min_length=1, max_length=protocol.MAX_PROMPT_CACHE_KEY_CHARS,
        help_text="OpenAI's cache routing key: accepted and checked; one replica serves every request, so it routes nothing yet.")


_FUNCTION_NAME = {"type": "string", "pattern": f"^[A-Za-z0-9_-]{{1,{protocol.SCHEMA_NAME_CHARS}}}$"}


@extend_schema_field({"type": "array", "maxItems": protocol.MAX_TOOLS, "items": {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {"type": {"type": "string", "enum": ["function"]}, "function": {
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": _FUNCTION_NAME, "description": {"type": "string"}, "strict": {"type": "boolean"},
                       "parameters": {"type": "object", "description": "A JSON schema for the arguments."}}}}}})
class ToolsField(serializers.JSONField):
    """`tools`: functions the model may call (Hermes format in the prompt, calls held to their schemas)."""


@extend_schema_field({"oneOf": [
    {"type": "string", "enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "additionalProperties": False,
     "properties": {"type": {"type": "string", "enum": ["function"]},
                    "function": {"type": "object", "required": ["name"], "additionalProperties": False,
                                 "properties": {"name": _FUNCTION_NAME}}}},
]})
class ToolChoiceField(serializers.JSONField):
    """`tool_choice`: none, auto (the default with tools), required, or one named function."""


class ChatCompletionRequest(_Sampling):
    messages = ChatMessage(many=True, help_text=(
        f"At least one message, not all of them empty; at most {settings.MAX_MESSAGES} messages "
        f"of {settings.MAX_PROMPT_CHARS} characters together."))
    max_completion_tokens = _bounded("max_completion_tokens", settings.MAX_REQUEST_TOKENS,
                                     help_text=f"n x max_completion_tokens at most {settings.MAX_REQUEST_TOKENS}.")
    logprobs = serializers.BooleanField(required=False)
    top_logprobs = _bounded("top_logprobs", settings.MAX_REQUEST_LOGPROBS, help_text=f"n x top_logprobs at most {settings.MAX_REQUEST_LOGPROBS}.")
    tools = ToolsField(required=False, help_text=(
        f"At most {protocol.MAX_TOOLS} functions of {settings.STRUCTURED_MAX_SCHEMA_BYTES} bytes together as JSON."))
    tool_choice = ToolChoiceField(required=False)
    parallel_tool_calls = serializers.BooleanField(required=False)


class CompletionRequest(_Sampling):
    prompt = PromptField(help_text=(
        "A string, an array of strings, an array of token ids, or an array of such arrays; text prompts of at "
        f"most {settings.MAX_PROMPT_CHARS} characters together, at most {settings.MAX_CHOICES} choices (prompts x n)."))
    logprobs = _bounded("logprobs", settings.MAX_REQUEST_LOGPROBS, help_text=f"n x prompts x logprobs at most {settings.MAX_REQUEST_LOGPROBS}.")
    echo = serializers.BooleanField(required=False)
    best_of = _bounded("best_of", help_text="Accepted only equal to n.")


# --- responses -----------------------------------------------------------------------------


class ErrorDetail(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    code = serializers.CharField(allow_null=True)


class Error(serializers.Serializer):
    error = ErrorDetail()


class PromptTokensDetails(serializers.Serializer):
    cached_tokens = serializers.IntegerField()


class UsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    prompt_tokens_details = PromptTokensDetails()


class ChoiceError(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField()
    code = serializers.ChoiceField(choices=["grammar_dead_end"])


class ToolCallFunction(serializers.Serializer):
    name = serializers.CharField()
    arguments = serializers.CharField(help_text="The arguments as a JSON object, in a string.")


class ToolCall(serializers.Serializer):
    id = serializers.CharField()
    type = serializers.ChoiceField(choices=["function"])
    function = ToolCallFunction()


class AssistantMessage(serializers.Serializer):
    role = serializers.ChoiceField(choices=["assistant"])
    content = serializers.CharField(allow_blank=True, allow_null=True)
    tool_calls = ToolCall(many=True, required=False)


class ChatChoice(serializers.Serializer):
    index = serializers.IntegerField()
    message = AssistantMessage()
    logprobs = serializers.JSONField(allow_null=True)
    finish_reason = serializers.ChoiceField(choices=["stop", "length", "tool_calls", "error"])
    error = ChoiceError(required=False, help_text="Only with finish_reason error: why structured output stopped.")


class ChatCompletion(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["chat.completion"])
    created = serializers.IntegerField()
    model = serializers.CharField()
    choices = ChatChoice(many=True)
    usage = UsageSerializer()


class CompletionChoice(serializers.Serializer):
    index = serializers.IntegerField()
    text = serializers.CharField(allow_blank=True)
    logprobs = serializers.JSONField(allow_null=True)
    finish_reason = serializers.ChoiceField(choices=["stop", "length", "error"])
    error = ChoiceError(required=False, help_text="Only with finish_reason error: why structured output stopped.")


class Completion(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["text_completion"])
    created = serializers.IntegerField()
    model = serializers.CharField()
    choices = CompletionChoice(many=True)
    usage = UsageSerializer()


def _errors(*statuses: int) -> dict:
    described = {
        400: "Invalid request (OpenAI error shape; `param` names the field)",
        401: "Missing or invalid API key",
        403: "Priority above the tier's lane, or a limit of the tier set to 0 (`limit_is_zero`)",
        404: "Unknown model",
        413: "Body over MAX_REQUEST_BYTES, or prompt text over MAX_PROMPT_CHARS",
        429: ("Rate limit, concurrent generations (each choice takes one of the tier's), monthly budget "
              "(used up, or `budget_reserved`: the rest is held by requests in flight) or lane capacity; "
              "see Retry-After"),
        503: "The model is loading, or the engine, the database or the limits store is unavailable; see Retry-After",
    }
    return {s: OpenApiResponse(Error, description=described[s]) for s in statuses}


_GENERATION_ERRORS = _errors(400, 401, 403, 404, 413, 429, 503)
_SLOW_READERS = (
    "A client that reads slower than the stream gets the pending deltas merged into fewer events; one that "
    "leaves STREAM_MAX_BUFFERED_BYTES unread and takes nothing for STREAM_STALL_S is disconnected, its "
    "generation aborted and billed for the tokens generated."
)
_SSE = OpenApiResponse(
    OpenApiTypes.STR,
    description="With `stream: true`: `text/event-stream` of `data: {chunk}` events, then `data: [DONE]`. "
                + _SLOW_READERS,
)


class _Documented(APIView):
    """Describes a consumer endpoint; never routed to (see the module docstring)."""


class ChatCompletionsDoc(_Documented):
    @extend_schema(
        operation_id="createChatCompletion",
        summary="Chat completion (JSON, or SSE with stream: true)",
        request=ChatCompletionRequest,
        responses={200: ChatCompletion, **_GENERATION_ERRORS},
        tags=["generation"],
    )
    def post(self, request):  # pragma: no cover - documentation only
        raise NotImplementedError


class CompletionsDoc(_Documented):
    @extend_schema(
        operation_id="createCompletion",
        summary="Text completion (JSON, or SSE with stream: true)",
        request=CompletionRequest,
        responses={200: Completion, **_GENERATION_ERRORS},
        tags=["generation"],
    )
    def post(self, request):  # pragma: no cover - documentation only
        raise NotImplementedError


class PlatformChatDoc(_Documented):
    @extend_schema(
        operation_id="streamChat",
        summary="The platform's chat stream: SSE events token, done, error",
        description=(
            "Takes the chat completions body. Answers `text/event-stream`: `event: token` with "
            "`{id, index, delta, tokens}` per delta, then `event: done` with `{status: \"[DONE]\", lane, "
            "finish_reasons, usage}`, or `event: error` with an OpenAI error. Every event has an `id:` "
            "counting from 0. Idle streams get a `: heartbeat` comment every SSE_HEARTBEAT_S. " + _SLOW_READERS
        ),
        parameters=[OpenApiParameter("X-Priority", int, OpenApiParameter.HEADER, enum=[0, 1, 2], required=False,
                                     description="Ask for a lane no better than the tier's.")],
        request=ChatCompletionRequest,
        responses={200: _SSE, **_GENERATION_ERRORS},
        tags=["generation"],
    )
    def post(self, request):  # pragma: no cover - documentation only
        raise NotImplementedError


class EngineStatsDoc(_Documented):
    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(
        operation_id="engineStats",
        summary="This replica's engine, live (staff session or Bearer OPERATOR_API_TOKEN)",
        responses={
            200: inline_serializer("EngineStats", {
                "state": serializers.CharField(),
                "kv_blocks_total": serializers.IntegerField(),
                "kv_blocks_free": serializers.IntegerField(),
                "kv_blocks_cached": serializers.IntegerField(),
                "kv_blocks_used": serializers.IntegerField(),
                "swap_blocks_used": serializers.IntegerField(),
                "requests_running": serializers.IntegerField(),
                "requests_swapped": serializers.IntegerField(),
                "requests_paused": serializers.IntegerField(
                    help_text="Generations paused in the engine because their clients stopped taking their tokens "
                              "(STREAM_PAUSE_AFTER_TOKENS); they keep their KV blocks and compute nothing."),
                "requests_waiting": serializers.DictField(child=serializers.IntegerField()),
                "preemptions": serializers.IntegerField(),
                "speculative": inline_serializer("SpeculativeStats", {
                    "passes": serializers.IntegerField(help_text="Sequence steps that verified a draft (INFERENCE_SPECULATIVE)."),
                    "draft_tokens": serializers.IntegerField(help_text="Draft tokens proposed."),
                    "accepted_tokens": serializers.IntegerField(help_text="Draft tokens the target accepted."),
                    "acceptance_rate": serializers.FloatField(help_text="accepted_tokens / draft_tokens."),
                    "tokens_per_pass": serializers.FloatField(
                        help_text="Tokens a speculating sequence's step yields: 1 + accepted_tokens / passes."),
                }),
                "streams": inline_serializer("StreamBuffers", {
                    "open": serializers.IntegerField(help_text="Open SSE and WebSocket streams."),
                    "buffered_bytes": serializers.IntegerField(
                        help_text="Bytes written to them that their clients have not taken (server and kernel buffers)."),
                    "buffered_bytes_max": serializers.IntegerField(help_text="The most one stream holds."),
                    "stalled_disconnected": serializers.IntegerField(
                        help_text="Clients disconnected since start for taking nothing for STREAM_STALL_S."),
                }),
            }),
            401: OpenApiResponse(Error), 403: OpenApiResponse(Error),
        },
        tags=["operators"],
    )
    def get(self, request):  # pragma: no cover - documentation only
        raise NotImplementedError


class EngineFleetDoc(_Documented):
    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(
        operation_id="engineFleet",
        summary="Every replica's engine and their totals (staff session or Bearer OPERATOR_API_TOKEN)",
        description=(
            "Each replica reports to Redis every FLEET_HEARTBEAT_S; one that misses three reports is gone from "
            "the list. `stats` has the keys of /api/v1/engine/stats; `totals` sums their numbers (lanes and "
            "the like key by key) and counts `replicas` and `replicas_ready`. 503 while Redis is away."
        ),
        responses={
            200: inline_serializer("EngineFleet", {
                "replicas": serializers.ListField(child=inline_serializer("Replica", {
                    "id": serializers.CharField(),
                    "host": serializers.CharField(),
                    "pid": serializers.IntegerField(),
                    "url": serializers.CharField(),
                    "state": serializers.CharField(),
                    "last_seen": serializers.FloatField(help_text="Unix time of its last report."),
                    "stats": serializers.DictField(help_text="As GET /api/v1/engine/stats."),
                })),
                "totals": serializers.DictField(),
            }),
            401: OpenApiResponse(Error), 403: OpenApiResponse(Error), 503: OpenApiResponse(Error),
        },
        tags=["operators"],
    )
    def get(self, request):  # pragma: no cover - documentation only
        raise NotImplementedError


def close_request_bodies(result: dict, generator, request, public) -> dict:
    """drf-spectacular postprocessing hook: what serializer fields cannot say. Request bodies
    take only the fields they list, a chat takes 1..MAX_MESSAGES messages, ranges open at their low
    end (top_p, repetition_penalty) get OpenAPI 3.0's boolean exclusiveMinimum, and the bounds
    over several fields (`x-request-bounds`)."""
    schemas = result.get("components", {}).get("schemas", {})
    schemas["StreamOptionsRequest"]["additionalProperties"] = False
    for name in ("ChatCompletionRequestRequest", "CompletionRequestRequest"):
        schemas[name]["additionalProperties"] = False
        schemas[name]["x-request-bounds"] = dict(REQUEST_BOUNDS)
        for field, schema in schemas[name]["properties"].items():
            if field in LIMITS and LIMITS[field].low_open:
                schema["exclusiveMinimum"] = True
    schemas["ChatCompletionRequestRequest"]["properties"]["messages"].update(minItems=1, maxItems=settings.MAX_MESSAGES)
    # WebSocket /ws/v1/chat has no OpenAPI operation; its bounds are published beside the others.
    result.setdefault("info", {})["x-websocket-bounds"] = {
        "path": "/ws/v1/chat",
        "max_message_bytes": settings.MAX_REQUEST_BYTES,
        "max_messages_per_second": settings.WS_MAX_FRAMES_PER_S,  # bursts of twice as many; past it: close 4429
        "max_sockets_per_key": settings.WS_MAX_SOCKETS_PER_KEY,  # past it: close 4429
        "auth_recheck_s": settings.WS_AUTH_RECHECK_S,  # a revoked key's socket closes 4401 within this
    }
    return result


# What any operation may answer besides its own: every error comes in the OpenAI shape.
_COMMON_ERRORS = {
    "400": "Invalid request: a query parameter or the body (`param` names it)",
    "401": "Missing or invalid key (or staff credentials for /api/v1/admin/ and the operator endpoints)",
    "403": "The key lacks the scope this needs (`missing_scope_<scope>`), a limit set to 0, or staff permission",
    "404": "No such object (model, file, batch, tenant, key or tier) for this caller",
    "406": "An Accept header this endpoint cannot answer",
    "429": "A rate limit (requests/min first); see Retry-After",
    "503": "The database, the limits store or the engine is unavailable; see Retry-After",
}
_BODY_ERRORS = {
    "413": "Body over MAX_REQUEST_BYTES (uploads: FILES_MAX_BYTES)",
    "415": "A Content-Type this endpoint does not parse",
}
_OPEN = {"401", "403", "429"}  # not from an endpoint that asks no credentials


def document_errors(result: dict, generator, request, public) -> dict:
    """drf-spectacular postprocessing hook: every operation lists the error statuses it can
    answer (schemathesis checks that it answers no other), in the OpenAI error shape."""
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, operations in result.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            common = dict(_COMMON_ERRORS)
            if method in ("post", "patch", "put"):
                common.update(_BODY_ERRORS)
            if operation.get("security") == [{}] or operation.get("security") == []:
                common = {status: text for status, text in common.items() if status not in _OPEN}
            for status, description in common.items():
                responses.setdefault(status, {"description": description, **error})
    return result


urlpatterns = [
    path("v1/models", ModelList.as_view()),
    path("v1/models/<path:model>", ModelDetail.as_view()),
    path("tokenize", Tokenize.as_view()),
    path("detokenize", Detokenize.as_view()),
    # The Files and Batch APIs are plain DRF views: the schema describes the real ones.
    path("v1/files", batch_views.FileList.as_view()),
    path("v1/files/<str:file_id>", batch_views.FileDetail.as_view()),
    path("v1/files/<str:file_id>/content", batch_views.FileContent.as_view()),
    path("v1/batches", batch_views.BatchList.as_view()),
    path("v1/batches/<str:batch_id>", batch_views.BatchDetail.as_view()),
    path("v1/batches/<str:batch_id>/cancel", batch_views.BatchCancel.as_view()),
    path("v1/usage", tenant_views.Usage.as_view()),
    path("version", Version.as_view()),
    path("api/v1/admin/", include(tenant_urls.admin_urlpatterns)),
    path("v1/chat/completions", ChatCompletionsDoc.as_view()),
    path("v1/completions", CompletionsDoc.as_view()),
    path("api/v1/inference/chat", PlatformChatDoc.as_view()),
    path("api/v1/engine/stats", EngineStatsDoc.as_view()),
    path("api/v1/engine/fleet", EngineFleetDoc.as_view()),
]
