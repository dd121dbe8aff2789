"""Grammars as llguidance reads them, and the check the API runs on one before queueing it.

Imports neither torch nor Django: request parsing (`inference.protocol`) and batch-line
validation use it; `inference.engine.structured` builds matchers and masks from the same text.
"""
from __future__ import annotations

import json

import llguidance

from inference.engine.api import Grammar
from inference.engine.errors import InvalidRequestError

# Compact separators and no free whitespace: a small model given room for whitespace can spend
# its whole max_tokens on newlines inside a valid document.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's own bounds on what one grammar may cost (its defaults, lexer states halved): a
# hostile schema fails to compile with an error naming the limit instead of stalling a thread.
LIMITS = dict(max_lexer_states=125_000, max_grammar_size=250_000)


def grammar_text(grammar: Grammar) -> str:
    """The llguidance grammar for `grammar` (a JSON string). Raises InvalidRequestError."""
    if grammar.kind == "json_object":
        schema: dict | str = {"type": "object", "x-guidance": JSON_OPTIONS}
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    if grammar.kind == "json_schema":
        try:
            schema = json.loads(grammar.source)
        except ValueError:
            raise InvalidRequestError("the JSON schema is not valid JSON", param=grammar.param) from None
        if not isinstance(schema, dict):
            raise InvalidRequestError("the JSON schema must be an object", param=grammar.param)
        return _converted(grammar, llguidance.LLMatcher.grammar_from_json_schema, schema, overrides=JSON_OPTIONS)
    if grammar.kind == "lark":
        return _converted(grammar, llguidance.LLMatcher.grammar_from_lark, grammar.source)
    if grammar.kind == "regex":
        return _converted(grammar, llguidance.LLMatcher.grammar_from_regex, grammar.source)
    raise InvalidRequestError(f"unknown grammar kind {grammar.kind!r}", param=grammar.param)


def _converted(grammar: Grammar, convert, *args, **kwargs) -> str:
    """llguidance's conversion of a client's grammar, its refusals as InvalidRequestError: it
    raises ValueError for what it cannot take (an integer past 64 bits in a schema, found by
    fuzzing, was a 500)."""
    try:
        return guarded(convert, *args, **kwargs)
    except ValueError as exc:
        raise InvalidRequestError(describe(str(exc)), param=grammar.param) from None


def check(grammar: Grammar) -> None:
    """Raise InvalidRequestError, naming what is wrong, if llguidance cannot compile `grammar`.
    No tokenizer: a cheap check the API runs before a request is queued."""
    text = grammar_text(grammar)
    error = guarded(llguidance.LLMatcher.validate_grammar, text, limits=llguidance.LLParserLimits(**LIMITS))
    if error:
        raise InvalidRequestError(describe(error), param=grammar.param)


class GrammarEngineFailure(RuntimeError):
    """llguidance panicked (a bug of its own, raised as pyo3's PanicException)."""


def guarded(fn, *args, **kwargs):
    """`fn(*args)` with a panic in llguidance's Rust code as GrammarEngineFailure. pyo3 raises
    panics as a BaseException, which would pass every `except Exception` up to the engine
    thread's supervisor and fail every request in flight, not just this one."""
    try:
        return fn(*args, **kwargs)
    except (Exception, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:
        raise GrammarEngineFailure(f"the grammar engine failed: {type(exc).__name__}: {exc}"[:300]) from None


def describe(error: str) -> str:
    """An llguidance error as a client reads it."""
    # llguidance prefixes its messages with where in its pipeline they arose; keep the substance.
    return "the grammar engine cannot use this schema: " + " ".join(error.split())[:500]
