"""Request bodies of the generation endpoints, parsed and validated into one frozen value.

`parse_body` turns raw bytes into a JSON object; `parse_chat` / `parse_completion` turn
that object into a `GenerationRequest`. Every problem is an `ApiError` (400, OpenAI
error shape) naming the parameter at fault, so no bad input reaches the engine. The
numeric ranges are the engine's one table (`inference.engine.api.LIMITS`), which the engine's
`SamplingParams` checks too and `inference.openapi` publishes.

The bounds on what a request may cost (stop strings, messages, prompt size, n x max_tokens,
logprobs x n, prompts x n) are settings (config/settings.py, "request bounds"), read here
at each request and published by `inference.openapi` from the same names. They hold on every
path that takes a generation: REST, the WebSocket `start` message and batch input lines.

Unknown fields are refused (as OpenAI does) rather than silently ignored; fields that
OpenAI clients routinely send with a neutral value (`null`, `n: 1`, `logit_bias: {}`)
are accepted.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from inference import tool_calls
from inference.engine import grammar as grammars
from inference.engine.api import LIMITS, Grammar, InvalidRequestError, SamplingParams
from tenants.errors import ApiError

MAX_PROMPTS = 64  # text or token-id prompts of one completion request
MAX_PROMPT_CACHE_KEY_CHARS = 256  # OpenAI's prompt_cache_key: a routing key, never stored per request
ROLES = ("system", "developer", "user", "assistant", "tool")

_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "ignore_eos", "stop_token_ids", "speculative",
)
_COMMON_FIELDS = {
    "model", "stream", "stream_options", "n", "max_tokens", "priority", "user", "logit_bias",
    "metadata", "store", "service_tier", "prompt_cache_key", *_SAMPLING_FIELDS,
}
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools",
    "tool_choice", "parallel_tool_calls", "functions", "function_call", "modalities",
}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of", "response_format"}
SCHEMA_NAME_CHARS = 64  # OpenAI's limit on json_schema.name and a function's name (letters, digits, _ and -)
MAX_TOOLS = 128  # OpenAI's limit on `tools`
# OpenAI's service tiers, as lanes (never better than the key's tier: a better one is capped to it).
SERVICE_TIERS = {"priority": 0, "default": None, "auto": None, "scale": None, "flex": 2}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_request") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def too_large(message: str, param: str) -> ApiError:
    return ApiError(413, message, code="request_too_large", param=param)


@dataclass(frozen=True)
class GenerationRequest:
    """What one API call asks for, before tokenization and quota."""

    kind: str  # "chat" | "completion"
    model: str | None
    # chat: one list of messages; completion: one or more prompts (text or token ids)
    messages: tuple[dict, ...] = ()
    prompts: tuple[str | tuple[int, ...], ...] = ()
    n: int = 1
    max_tokens: int | None = None  # None: as many as the context, tier and rate limit allow
    max_tokens_param: str = "max_tokens"  # the field the client used (chat also takes max_completion_tokens)
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields except max_tokens, logprobs
    logprobs: int | None = None  # top alternatives per token; 0 = the sampled token's own only
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    priority: int | None = None
    tools: tool_calls.Tools | None = None  # chat: the functions the model may call, and how
    service_tier: str | None = None  # OpenAI's; a lane preference (SERVICE_TIERS), echoed in the response

    @property
    def num_prompts(self) -> int:
        return 1 if self.kind == "chat" else len(self.prompts)

    def sampling_params(self, max_tokens: int, seed_offset: int = 0) -> SamplingParams:
        """The engine's parameters for one choice. Choice i of a seeded request uses seed + i, so
        `n` seeded choices differ from each other and the whole response is reproducible."""
        params = dict(self.params)
        if params.get("seed") is not None:
            params["seed"] = params["seed"] + seed_offset
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **params)
        except InvalidRequestError as exc:
            raise bad_request(exc.message, exc.param) from None


# --- the body ------------------------------------------------------------------------------


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    # Python reads 1e400 as inf, which every numeric check below would then have to special-case.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} is out of range")
    return value


def parse_body(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; 400 for anything else."""
    if not body.strip():
        raise bad_request("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"The request body is not valid UTF-8 (byte {exc.start}).", code="invalid_encoding") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, not {_type_name(data)}.", code="invalid_json")
    if _has_lone_surrogate(data):
        raise bad_request("The request body contains an unpaired UTF-16 surrogate escape.", code="invalid_encoding")
    return data


