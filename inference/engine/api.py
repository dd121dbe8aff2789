"""The engine's interface, without torch: what a caller sends, what it gets back, and the limits.

`SamplingParams` is one generation's parameters, checked against `LIMITS`, the one table of
parameter ranges: `inference.protocol` validates request bodies from it and `inference.openapi`
publishes the schema from it, so a range is written once. `RequestOutput` is one step's delta
for one request; `EngineStats` is the engine's state as typed fields. Importing this module
loads neither torch nor Django, so request parsing stays light (a test checks `sys.modules`).
"""
from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from inference.engine.errors import ConfigError, EngineError, InvalidRequestError, QueueFullError

__all__ = [
    "ConfigError", "EngineError", "EngineStats", "Grammar", "InvalidRequestError", "LIMITS", "Lane", "LaneStats",
    "QueueFullError", "Range", "RequestOutput", "SamplingParams", "TokenLogprob",
]


class Lane(enum.IntEnum):
    """Scheduling lanes, best first. A tier maps onto one; a request may ask for a worse one."""

    REALTIME = 0
    NEAR_REALTIME = 1
    BATCH = 2

    @property
    def label(self) -> str:
        """As metrics, stats and the console name it: P0, P1, P2."""
        return f"P{self.value}"


@dataclass(frozen=True)
class Range:
    """The values a numeric parameter may take: low..high, both ends included unless `low_open`."""

    low: int | float
    high: int | float
    integer: bool = False
    low_open: bool = False  # top_p and repetition_penalty must be above 0, not 0

    def __contains__(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high

    def describe(self) -> str:
        low = f"greater than {self.low:g}" if self.low_open else f"at least {self.low:g}"
        kind = "an integer" if self.integer else "a number"
        return f"{kind} {low} and at most {self.high:g}"


MAX_N = 16  # choices per request; each takes one of the tier's concurrent generations
MAX_LOGPROBS = 20  # alternatives per sampled token (chat's top_logprobs, the engine's logprobs)

# Every numeric request parameter's range, by the name the API takes it under.
LIMITS: Mapping[str, Range] = MappingProxyType({
    "temperature": Range(0, 2),  # 0 is greedy
    "top_p": Range(0, 1, low_open=True),
    "top_k": Range(-1, 1_000_000, integer=True),  # 0 or -1: no top-k
    "min_p": Range(0, 1),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "repetition_penalty": Range(0, 10, low_open=True),
    # Choice i of a seeded request samples with seed + i, so the top MAX_N seeds are refused.
    "seed": Range(-(2**63), 2**63 - 1 - MAX_N, integer=True),
    "n": Range(1, MAX_N, integer=True),
    "best_of": Range(1, MAX_N, integer=True),
    "max_tokens": Range(1, 1_000_000, integer=True),
    "max_completion_tokens": Range(1, 1_000_000, integer=True),
    "top_logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "logprobs": Range(0, 5, integer=True),  # the legacy completions API's own, lower limit
    "priority": Range(min(Lane), max(Lane), integer=True),
})

# Ceilings on stop conditions whatever a caller passes: the stop matcher's tables cost the stops'
# total length once per request, and every sampled token is looked up in stop_token_ids. The API's
# own bounds are settings (MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS), checked at start-up to
# lie under these (`inference.checks`).
MAX_STOP_SEQUENCES = 16
MAX_STOP_TOTAL_CHARS = 65_536
MAX_STOP_TOKEN_IDS = 1024


def _check(ok: bool, message: str, param: str) -> None:
    # Not `assert`: validation of user input must survive `python -O`.
    if not ok:
        raise InvalidRequestError(message, param=param)


def _in(name: str, value: Any, limit_name: str | None = None) -> None:
    limit = LIMITS[limit_name or name]
    _check(value in limit, f"{name} must be {limit.describe()}", name)


GRAMMAR_KINDS = ("json_object", "json_schema", "lark", "regex")


@dataclass(frozen=True)
class Grammar:
    """What a request's output must be (`inference.engine.structured` holds decoding to it).

    `kind`: "json_object" (any JSON object), "json_schema" (`source`: the schema as JSON text),
    "lark" or "regex" (`source`: the grammar). `param` names the API field it came from, so an
    error about it names that field."""

    kind: str
    source: str = ""
    param: str = "response_format"

    def __post_init__(self):
        _check(self.kind in GRAMMAR_KINDS, f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}", self.param)
        _check(isinstance(self.source, str), "a grammar's source must be text", self.param)

    @property
    def key(self) -> str:
        """What compiled grammars are cached by: the same kind and source compile the same."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens, as in transformers
    presence_penalty: float = 0.0  # over output tokens, as in the OpenAI API
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per sampled token; 0 = the token's own only
    include_stop_str_in_output: bool = False
    grammar: Grammar | None = None  # structured output: every token keeps the output inside it
    # False: never speculate for this request (the API's extra body `speculative: false`); the
    # engine also leaves out requests with a grammar, penalties or logprobs.
    speculative: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            _in(name, getattr(self, name))
        if self.seed is not None:
            _in("seed", self.seed)
        if self.logprobs is not None:
            _in("logprobs", self.logprobs, "top_logprobs")
        _check(len(self.stop) <= MAX_STOP_SEQUENCES, f"at most {MAX_STOP_SEQUENCES} stop sequences", "stop")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop sequences must be non-empty strings", "stop")
        _check(sum(map(len, self.stop)) <= MAX_STOP_TOTAL_CHARS,
               f"stop sequences hold at most {MAX_STOP_TOTAL_CHARS} characters together", "stop")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", "stop_token_ids")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers", "stop_token_ids")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos must be a boolean", "ignore_eos")
        _check(isinstance(self.speculative, bool), "speculative must be a boolean", "speculative")
        _check(self.grammar is None or isinstance(self.grammar, Grammar), "grammar must be a Grammar", "response_format")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob) best first


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: a delta, never the whole text so far."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None
    # "grammar": the request's own grammar reached a dead end (finish_reason "error"); the
    # client's schema is at fault, not the engine, which serves on. "queue_timeout": it waited
    # past its lane's queue timeout and never ran.
    error_kind: str | None = None


@dataclass(frozen=True)
class LaneStats:
    waiting: int = 0
    running: int = 0
    swapped: int = 0
    aged_up: int = 0  # waiting requests whose effective lane has risen above their own
    # Speculative decoding: a sequence's steps that verified a draft, the draft tokens proposed,
    # and those the target accepted (each emitted beside the pass's own token).
    spec_passes: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


def _no_lanes() -> Mapping[Lane, LaneStats]:
    return MappingProxyType({lane: LaneStats() for lane in Lane})


@dataclass(frozen=True)
class EngineStats:
    """The engine's state after a step. `LLMEngine.stats()` builds it; `AsyncEngine.stats()` adds
    what only the serving loop knows (readiness, requests in flight, step errors, restarts)."""

    lanes: Mapping[Lane, LaneStats] = field(default_factory=_no_lanes)
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    paused: int = 0  # held out of the steps while their consumers catch up (in any queue)
    blocks_total: int = 0
    blocks_free: int = 0  # free to allocate, evictable cached blocks included
    blocks_used: int = 0
    blocks_cached: int = 0  # holding a reusable prefix
    block_size: int = 0
    swap_blocks_total: int = 0
    swap_blocks_used: int = 0
    preemptions: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    steps_interrupted: int = 0  # abandoned between layers for a newly arrived request (LLMEngine._watch)
    tokens_per_s: float = 0.0  # recent throughput (decaying peak)
    steps: int = 0
    prompt_tokens: int = 0  # of admitted requests
    computed_tokens: int = 0  # run through the model: prefill chunks and decodes
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache instead
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    ready: bool = False
    in_flight: int = 0
    step_errors: int = 0
    restarts: int = 0

    def lane(self, lane: int) -> LaneStats:
        return self.lanes[Lane(lane)]

    @property
    def spec_passes(self) -> int:
        return sum(s.spec_passes for s in self.lanes.values())

    @property
    def spec_draft_tokens(self) -> int:
        return sum(s.spec_draft_tokens for s in self.lanes.values())

    @property
    def spec_accepted_tokens(self) -> int:
        return sum(s.spec_accepted_tokens for s in self.lanes.values())

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_tokens_per_pass(self) -> float:
        """Tokens a speculating sequence's step yields: its own one and the accepted drafts (0 before any)."""
        return 1 + self.spec_accepted_tokens / self.spec_passes if self.spec_passes else 0.0
