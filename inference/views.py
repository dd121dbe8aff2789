"""The OpenAI-compatible API. Views parse, call one function, and respond."""
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

import config
from inference import prompts, protocol
from inference.catalog import served_models
from inference.engine.api import InvalidRequestError
from inference.host import EngineUnavailable, host
from tenants.api import TenantAPIView, on_a_pool
from tenants.errors import ApiError
from tenants.models import Scope


class Model(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(choices=["model"])
    created = serializers.IntegerField()
    owned_by = serializers.CharField()
    max_model_len = serializers.IntegerField(allow_null=True, help_text="The context in tokens; null while loading.")


def _models() -> list[dict]:
    try:
        max_model_len = host.max_model_len
    except EngineUnavailable:
        max_model_len = None
    return served_models(max_model_len)


class ModelList(TenantAPIView):
    """GET /v1/models: the models this deployment serves (the same for every tenant)."""

    @extend_schema(
        operation_id="listModels",
        responses=inline_serializer("ModelList", {
            "object": serializers.ChoiceField(choices=["list"]),
            "data": Model(many=True),
        }),
        tags=["models"],
    )
    def get(self, request: Request) -> Response:
        return Response({"object": "list", "data": _models()})


class ModelDetail(TenantAPIView):
    """GET /v1/models/{model}: one served model, or 404 `model_not_found`."""

    @extend_schema(operation_id="retrieveModel", responses=Model, tags=["models"])
    def get(self, request: Request, model: str) -> Response:
        for served in _models():
            if served["id"] == model:
                return Response(served)
        raise ApiError(404, f"The model '{model[:200]}' does not exist.", code="model_not_found", param="model")


class Version(APIView):
    """GET /version (vLLM's): the platform's release, for clients and deploy checks. Open, like
    /healthz: it names this platform's version only, no dependency's."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes: list = []

    @extend_schema(operation_id="version", tags=["utility"],
                   responses=inline_serializer("Version", {"version": serializers.CharField()}))
    def get(self, request: Request) -> Response:
        return Response({"version": config.__version__})


@csrf_exempt
def unknown_path(request: HttpRequest) -> JsonResponse:
    """Any /v1/ or /api/ path nothing else routes: OpenAI's error shape, not Django's HTML page."""
    error = ApiError(404, f"Unknown request URL: {request.method} {request.path[:200]}.", code="unknown_url")
    return JsonResponse(error.body(), status=404)


class TokenizeRequest(serializers.Serializer):
    model = serializers.CharField(required=False)
    prompt = serializers.CharField(required=False, help_text="Text, tokenized as /v1/completions does.")
    messages = serializers.ListField(child=serializers.DictField(), required=False, help_text=(
        "A chat, rendered with the model's template as /v1/chat/completions does (with `tools`, as it would)."))
    tools = serializers.ListField(child=serializers.DictField(), required=False)
    add_special_tokens = serializers.BooleanField(required=False, help_text="Prompts only; default true.")


class Tokenize(TenantAPIView):
    """POST /tokenize (vLLM's): the token ids a prompt or a chat is, exactly as a generation would
    count them. Counted against requests/min, not tokens/min."""
    scopes = {"POST": Scope.INFERENCE}

    @extend_schema(operation_id="tokenize", request=TokenizeRequest, responses=inline_serializer("Tokens", {
        "tokens": serializers.ListField(child=serializers.IntegerField()),
        "count": serializers.IntegerField(),
        "max_model_len": serializers.IntegerField(),
    }), tags=["utilities"])
    def post(self, request: Request) -> Response:
        data = _json_object(request)
        protocol.check_fields(data, {"model", "prompt", "messages", "tools", "add_special_tokens"})
        if ("prompt" in data) == ("messages" in data):
            raise protocol.bad_request("Send either 'prompt' or 'messages'.", "prompt", "missing_required_parameter")
        special = data.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise protocol.bad_request("'add_special_tokens' must be a boolean.", "add_special_tokens", "invalid_type")
        body = {k: data[k] for k in ("model", "prompt", "messages", "tools") if k in data}
        engine = _engine()
        if "messages" in body:
            ids = prompts.tokenize(protocol.parse_chat(body))[0][0]
        elif isinstance(body["prompt"], str) and not special:
            protocol.parse_completion(body)  # the same bounds as a completion's prompt
            ids = engine.tokenizer.hf.encode(body["prompt"], add_special_tokens=False)
        else:
            request_ = protocol.parse_completion(body)
            if request_.num_prompts != 1:
                raise protocol.bad_request("'prompt' must be one prompt here.", "prompt", "invalid_value")
            ids = prompts.tokenize(request_)[0][0]
        return Response({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})


class Detokenize(TenantAPIView):
    """POST /detokenize (vLLM's): the text of token ids. Counted against requests/min only."""
    scopes = {"POST": Scope.INFERENCE}

    @extend_schema(operation_id="detokenize", request=inline_serializer("DetokenizeRequest", {
        "model": serializers.CharField(required=False),
        "tokens": serializers.ListField(child=serializers.IntegerField(min_value=0)),
    }), responses=inline_serializer("Detokenized", {"prompt": serializers.CharField(allow_blank=True)}),
        tags=["utilities"])
    def post(self, request: Request) -> Response:
        data = _json_object(request)
        protocol.check_fields(data, {"model", "tokens"})
        tokens = data.get("tokens")
        if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
            raise protocol.bad_request("'tokens' must be an array of token ids.", "tokens", "invalid_type")
        if len(tokens) > settings.MAX_PROMPT_CHARS:
            raise protocol.bad_request(f"'tokens' takes at most {settings.MAX_PROMPT_CHARS} ids.", "tokens", "invalid_value")
        engine = _engine()
        try:
            engine.check_token_ids(tokens)
        except InvalidRequestError as exc:
            raise protocol.bad_request(exc.message, "tokens", exc.code) from None
        return Response({"prompt": engine.tokenizer.decode(tokens)})


def _json_object(request: Request) -> dict:
    if not isinstance(request.data, dict):
        raise protocol.bad_request("The request body must be a JSON object.", code="invalid_json")
    return dict(request.data)


def _engine():
    from inference import streaming  # the engine's serving loop: not for the URL map's importers (manage.py, Celery)

    try:
        return host.engine().engine
    except EngineUnavailable as exc:
        raise streaming.engine_error(exc) from None


# Tokenizing up to MAX_PROMPT_CHARS (~0.1-0.2 s of CPU at 256K characters), each request in a
# thread of its own, let one tenant's burst of them take the interpreter and the cores from every
# other tenant's requests: a files list sent after 100 tokenize calls was answered after 96 of
# them. Two at a time on a pool of their own: after 7.
_tokenizer_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
tokenize = on_a_pool(Tokenize, _tokenizer_pool, "tokenizer")
detokenize = on_a_pool(Detokenize, _tokenizer_pool, "tokenizer")