# --- field helpers -------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _is_int(value: Any) -> bool:
    # JSON has one number type: 2.0 is accepted as 2, as OpenAI does.
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return True
    return isinstance(value, int) and not isinstance(value, bool)


def _int(data: dict, name: str, default: Any = None) -> Any:
    value = data.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer, not {_type_name(value)}.", name, "invalid_type")
    return _in_range(name, int(value))


def _number(data: dict, name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number, not {_type_name(value)}.", name, "invalid_type")
    return float(_in_range(name, value))


def _in_range(name: str, value: int | float) -> int | float:
    limit = LIMITS[name]
    if value not in limit:
        raise bad_request(f"'{name}' must be {limit.describe()}, got {value:g}.", name, "invalid_value")
    return value


def _bool(data: dict, name: str, default: bool = False) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean, not {_type_name(value)}.", name, "invalid_type")
    return value


def _unsupported(data: dict, name: str, neutral: Any = None, what: str = "") -> None:
    value = data.get(name)
    if value is None or value == neutral or (neutral == {} and value == []):
        return
    raise bad_request(f"'{name}' is not supported by this server{what}.", name, "unsupported_parameter")


def check_fields(data: dict, allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}.", unknown[0], "unknown_parameter")


def _model(data: dict) -> str | None:
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"'model' must be a string, not {_type_name(model)}.", "model", "invalid_type")
    return model


def _stop(data: dict) -> tuple[str, ...]:
    stop = data.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("'stop' must be a string or an array of strings.", "stop", "invalid_type")
    if len(stop) > settings.MAX_STOP:
        raise bad_request(f"'stop' takes at most {settings.MAX_STOP} sequences, got {len(stop)}.", "stop", "invalid_value")
    if any(not s for s in stop):
        raise bad_request("'stop' sequences must not be empty.", "stop", "invalid_value")
    longest = max((len(s) for s in stop), default=0)
    if longest > settings.MAX_STOP_CHARS:
        raise bad_request(f"'stop' sequences take at most {settings.MAX_STOP_CHARS} characters each, got {longest}.",
                          "stop", "invalid_value")
    return tuple(stop)


def _stop_token_ids(data: dict) -> tuple[int, ...]:
    ids = data.get("stop_token_ids")
    if ids is None:
        return ()
    limit = settings.MAX_STOP_TOKEN_IDS
    if not isinstance(ids, list) or len(ids) > limit or not all(_is_int(t) and t >= 0 for t in ids):
        raise bad_request(f"'stop_token_ids' must be an array of at most {limit} non-negative integers.",
                          "stop_token_ids", "invalid_type")
    return tuple(int(t) for t in ids)


def _sampling(data: dict) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _number(data, name)
        if value is not None:
            params[name] = value
    for name in ("top_k", "seed"):
        value = _int(data, name)
        if value is not None:
            params[name] = value
    params["stop"] = _stop(data)
    params["stop_token_ids"] = _stop_token_ids(data)
    params["ignore_eos"] = _bool(data, "ignore_eos")
    params["speculative"] = _bool(data, "speculative", default=True)
    return params


def _stream(data: dict) -> tuple[bool, bool]:
    stream = _bool(data, "stream")
    options = data.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object.", "stream_options", "invalid_type")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true.", "stream_options", "invalid_value")
        unknown = set(options) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise bad_request(f"Unrecognized stream option: {', '.join(sorted(unknown))}.", "stream_options", "unknown_parameter")
        include_usage = _bool(options, "include_usage")
    return stream, include_usage


def _common(data: dict) -> dict[str, Any]:
    _unsupported(data, "logit_bias", {})
    stream, include_usage = _stream(data)
    if data.get("user") is not None and not isinstance(data["user"], str):
        raise bad_request("'user' must be a string.", "user", "invalid_type")
    service_tier = data.get("service_tier")
    if service_tier is not None and service_tier not in SERVICE_TIERS:
        raise bad_request(f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}.", "service_tier", "invalid_value")
    if data.get("metadata") is not None and not isinstance(data["metadata"], dict):
        raise bad_request("'metadata' must be an object.", "metadata", "invalid_type")
    key = data.get("prompt_cache_key")
    if key is not None and not (isinstance(key, str) and 0 < len(key) <= MAX_PROMPT_CACHE_KEY_CHARS):
        raise bad_request(f"'prompt_cache_key' must be a string of 1 to {MAX_PROMPT_CACHE_KEY_CHARS} characters.",
                          "prompt_cache_key", "invalid_value")
    params = _sampling(data)
    grammar = response_format(data.get("response_format"))
    if grammar is not None:
        params["grammar"] = grammar
    return {
        "model": _model(data),
        "n": _int(data, "n", default=1),
        "params": params,
        "stream": stream,
        "include_usage": include_usage,
        "priority": _int(data, "priority"),
        "service_tier": service_tier,
    }


