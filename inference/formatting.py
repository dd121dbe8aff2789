"""OpenAI response objects: chat completions, text completions, their stream chunks, logprobs.

Pure functions of a `Generation`'s state and the engine's deltas; nothing here talks to
the engine, Redis or the database.
"""
from __future__ import annotations

from functools import lru_cache

from inference import tool_calls
from inference.engine.api import TokenLogprob
from inference.generation import Generation
from inference.streaming import Choice

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """A token's text and exact bytes, for logprobs (a byte-level token may hold half a character)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.hf.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if isinstance(piece, str) and piece and all(ch in decoder for ch in piece):
            raw = bytes(decoder[ch] for ch in piece)
        else:
            raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        text = raw.decode("utf-8", errors="replace")
        hit = (text, list(raw))
        if len(self._cache) < 200_000:
            self._cache[token_id] = hit
        return hit


_token_texts: dict[int, TokenText] = {}


def token_text(tokenizer) -> TokenText:
    key = id(tokenizer)
    if key not in _token_texts:
        _token_texts.clear()  # one tokenizer per process; a rebuilt engine brings a new one
        _token_texts[key] = TokenText(tokenizer)
    return _token_texts[key]


def chat_logprobs(entries: list[TokenLogprob], texts: TokenText) -> dict:
    content = []
    for entry in entries:
        text, raw = texts(entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            t, b = texts(token_id)
            top.append({"token": t, "logprob": logprob, "bytes": b})
        content.append({"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(entries: list[TokenLogprob], texts: TokenText, offset: int) -> dict:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        text, _ = texts(entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top_logprobs.append({texts(t)[0]: lp for t, lp in entry.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def finish_reason(choice: Choice) -> str | None:
    if choice.grammar_error:
        return "error"  # structured output at a dead end: the text cannot be completed to parse
    return None if choice.finish_reason is None else FINISH_REASONS.get(choice.finish_reason, "stop")


def _with_grammar_error(entry: dict, choice: Choice) -> dict:
    """The choice, and why its structured output stopped when it reached a dead end."""
    if choice.grammar_error:
        entry["error"] = {"message": choice.grammar_error, "type": "invalid_request_error", "code": "grammar_dead_end"}
    return entry


# --- whole responses ---------------------------------------------------------------------


def completion_response(gen: Generation, texts: TokenText) -> dict:
    """The non-streamed response, after `gen.collect()` and `gen.close()`."""
    logprobs_on = gen.request.logprobs is not None
    choices = []
    for choice in gen.choices:
        text = "".join(gen.texts.get(choice.index, ()))
        entries = gen.logprobs.get(choice.index, [])
        if gen.request.kind == "chat":
            message, reason = {"role": "assistant", "content": text, "refusal": None}, finish_reason(choice)
            if _calls_possible(gen):
                content, calls = tool_calls.CallParser().feed(text, final=True)
                if calls:
                    message = {"role": "assistant", "content": content.strip() or None, "refusal": None,
                               "tool_calls": [_call(c) for c in calls]}
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append(_with_grammar_error({
                "index": choice.index,
                "message": message,
                "logprobs": chat_logprobs(entries, texts) if logprobs_on else None,
                "finish_reason": reason,
            }, choice))
        else:
            prefix = gen.prompt_texts[choice.prompt_index] if gen.request.echo else ""
            choices.append(_with_grammar_error({
                "index": choice.index,
                "text": prefix + text,
                "logprobs": completion_logprobs(entries, texts, len(prefix)) if logprobs_on else None,
                "finish_reason": finish_reason(choice),
            }, choice))
    return _with_service_tier(gen, {
        "id": gen.id,
        "object": "chat.completion" if gen.request.kind == "chat" else "text_completion",
        "created": gen.created,
        "model": gen.model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": gen.usage.as_dict(),
    })


SERVICE_TIER_OF_LANE = {0: "priority", 1: "default", 2: "flex"}


def _with_service_tier(gen: Generation, body: dict) -> dict:
    """The service tier the request ran in (its lane), when it asked for one."""
    if gen.request.service_tier is not None:
        body["service_tier"] = SERVICE_TIER_OF_LANE[gen.lane]
    return body


# --- stream chunks -----------------------------------------------------------------------


def _chunk(gen: Generation, choices: list[dict]) -> dict:
    chunk = {
        "id": gen.id,
        "object": "chat.completion.chunk" if gen.request.kind == "chat" else "text_completion",
        "created": gen.created,
        "model": gen.model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if gen.request.include_usage:
        chunk["usage"] = None
    return _with_service_tier(gen, chunk)


def opening_chunks(gen: Generation) -> list[dict]:
    """Chat streams open with each choice's role, as OpenAI's do; completion streams echo the prompt."""
    if gen.request.kind == "chat":
        return [_chunk(gen, [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for c in gen.choices])]
    if gen.request.echo:
        return [_chunk(gen, [{"index": c.index, "text": gen.prompt_texts[c.prompt_index], "logprobs": None,
                              "finish_reason": None} for c in gen.choices])]
    return []


def _calls_possible(gen: Generation) -> bool:
    return gen.request.tools is not None and gen.request.tools.active


def _call(call: dict, with_index: bool = False) -> dict:
    return call if with_index else {k: v for k, v in call.items() if k != "index"}


def delta_chunk(gen: Generation, batch, texts: TokenText) -> dict:
    logprobs_on = gen.request.logprobs is not None
    choices = []
    for choice, out in batch:
        reason = finish_reason(choice) if out.finished else None
        if gen.request.kind == "chat" and _calls_possible(gen):
            # Content as it comes, each call whole once its closing tag arrives (OpenAI's
            # tool_calls deltas, with `index`); text that may open a call is held until it is known.
            parser = gen.call_parsers.setdefault(choice.index, tool_calls.CallParser())
            content, calls = parser.feed(out.new_text, final=out.finished)
            delta: dict = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [_call(c, with_index=True) for c in calls]
            if out.finished and parser.calls and reason == "stop":
                reason = "tool_calls"
            entry = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": reason}
            choices.append(_with_grammar_error(entry, choice) if out.finished else entry)
            continue
        if gen.request.kind == "chat":
            delta = {"content": out.new_text} if (out.new_text or not out.finished) else {}
            entry = {
                "index": choice.index,
                "delta": delta,
                "logprobs": chat_logprobs(list(out.logprobs), texts) if logprobs_on and out.logprobs else None,
                "finish_reason": reason,
            }
        else:
            entry = {
                "index": choice.index,
                "text": out.new_text,
                "logprobs": completion_logprobs(list(out.logprobs), texts, 0) if logprobs_on and out.logprobs else None,
                "finish_reason": reason,
            }
        choices.append(_with_grammar_error(entry, choice) if out.finished else entry)
    return _chunk(gen, choices)


def usage_chunk(gen: Generation) -> dict:
    chunk = _chunk(gen, [])
    chunk["usage"] = gen.usage.as_dict()
    return chunk
