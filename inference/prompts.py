"""A generation's prompts as the engine will see them, and how long its completions may be.

Owns: tokenizing the request (the chat template, or each completion prompt, text or token
ids), the texts a completion's `echo` returns, and `max_tokens`: the one asked for, checked
against the model's context, or else the most the context, the tier and its tokens/min
allow. Every refusal is a 400 naming the field (`protocol.bad_request`). Reserving those
tokens is `inference.gate`'s.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from django.conf import settings

from inference import tool_calls
from inference.engine.api import InvalidRequestError
from inference.host import host
from inference.protocol import GenerationRequest, bad_request
from tenants.models import QuotaTier

if TYPE_CHECKING:
    from inference.engine.engine import LLMEngine

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the legacy completions API's default


def _as_bad_request(check, *args, param: str) -> None:
    """Run one of the engine's checks; its refusal becomes a 400, a prompt's named `param`."""
    try:
        check(*args)
    except InvalidRequestError as exc:
        raise bad_request(exc.message, param if exc.param == "prompt" else exc.param, exc.code) from None


def tokenize(request: GenerationRequest) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids, and (completions) its text for `echo`. Blocking: run it in a thread."""
    tokenizer = host.tokenizer
    if request.kind == "chat":
        messages, tools = tool_calls.conversation(list(request.messages), request.tools, tokenizer.knows_tools)
        try:
            return [tokenizer.encode_chat(messages, tools=tools)], []
        except Exception as exc:  # the template refused the conversation (e.g. roles out of order)
            raise bad_request(f"The conversation could not be rendered with the model's chat template: {exc}",
                              "messages", "invalid_messages") from None
    engine = host.engine().engine
    out, texts = [], []
    for prompt in request.prompts:
        if isinstance(prompt, str):
            out.append(tokenizer.encode(prompt))
            texts.append(prompt)
            continue
        _as_bad_request(engine.check_token_ids, list(prompt), param="prompt")
        out.append(list(prompt))
        texts.append(tokenizer.decode(prompt) if request.echo else "")
    if any(not ids for ids in out):
        raise bad_request("A prompt encodes to no tokens.", "prompt", "empty_prompt")
    return out, texts


def as_json(request: GenerationRequest) -> str:
    """What a tenant's debug capture stores of a request: its messages (chat) or prompts."""
    return json.dumps(list(request.messages) if request.kind == "chat" else list(request.prompts), ensure_ascii=False)


def max_tokens(request: GenerationRequest, tier: QuotaTier, prompt_token_ids: list[list[int]], engine: LLMEngine) -> int:
    """The request's max_tokens, or the most its context, tier and rate limit allow."""
    longest = max(len(p) for p in prompt_token_ids)
    # The engine's own check, so the API refuses exactly what the engine would (and names the
    # chat's field `messages`).
    _as_bad_request(engine.check_context, longest, request.max_tokens,
                    param="messages" if request.kind == "chat" else "prompt")
    if request.max_tokens is not None:
        return request.max_tokens
    max_model_len = engine.max_model_len
    choices = request.n * len(prompt_token_ids)
    by_rate = (tier.tokens_per_minute - sum(len(p) for p in prompt_token_ids)) // choices
    default = tier.max_tokens_per_request if request.kind == "chat" else DEFAULT_COMPLETION_MAX_TOKENS
    # An implicit max_tokens obeys the same n x max_tokens bound as an explicit one (protocol).
    by_request = settings.MAX_REQUEST_TOKENS // choices
    return max(1, min(default, tier.max_tokens_per_request, max_model_len - longest, by_rate, by_request))