def _is_name(name: Any) -> bool:
    """A schema's or a function's name as OpenAI takes it: 1 to 64 letters, digits, _ or -."""
    return (isinstance(name, str) and 0 < len(name) <= SCHEMA_NAME_CHARS
            and all(c.isascii() and (c.isalnum() or c in "_-") for c in name))


def response_format(fmt: Any) -> Grammar | None:
    """The grammar `response_format` holds the output to: None for text (or no format); a 400
    naming the part at fault for anything the grammar engine cannot compile."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("'response_format' must be an object with a 'type'.", "response_format", "invalid_type")
    kind = fmt.get("type")
    known = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in known:
        raise bad_request("'response_format.type' must be 'text', 'json_object' or 'json_schema'.",
                          "response_format.type", "invalid_value")
    unknown = sorted(set(fmt) - known[kind])
    if unknown:
        raise bad_request(f"Unrecognized field in response_format of type '{kind}': '{unknown[0]}'.",
                          f"response_format.{unknown[0]}", "unknown_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    spec = fmt.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"'{param}' must be an object with 'name' and 'schema'.", param,
                          "missing_required_parameter" if spec is None else "invalid_type")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise bad_request(f"Unrecognized field in '{param}': '{unknown[0]}'.", f"{param}.{unknown[0]}", "unknown_parameter")
    name = spec.get("name")
    if not _is_name(name):
        raise bad_request(f"'{param}.name' must be 1 to {SCHEMA_NAME_CHARS} letters, digits, underscores or dashes.",
                          f"{param}.name", "invalid_value")
    for key, kinds, what in (("strict", (bool,), "a boolean"), ("description", (str,), "a string")):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise bad_request(f"'{param}.{key}' must be {what}.", f"{param}.{key}", "invalid_type")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}.schema' must be a JSON schema object.", f"{param}.schema", "invalid_type")
    # Compact and in the client's key order: properties come out in the order the schema names them.
    source = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if len(source.encode()) > settings.STRUCTURED_MAX_SCHEMA_BYTES:
        raise bad_request(f"'{param}.schema' is {len(source.encode())} bytes as JSON; at most "
                          f"{settings.STRUCTURED_MAX_SCHEMA_BYTES} are accepted.", f"{param}.schema", "invalid_value")
    grammar = Grammar("json_schema", source, param=f"{param}.schema")
    try:
        grammars.check(grammar)
    except InvalidRequestError as exc:
        raise bad_request(exc.message, exc.param, "invalid_schema") from None
    return grammar


def _max_tokens(data: dict, *names: str) -> int | None:
    given = [name for name in names if data.get(name) is not None]
    if len(given) > 1 and data[given[0]] != data[given[1]]:
        raise bad_request(f"Send either '{given[0]}' or '{given[1]}', not both.", given[1], "invalid_value")
    for name in given:
        return _int(data, name)
    return None


# --- chat ----------------------------------------------------------------------------------


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if content is None:
        if message.get("role") == "assistant":
            return ""
        raise bad_request(f"'{param}' is required.", param, "missing_required_parameter")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise bad_request(f"'{param}[{j}].text' must be a string, not {_type_name(part.get('text'))}.",
                                  f"{param}[{j}].text", "invalid_type")
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise bad_request(
                    f"'{param}[{j}]' must be a text part ({{\"type\": \"text\", \"text\": ...}}); "
                    f"this model reads text only, not {kind!r}.",
                    f"{param}[{j}]",
                    "unsupported_content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"'{param}' must be a string or an array of text parts, not {_type_name(content)}.", param, "invalid_type")


def _messages(data: dict) -> tuple[dict, ...]:
    messages = data.get("messages")
    if messages is None:
        raise bad_request("'messages' is required.", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise bad_request(f"'messages' must be an array, not {_type_name(messages)}.", "messages", "invalid_type")
    if not messages:
        raise bad_request("'messages' must not be empty.", "messages", "empty_array")
    if len(messages) > settings.MAX_MESSAGES:
        raise bad_request(f"'messages' takes at most {settings.MAX_MESSAGES} messages, got {len(messages)}.",
                          "messages", "invalid_value")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"'messages[{i}]' must be an object, not {_type_name(message)}.", f"messages[{i}]", "invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(
                f"'messages[{i}].role' must be one of {', '.join(ROLES)}, got {role!r}.", f"messages[{i}].role", "invalid_value"
            )
        # The chat template knows system, user and assistant; developer is OpenAI's new name for system.
        content = _content(message, i)
        if role == "assistant" and message.get("tool_calls") is not None:
            content = "\n".join(filter(None, [content, tool_calls.render_history(_history_calls(message, i))]))
        elif role == "tool":
            content = tool_calls.render_result(content)
        parsed.append({"role": "system" if role == "developer" else role, "content": content})
    if all(not m["content"] for m in parsed):
        raise bad_request("Every message is empty.", "messages", "empty_prompt")
    _check_prompt_chars(sum(len(m["content"]) for m in parsed), "messages")
    return tuple(parsed)


def _history_calls(message: dict, index: int) -> dict:
    """An assistant message's `tool_calls`, checked: each a function call with JSON arguments."""
    calls = message["tool_calls"]
    param = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"'{param}' must be an array.", param, "invalid_type")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"'{param}[{j}].function' must be an object with a 'name'.", f"{param}[{j}].function",
                              "invalid_type")
        arguments = function.get("arguments", "{}")
        try:
            if not isinstance(json.loads(arguments), dict):
                raise ValueError
        except (TypeError, ValueError):
            raise bad_request(f"'{param}[{j}].function.arguments' must be a JSON object as a string.",
                              f"{param}[{j}].function.arguments", "invalid_value") from None
    return message


def _tools(data: dict, grammar: Grammar | None) -> tool_calls.Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked; None without tools."""
    tools, choice = data.get("tools"), data.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'.", "tool_choice", "invalid_value")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array of function tools.", "tools", "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' takes at most {MAX_TOOLS} tools, got {len(tools)}.", "tools", "invalid_value")
    size = len(json.dumps(tools, ensure_ascii=False, separators=(",", ":")).encode())
    if size > settings.STRUCTURED_MAX_SCHEMA_BYTES:
        raise bad_request(f"'tools' are {size} bytes as JSON; at most {settings.STRUCTURED_MAX_SCHEMA_BYTES} are accepted.",
                          "tools", "invalid_value")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"'{param}' must be {{\"type\": \"function\", \"function\": {{...}}}}.", param, "invalid_value")
        function = tool["function"]
        name = function.get("name")
        if not _is_name(name):
            raise bad_request(f"'{param}.function.name' must be 1 to {SCHEMA_NAME_CHARS} letters, digits, underscores "
                              "or dashes.", f"{param}.function.name", "invalid_value")
        if name in names:
            raise bad_request(f"Two tools are named '{name}'.", f"{param}.function.name", "invalid_value")
        names.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise bad_request(f"'{param}.function.parameters' must be a JSON schema object.",
                              f"{param}.function.parameters", "invalid_type")
        try:
            grammars.check(Grammar("json_schema", json.dumps(parameters), param=f"{param}.function.parameters"))
        except InvalidRequestError as exc:
            raise bad_request(exc.message, exc.param, "invalid_schema") from None
        described = {"name": name, "parameters": parameters}
        if isinstance(function.get("description"), str):
            described = {"name": name, "description": function["description"], "parameters": parameters}
        functions.append(described)
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if named not in names:
            raise bad_request(f"'tool_choice' names no function in 'tools': {named!r}.", "tool_choice", "invalid_value")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}.", "tool_choice", "invalid_value")
    parallel = data.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls", "invalid_type")
    if grammar is not None and choice != "none":
        raise bad_request("'response_format' other than text cannot be combined with tools the model may call; "
                          "set tool_choice to 'none' or drop one of them.", "response_format", "unsupported_parameter")
    return tool_calls.Tools(tuple(functions), choice, named, parallel)


def _check_prompt_chars(chars: int, param: str) -> None:
    if chars > settings.MAX_PROMPT_CHARS:
        raise too_large(f"'{param}' holds {chars} characters; at most {settings.MAX_PROMPT_CHARS} are accepted.", param)


def _check_totals(n: int, max_tokens: int | None, max_tokens_param: str, logprobs: int | None, logprobs_param: str) -> None:
    """Bounds on the whole request: its `n` choices (times the prompts of a completion) each
    cost their max_tokens and their logprobs alternatives."""
    if max_tokens is not None and n * max_tokens > settings.MAX_REQUEST_TOKENS:
        raise bad_request(
            f"{n} choices x '{max_tokens_param}' {max_tokens} = {n * max_tokens} tokens; a request may ask for "
            f"at most {settings.MAX_REQUEST_TOKENS}. Lower '{max_tokens_param}' or 'n'.",
            max_tokens_param, "invalid_value",
        )
    if logprobs and n * logprobs > settings.MAX_REQUEST_LOGPROBS:
        raise bad_request(
            f"{n} choices x '{logprobs_param}' {logprobs} = {n * logprobs} alternatives a token; a request may ask for "
            f"at most {settings.MAX_REQUEST_LOGPROBS}. Lower '{logprobs_param}' or 'n'.",
            logprobs_param, "invalid_value",
        )


def parse_chat(data: dict) -> GenerationRequest:
    check_fields(data, CHAT_FIELDS)
    _unsupported(data, "functions", [], ": use 'tools'")
    if data.get("function_call") not in (None, "none", "auto"):
        raise bad_request("'function_call' is not supported by this server: use 'tool_choice'.", "function_call",
                          "unsupported_parameter")
    logprobs = _bool(data, "logprobs")
    top = _int(data, "top_logprobs")
    if top is not None and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs", "invalid_value")
    messages = _messages(data)
    max_tokens = _max_tokens(data, "max_completion_tokens", "max_tokens")
    max_tokens_param = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    common = _common(data)
    _check_totals(common["n"], max_tokens, max_tokens_param, top, "top_logprobs")
    tools = _tools(data, common["params"].get("grammar"))
    if tools is not None and tools.active:
        common["params"]["grammar"] = tool_calls.grammar(tools)
    return GenerationRequest(
        kind="chat",
        messages=messages,
        tools=tools,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        logprobs=(top or 0) if logprobs else None,
        **common,
    )


# --- completions ---------------------------------------------------------------------------


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def _prompts(data: dict) -> tuple[str | tuple[int, ...], ...]:
    prompt = data.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required.", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif _is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and not prompt:
        raise bad_request("'prompt' must not be empty.", "prompt", "empty_prompt")
    else:
        raise bad_request(
            "'prompt' must be a string, an array of strings, an array of token ids or an array of such arrays.",
            "prompt",
            "invalid_type",
        )
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"'prompt' takes at most {MAX_PROMPTS} prompts, got {len(prompts)}.", "prompt", "invalid_value")
    _check_prompt_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
    out: list[str | tuple[int, ...]] = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad_request("'prompt' must not be an empty string.", "prompt", "empty_prompt")
            out.append(p)
        else:
            out.append(tuple(int(t) for t in p))
    return tuple(out)


def parse_completion(data: dict) -> GenerationRequest:
    check_fields(data, COMPLETION_FIELDS)
    _unsupported(data, "suffix", "")
    common = _common(data)
    best_of = _int(data, "best_of")
    if best_of is not None and best_of != common["n"]:
        raise bad_request("'best_of' different from 'n' is not supported by this server.", "best_of", "unsupported_parameter")
    prompts = _prompts(data)
    choices = len(prompts) * common["n"]
    if choices > settings.MAX_CHOICES:
        raise bad_request(f"At most {settings.MAX_CHOICES} choices per request (prompts x n), got {choices}.",
                          "n", "invalid_value")
    max_tokens = _max_tokens(data, "max_tokens")
    logprobs = _int(data, "logprobs")
    _check_totals(choices, max_tokens, "max_tokens", logprobs, "logprobs")
    return GenerationRequest(
        kind="completion",
        prompts=prompts,
        max_tokens=max_tokens,
        logprobs=logprobs,
        echo=_bool(data, "echo"),
        **common,
    )
